"""Launchers for hvd-gradcomp: the ``hvdgc-launch`` command, its Slurm support, and local jobs.

- :mod:`launchers.command` builds the command to run (pure: options in, argv and env out);
  every horovodrun/mpirun/srun argv of the project comes from it.
- :mod:`launchers.slurm` reads a Slurm allocation and writes or submits batch scripts.
- :mod:`launchers.watch` relays a running job's output, names the host behind a failure
  and ends the job when a remote host is lost.
- :mod:`launchers.cli` is the click front end that validates input and runs the job.
- :mod:`launchers.jobs` runs a local multi-rank job with a timeout (tests, demo, benchmark).
- :mod:`launchers.progress` prints progress that reads cleanly under a launcher.
- :mod:`launchers.two_hosts` runs a job across the two hosts of ``scripts/two_hosts.sh`` (tests, benchmark).
- :mod:`launchers.bench` is ``hvdgc-bench``: it runs the benchmark of a checkout (``make bench``).

See docs/LAUNCHING.md.
"""
