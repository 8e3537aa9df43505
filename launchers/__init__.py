"""Launchers for hvd-gradcomp: the ``hvdgc-launch`` command and its Slurm support.

- :mod:`launchers.command` builds the command to run (pure: options in, argv and env out).
- :mod:`launchers.slurm` reads a Slurm allocation and writes or submits batch scripts.
- :mod:`launchers.watch` relays a running job's output, names the host behind a failure
  and ends the job when a remote host is lost.
- :mod:`launchers.cli` is the click front end that validates input and runs the job.

See docs/LAUNCHING.md.
"""
