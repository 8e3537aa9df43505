"""Build the command that starts a distributed run: a :class:`LaunchSpec` in, ``(argv, env)`` out.

Nothing here reads the process environment, touches the file system or uses a shell, so
every branch is tested with exact expected lists (tests/test_launch_command.py). The CLI
(:mod:`hvd_gradcomp.launchers.cli`) gathers the facts (tool paths, euid, Slurm allocation) and runs the
result without a shell.

Example::

    >>> spec = LaunchSpec(command=("train.py", "--epochs", "3"), np=2, python="python",
    ...                   env={"HVDGC_COMPRESSION": "topk"}, backend="gloo")
    >>> argv, env = build_command(spec)
    >>> argv
    ['horovodrun', '-np', '2', '-H', 'localhost:2', '--gloo', 'python', 'train.py', '--epochs', '3']
    >>> env
    {'HVDGC_COMPRESSION': 'topk'}
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

Host = Tuple[str, int]

LAUNCHERS = ("horovodrun", "mpirun", "srun", "torchrun")
BACKENDS = ("gloo", "mpi")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# Variables every mpirun rank needs to find the same Python and libraries on remote hosts.
FORWARDED_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")

KEEP_FREED_MEMORY: Mapping[str, str] = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""``--keep-freed-memory``: glibc's allocator keeps the memory a rank frees for its next use.

By default glibc gives large blocks back to the kernel on ``free()`` (above a threshold that moves
at run time), so a CPU rank's large tensors come back each step as fresh pages, each a page fault
the kernel zeroes. With 2 ranks on 2 cores (``benchmarks/step_probe.py --sync-breakdown``): 16-24k
faults per step, 8 ms more CPU on whichever rank's threshold ended lower, and the other rank
waited for it in ``synchronize()``; with these, no faults. PyTorch advises a caching allocator
for CPU training for the same reason. A CUDA run's tensors never reach glibc.
"""

# Host names and IPv4 addresses; anything else (spaces, ';', '[') is a typo or an attack.
_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class LaunchError(ValueError):
    """Bad launch input; the message names the problem and how to fix it."""


@dataclass(frozen=True)
class LaunchSpec:
    """Everything that decides the launch command, already resolved by the caller.

    ``command`` is the training script and its arguments, forwarded untouched. ``hosts``
    are the slots to validate ``np`` against (from ``-H``, a hostfile or Slurm);
    ``hosts_origin`` names where they came from, for error messages. With ``hostfile`` set
    the hosts still reach the tool as ``-H`` (normalised: horovodrun and Open MPI read hostfile
    lines differently), and ``hostfile`` only names where they came from. ``env`` is what the
    launch adds to the environment; ``forward_env`` names further variables that mpirun must
    export to remote ranks.

    The mapped launcher options: ``network_interface`` (horovodrun ``--network-interface``,
    Open MPI ``btl_tcp_if_include``/``oob_tcp_if_include``), ``log_level`` (horovodrun
    ``--log-level``, else ``HOROVOD_LOG_LEVEL``), ``tcp`` (horovodrun ``--tcp``, Open MPI
    ``btl tcp,self``), ``timeline`` (horovodrun ``--timeline-filename``, else
    ``HOROVOD_TIMELINE``). ``launcher_args`` go to the launcher verbatim, before the program.
    ``bind_cores``: each rank on a machine gets its own slice of the cores (srun
    ``--cpu-bind=cores``, elsewhere the program starts through :mod:`hvd_gradcomp.launchers.bind`).
    """

    command: Tuple[str, ...]
    np: Optional[int] = None
    hosts: Optional[Tuple[Host, ...]] = None
    hosts_origin: str = ""
    hostfile: Optional[str] = None
    launcher: str = "horovodrun"
    backend: Optional[str] = None
    ssh_port: Optional[int] = None
    start_timeout: Optional[int] = None
    verbose: bool = False
    python: str = "python"
    env: Mapping[str, str] = field(default_factory=dict)
    forward_env: Tuple[str, ...] = ()
    as_root: bool = False
    network_interface: Optional[str] = None
    log_level: Optional[str] = None
    tcp: bool = False
    timeline: Optional[str] = None
    launcher_args: Tuple[str, ...] = ()
    bind_cores: bool = False


def parse_hosts(spec: str) -> List[Host]:
    """Parse a horovodrun ``-H`` value into ``(host, slots)`` pairs; a bare host has 1 slot.

    >>> parse_hosts("node1:4,node2:2")
    [('node1', 4), ('node2', 2)]
    >>> parse_hosts("localhost")
    [('localhost', 1)]
    """
    if not spec.strip():
        raise LaunchError("-H is empty; write it as host:slots[,host:slots...], e.g. -H node1:4,node2:4")
    hosts = [_parse_host_entry(item, f"-H {spec}") for item in spec.split(",")]
    return _no_duplicates(hosts, f"-H {spec}")


def parse_hostfile_text(text: str, name: str = "hostfile") -> List[Host]:
    """Parse a hostfile: ``host slots=N``, ``host:N`` or a bare ``host`` (1 slot) per line.

    Blank lines and ``#`` comments are skipped. The result reaches the launcher as ``-H``,
    which horovodrun and Open MPI read alike (their own hostfile readers do not: horovodrun
    fails on ``host:N`` and bare hosts, Open MPI reads ``host:N`` as a host name).

    >>> parse_hostfile_text("node1 slots=4\\n# spare\\nnode2:2\\nnode3\\n")
    [('node1', 4), ('node2', 2), ('node3', 1)]
    """
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name} line {lineno} ({raw.strip()!r})"
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)", line)
        entry = f"{match.group(1)}:{match.group(2)}" if match else line
        hosts.append(_parse_host_entry(entry, where))
    if not hosts:
        raise LaunchError(f"{name} lists no hosts; write one 'host slots=N' per line")
    return _no_duplicates(hosts, name)


def _parse_host_entry(item: str, where: str) -> Host:
    name, sep, slots_text = item.strip().partition(":")
    if not _HOST_RE.match(name):
        raise LaunchError(f"malformed host {item.strip()!r} in {where}; write host:slots, e.g. node1:4")
    if not sep:
        return name, 1
    if not slots_text.isdigit() or int(slots_text) < 1:
        raise LaunchError(f"malformed slots in {item.strip()!r} in {where}; slots must be a whole number >= 1")
    return name, int(slots_text)


def _no_duplicates(hosts: List[Host], where: str) -> List[Host]:
    names = [h for h, _ in hosts]
    for name in names:
        if names.count(name) > 1:
            raise LaunchError(f"host {name!r} appears twice in {where}; list each host once with all its slots")
    return hosts


def format_hosts(hosts: Sequence[Host]) -> str:
    """The ``-H`` text for ``hosts``.

    >>> format_hosts([("node1", 4), ("node2", 2)])
    'node1:4,node2:2'
    """
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


def resolve_np(np: Optional[int], hosts: Optional[Sequence[Host]], origin: str = "the hosts") -> int:
    """The number of ranks: ``np`` checked against the slots, or all slots (1 without hosts).

    >>> resolve_np(None, [("a", 4), ("b", 4)])
    8
    >>> resolve_np(3, None)
    3
    """
    if np is not None and np < 1:
        raise LaunchError(f"-np must be at least 1, got {np}")
    if hosts is None:
        return 1 if np is None else np
    total = sum(slots for _, slots in hosts)
    if np is None:
        return total
    if np > total:
        raise LaunchError(f"-np {np} is more than the {total} slots in {origin}; lower -np or give more hosts/slots")
    return np


def program_argv(command: Sequence[str], python: str) -> List[str]:
    """How each rank starts the program: ``python script.py args`` for Python files, else as is.

    >>> program_argv(["train.py", "--lr", "0.1"], "/venv/bin/python")
    ['/venv/bin/python', 'train.py', '--lr', '0.1']
    >>> program_argv(["./run.sh", "x"], "python")
    ['./run.sh', 'x']
    """
    if not command:
        raise LaunchError("missing training script; usage: hvdgc-launch [OPTIONS] SCRIPT [ARGS]...")
    if command[0].endswith(".py"):
        return [python, *command]
    return list(command)


def build_command(spec: LaunchSpec) -> Tuple[List[str], Dict[str, str]]:
    """The argv to run (no shell) and the variables to add to the environment.

    ``argv[0]`` is the launcher's name; the caller may replace it with a full path.

    >>> argv, env = build_command(LaunchSpec(command=("t.py",), np=2, launcher="mpirun", python="py"))
    >>> argv
    ['mpirun', '-np', '2', '-H', 'localhost:2', '-bind-to', 'none', '-map-by', 'slot', 'py', 't.py']
    """
    if spec.launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {spec.launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    if spec.backend not in (None, *BACKENDS):
        raise LaunchError(f"unknown backend {spec.backend!r}; use --gloo or --mpi")
    if spec.log_level is not None and spec.log_level not in LOG_LEVELS:
        raise LaunchError(f"unknown --log-level {spec.log_level!r}; choose one of {', '.join(LOG_LEVELS)}")
    if spec.network_interface is not None and not _IFACE_RE.match(spec.network_interface):
        raise LaunchError(f"malformed --network-interface {spec.network_interface!r}; give interface names "
                          "separated by commas, e.g. eth0 or eth0,ib0")
    builders = {"horovodrun": _horovodrun_argv, "mpirun": _mpirun_argv, "srun": _srun_argv,
                "torchrun": _torchrun_argv}
    argv = builders[spec.launcher](spec) + list(spec.launcher_args)
    env = dict(spec.env)
    if spec.launcher != "horovodrun":  # horovodrun maps these itself; the others read Horovod's variables
        env.update({name: value for name, value in (("HOROVOD_LOG_LEVEL", spec.log_level),
                                                    ("HOROVOD_TIMELINE", spec.timeline)) if value})
    if spec.launcher == "srun":  # no mpirun command line here: Open MPI reads OMPI_MCA_* instead
        env.update(_mca_env(spec))
    program = program_argv(spec.command, spec.python)
    if spec.bind_cores and spec.launcher != "srun":   # srun binds itself (_srun_argv)
        program = [spec.python, "-m", "hvd_gradcomp.launchers.bind", *program]
    return argv + program, env


_IFACE_RE = re.compile(r"^[A-Za-z0-9_.:@\-]+(,[A-Za-z0-9_.:@\-]+)*$")


def _mca(spec: LaunchSpec) -> List[Tuple[str, str]]:
    """Open MPI parameters for the mapped options: TCP only, and which interfaces to use."""
    params = [("btl", "tcp,self")] if spec.tcp else []
    if spec.network_interface:
        params += [("btl_tcp_if_include", spec.network_interface), ("oob_tcp_if_include", spec.network_interface)]
    return params


def _mca_env(spec: LaunchSpec) -> Dict[str, str]:
    return {f"OMPI_MCA_{name}": value for name, value in _mca(spec)}


def _np_and_hosts(spec: LaunchSpec) -> Tuple[int, List[str]]:
    """``-np N`` plus ``-H ...`` (from -H or a hostfile); localhost when neither was given."""
    np = resolve_np(spec.np, spec.hosts, spec.hosts_origin or "the hosts")
    return np, ["-H", format_hosts(spec.hosts or [("localhost", np)])]


def _horovodrun_argv(spec: LaunchSpec) -> List[str]:
    np, hosts = _np_and_hosts(spec)
    argv = ["horovodrun", "-np", str(np), *hosts]
    if spec.backend:
        argv.append(f"--{spec.backend}")
    if spec.ssh_port is not None:
        argv += ["-p", str(spec.ssh_port)]
    if spec.start_timeout is not None:
        argv += ["--start-timeout", str(spec.start_timeout)]
    if spec.verbose:
        argv.append("--verbose")
    if spec.network_interface:
        argv += ["--network-interface", spec.network_interface]
    if spec.log_level:
        argv += ["--log-level", spec.log_level]
    if spec.tcp:
        argv.append("--tcp")
    if spec.timeline:
        argv += ["--timeline-filename", spec.timeline]
    return argv


def _mpirun_argv(spec: LaunchSpec) -> List[str]:
    _reject(spec, "mpirun", gloo=True, start_timeout=True)
    np, hosts = _np_and_hosts(spec)
    argv = ["mpirun"]
    if spec.as_root:
        argv.append("--allow-run-as-root")  # Open MPI refuses root without it
    argv += ["-np", str(np), *hosts, "-bind-to", "none", "-map-by", "slot"]
    if spec.ssh_port is not None:
        argv += ["-mca", "plm_rsh_args", f"-p {spec.ssh_port}"]
    if spec.verbose:
        argv.append("--display-map")
    for name, value in _mca(spec):
        argv += ["-mca", name, value]
    mapped = [name for name, value in (("HOROVOD_LOG_LEVEL", spec.log_level), ("HOROVOD_TIMELINE", spec.timeline))
              if value]
    exported = sorted({*spec.env, *mapped}) + [name for name in spec.forward_env
                                                if name not in spec.env and name not in mapped]
    for name in exported:
        argv += ["-x", name]  # -x NAME exports the value mpirun itself was started with
    return argv


def _srun_argv(spec: LaunchSpec) -> List[str]:
    _reject(spec, "srun", gloo=True, start_timeout=True, ssh_port=True, hostfile=True)
    np = resolve_np(spec.np, spec.hosts, spec.hosts_origin or "the allocation")
    argv = ["srun", "--mpi=pmix", "--ntasks", str(np)]
    if spec.bind_cores:
        argv.append("--cpu-bind=cores")
    if spec.verbose:
        argv.append("--verbose")
    return argv


def _torchrun_argv(spec: LaunchSpec) -> List[str]:
    """PyTorch DDP ranks on this machine: ``torchrun --standalone``, then the program as given.

    ``--no-python`` lets the program line keep the launcher's own Python (or a non-Python
    command). The script chooses its torch.distributed backend, so --gloo/--mpi do not apply.

    >>> _torchrun_argv(LaunchSpec(command=("t.py",), np=2, launcher="torchrun"))
    ['torchrun', '--standalone', '--nproc-per-node', '2', '--no-python']
    """
    _reject(spec, "torchrun", start_timeout=True, ssh_port=True, hostfile=True)
    if spec.backend is not None:
        raise LaunchError("--gloo/--mpi choose Horovod's controller; with --launcher torchrun the script picks "
                          "the backend (dist.init_process_group('gloo' or 'nccl')): drop the flag")
    if spec.hosts is not None and len(spec.hosts) > 1:
        raise LaunchError(f"--launcher torchrun starts ranks on this machine only, but {spec.hosts_origin or 'the hosts'} "
                          "name several; run torchrun --nnodes on each node, or use --launcher horovodrun")
    np = resolve_np(spec.np, spec.hosts, spec.hosts_origin or "the hosts")
    argv = ["torchrun", "--standalone", "--nproc-per-node", str(np), "--no-python"]
    return argv


def _reject(spec: LaunchSpec, launcher: str, gloo: bool = False, start_timeout: bool = False,
            ssh_port: bool = False, hostfile: bool = False) -> None:
    """Fail on horovodrun-only options that the chosen launcher cannot honour."""
    if gloo and spec.backend == "gloo":
        raise LaunchError(f"--gloo needs horovodrun; drop it or use --launcher horovodrun "
                          f"(--launcher {launcher} runs MPI)")
    if start_timeout and spec.start_timeout is not None:
        raise LaunchError(f"--start-timeout is a horovodrun option; drop it with --launcher {launcher}")
    if ssh_port and spec.ssh_port is not None:
        raise LaunchError(f"-p/--ssh-port does not apply to --launcher {launcher}; Slurm starts the ranks")
    if hostfile and spec.hostfile:
        raise LaunchError(f"--hostfile does not apply to --launcher {launcher}; Slurm places the ranks")
