"""Launchers for hvd-gradcomp: the ``hvdgc-launch`` command, its Slurm support, and local jobs.

- :mod:`hvd_gradcomp.launchers.command` builds the command to run (pure: options in, argv and env out);
  every horovodrun/mpirun/srun argv of the project comes from it.
- :mod:`hvd_gradcomp.launchers.slurm` reads a Slurm allocation and writes or submits batch scripts.
- :mod:`hvd_gradcomp.launchers.watch` relays a running job's output, names the host behind a failure
  and ends the job when a remote host is lost.
- :mod:`hvd_gradcomp.launchers.cli` is the click front end that validates input and runs the job.
- :mod:`hvd_gradcomp.launchers.jobs` runs a local multi-rank job with a timeout (tests, demo, benchmark).
- :mod:`hvd_gradcomp.launchers.progress` prints progress that reads cleanly under a launcher.

See docs/LAUNCHING.md.
"""
