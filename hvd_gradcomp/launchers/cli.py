"""``hvdgc-launch``: start a Horovod training script with gradient compression.

Examples::

    hvdgc-launch -np 8 examples/train.py --epochs 3
    hvdgc-launch -np 8 -H node1:4,node2:4 --compression topk-qsgd --ratio 0.01 --bits 8 \\
        --accumulate 8 examples/train.py --epochs 3
    hvdgc-launch --dry-run --launcher mpirun -np 2 examples/train.py
    hvdgc-launch --torchrun -np 2 --compression topk-qsgd examples/train_ddp.py --steps 100
    hvdgc-launch --sbatch --nodes 2 --ntasks-per-node 4 --time 1:00:00 --submit examples/train.py

The compression options given reach every rank as ``HVDGC_*`` environment variables that
:func:`hvd_gradcomp.config.from_env` reads; an option not given sets nothing (``from_env`` reads
its default). See docs/LAUNCHING.md.
"""
from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import click

from .. import codecs, config, settings  # the settings modules only: importing them loads no torch
from ..settings import compressions
from . import guard
from .command import (FORWARDED_ENV, KEEP_FREED_MEMORY, LAUNCHERS, LOG_LEVELS, Host, LaunchError, LaunchSpec,
                      build_command, parse_hostfile_text, parse_hosts, resolve_np)
from .slurm import BatchJob, allocation_from_env, render_sbatch, submit
from .watch import JobWatch, is_local, rank_hosts

_TOOL_HINTS = {
    "horovodrun": "install Horovod (bash scripts/setup.sh, or pip install horovod) or use --launcher mpirun",
    "mpirun": "install Open MPI (apt-get install openmpi-bin) or use --launcher horovodrun",
    "srun": "srun comes with Slurm; run inside salloc/sbatch on a Slurm cluster",
    "torchrun": "torchrun comes with PyTorch (pip install torch)",
    "sbatch": "sbatch comes with Slurm; write the script with --sbatch-file and submit it on the cluster",
}


def _find_tool(name: str) -> str:
    """The path of ``name``: next to this Python first (an unactivated venv), then the PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise click.ClickException(f"{name} not found on the PATH; {_TOOL_HINTS[name]}")
    return found


def _split_launcher_args(command: Sequence[str]) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """``(launcher args, script and its args)``: ``[-- ARGS... --] SCRIPT ...`` passes ARGS verbatim.

    >>> _split_launcher_args(["--mca", "btl", "tcp,self", "--", "train.py", "--", "x"])
    (('--mca', 'btl', 'tcp,self'), ('train.py', '--', 'x'))
    >>> _split_launcher_args(["train.py", "--", "x"])
    ((), ('train.py', '--', 'x'))
    """
    if not command or not command[0].startswith("-") or "--" not in command:
        return (), tuple(command)
    cut = list(command).index("--")
    return tuple(command[:cut]), tuple(command[cut + 1:])


def _check_script(command: Sequence[str]) -> None:
    """Fail early on a missing script instead of once per rank."""
    if not command:
        raise click.UsageError("missing training script; usage: hvdgc-launch [OPTIONS] SCRIPT [ARGS]...")
    script = command[0]
    if script.startswith("-"):
        raise click.UsageError(
            f"unknown option {script}; hvdgc-launch's own options go before the script (see hvdgc-launch --help), "
            f"and options for the launcher itself go between two '--': hvdgc-launch [OPTIONS] -- {script} ... "
            "-- SCRIPT [ARGS]...")
    if script.endswith(".py") or os.sep in script:
        if not Path(script).is_file():
            raise click.UsageError(f"script not found: {script}; check the path (relative to {os.getcwd()})")
    elif shutil.which(script) is None:
        raise click.UsageError(f"script not found: {script} is neither a file nor a program on the PATH")


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _extra_env(items: Sequence[str], owned: Sequence[str],
               environ: Mapping[str, str]) -> Tuple[Dict[str, str], Tuple[str, ...]]:
    """``-x NAME=VALUE`` (set on every rank) and ``-x NAME`` (this value, exported to every rank)."""
    added: Dict[str, str] = {}
    forwarded: List[str] = []
    for item in items:
        name, sep, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise LaunchError(f"malformed -x {item!r}; write -x NAME=VALUE or -x NAME (a variable set here)")
        if name in owned:
            raise LaunchError(f"-x {name}: hvdgc-launch sets {name} from its own options (see --help); use them")
        if sep:
            added[name] = value
        elif name in environ:
            forwarded.append(name)
        else:
            raise LaunchError(f"-x {name}: {name} is not set here; export it first or write -x {name}=VALUE")
    return added, tuple(forwarded)


_SETTING_OPTIONS = {name: var for var, (name, _, _) in settings.VARIABLES.items() if name}
"""Each compression option of this launcher (its parameter name, a CompressionConfig field) -> its variable."""


def _compression_env(compression: str, ratio: float, bits: int, accumulate: int,
                     error_feedback: bool, seed: Optional[int], codec_module: Optional[str] = None,
                     given: Optional[Collection[str]] = None) -> Tuple[Dict[str, str], Tuple[str, ...]]:
    """The ``HVDGC_*`` variables for the options the user gave, and every name the launcher owns.

    ``given`` names the options given on the command line (None: all of them). Only those are
    exported: an option left out sets nothing, and the script's ``from_env()`` reads the same
    default for the missing variable, while a script that builds its own compressor sees no
    setting it never asked for (no ``UnreadSettingsWarning``). All the values are checked
    together all the same, as the ranks' ``from_env()`` will read them.

    Owned names that the given options leave unset (``HVDGC_SEED`` without ``--seed``) are
    removed from the job's environment, so a stale value in the shell cannot reach the ranks.
    ``codec_module`` (``--codec-module``) is imported here first, so that ``--compression`` may name a
    codec it registers, and handed to the ranks (``HVDGC_CODEC_MODULE``: ``from_env`` imports it there).

    >>> _compression_env("none", 0.05, 8, 1, True, None, given=("ratio",))[0]
    {'HVDGC_RATIO': '0.05'}
    >>> _compression_env("none", 0.01, 8, 1, True, None, given=())[0]
    {}
    """
    try:
        if codec_module:
            codecs.load_module(codec_module)
        cfg = config.CompressionConfig(compression=compression, ratio=ratio, bits=bits, accumulate=accumulate,
                                       error_feedback=error_feedback, seed=seed)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    owned = tuple(_SETTING_OPTIONS.values()) + (settings.ENV_CODEC_MODULE,)
    exported = set(_SETTING_OPTIONS.values()) if given is None else {_SETTING_OPTIONS[n] for n in given}
    env = {var: value for var, value in cfg.to_env().items() if var in exported}
    if codec_module:
        env[settings.ENV_CODEC_MODULE] = codec_module
    return env, owned


def _given(ctx: click.Context, names: Collection[str]) -> Tuple[str, ...]:
    """Which of these options the command line gave (not left at their defaults)."""
    return tuple(name for name in names
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT)


def _hosts(hosts: Optional[str], hostfile: Optional[str],
           environ: Mapping[str, str]) -> Tuple[Optional[Tuple[Host, ...]], str, Optional[int]]:
    """(hosts, where they came from, Slurm's task count): -H, else --hostfile, else Slurm, else none."""
    if hosts is not None and hostfile is not None:
        raise LaunchError("give either -H or --hostfile, not both")
    if hosts is not None:
        return tuple(parse_hosts(hosts)), f"-H {hosts}", None
    if hostfile is not None:
        return tuple(parse_hostfile_text(Path(hostfile).read_text(), hostfile)), f"--hostfile {hostfile}", None
    alloc = allocation_from_env(environ)
    if alloc is None:
        return None, "", None
    return alloc.hosts, f"the Slurm allocation ({alloc.nodelist})", alloc.ntasks


def _print_command(argv: List[str], env: Mapping[str, str], unset: Sequence[str] = (),
                   inherited: Mapping[str, str] = (), err: bool = False) -> None:
    """Copy-pasteable: the variables the launch adds and removes, then the command.

    ``inherited`` lists the other ``HVDGC_*`` variables of this shell, which reach the ranks
    as they are, so that nothing the ranks read is hidden.
    """
    click.echo("# environment added:", err=err)
    for key in sorted(env):
        click.echo(f"export {key}={shlex.quote(env[key])}", err=err)
    if unset:
        click.echo("# environment removed (set by hvdgc-launch options only):", err=err)
        click.echo(f"unset {' '.join(sorted(unset))}", err=err)
    if inherited:
        click.echo("# HVDGC_* variables passed on from this shell:", err=err)
        for key in sorted(inherited):
            click.echo(f"export {key}={shlex.quote(inherited[key])}", err=err)
    click.echo("# command:", err=err)
    click.echo(shlex.join(argv), err=err)


def run(argv: List[str], env: Mapping[str, str], unset: Sequence[str] = (), watch: Optional[JobWatch] = None,
        kill_after: float = 10.0) -> int:
    """Run argv (no shell) with ``env`` added and ``unset`` removed; forward SIGINT/SIGTERM.

    Returns the job's exit code (128+N when it died of signal N, or exited 0 after this process
    passed it signal N). argv runs under
    :mod:`hvd_gradcomp.launchers.guard`, which passes those signals on, kills every process of the job on
    the third, and is told by the kernel when this process dies, whatever kills it (even
    SIGKILL, which no handler sees): it then ends every process of the job, those in other
    sessions too, so no rank outlives its launcher.

    With a ``watch`` the job's output is relayed through it, and a host it reports lost ends
    the job (SIGTERM, then SIGKILL after ``kill_after`` s); a failed job ends with its summary.
    """
    received: List[int] = []
    children: List[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for child in children:
            guard.send(child.pid, signum)   # the guard counts them and escalates on the third

    def end_job(host: str) -> None:
        click.echo(watch.lost_message(host), err=True)
        for child in children:
            guard.send(child.pid, signal.SIGTERM)
            timer = threading.Timer(kill_after, guard.send, (child.pid, guard.KILL_NOW))
            timer.daemon = True
            timer.start()

    child_env = {k: v for k, v in os.environ.items() if k not in unset}
    child_env.update(env)
    pipes = [os.pipe(), os.pipe()] if watch else []
    sys.stdout.flush()
    sys.stderr.flush()
    # Handlers go in before the child starts, so a Ctrl-C in between cannot orphan it.
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        guarded = [sys.executable, "-m", "hvd_gradcomp.launchers.guard", "--parent", str(os.getpid()),
                   "--grace", str(kill_after), "--", *argv]
        children.append(subprocess.Popen(guarded, env=child_env, start_new_session=True,
                                         stdout=pipes[0][1] if pipes else None,
                                         stderr=pipes[1][1] if pipes else None,
                                         preexec_fn=_die_with_parent(os.getpid())))
        for signum in received:
            guard.send(children[0].pid, signum)
        if watch:
            for (read_end, write_end), target in zip(pipes, (1, 2)):
                os.close(write_end)
                watch.relay(read_end, target)
            watch.start_watchdog(end_job)
        code = children[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = code if code >= 0 else 128 - code
    if received and code == 0:
        # The job ended on our Ctrl-C/SIGTERM but its launcher (horovodrun) said 0 now and then: an
        # interrupted job must not look finished to `hvdgc-launch ... && next-step`.
        code = 128 + received[0]
    if watch:
        watch.stop()
        code = code or (1 if watch.lost else 0)
        summary = watch.summary(code)
        if summary:
            click.echo(summary, err=True)
    return code


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent: int):
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when ``parent`` dies.

    The child is :mod:`hvd_gradcomp.launchers.guard`, which then ends every process of the job. Linux only;
    elsewhere the launcher still forwards the signals it can catch.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child may not load libraries
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
            os._exit(143)
    return preexec


def _self_command() -> List[str]:
    """How a batch script calls this launcher: the installed script, else ``python -m``."""
    beside = Path(sys.executable).parent / "hvdgc-launch"
    if beside.is_file():
        return [str(beside)]
    return [sys.executable, "-m", "hvd_gradcomp.launchers.cli"]


@click.command(name="hvdgc-launch", context_settings={
    "ignore_unknown_options": True, "allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    epilog="Options of horovodrun/mpirun/srun that have no hvdgc-launch option go between two '--': "
           "hvdgc-launch -np 2 --launcher mpirun -- --mca btl_tcp_links 2 -- train.py")
@click.option("-np", "--num-proc", "np", type=int, help="Number of ranks [default: all slots, or SLURM_NTASKS, or 1].")
@click.option("-H", "--hosts", help="Hosts and slots, e.g. node1:4,node2:4 [default: localhost:NP].")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
              help="File with one 'host slots=N', 'host:N' or 'host' per line ('#' comments).")
@click.option("--gloo/--mpi", "gloo", default=None, help="Horovod controller [default: Horovod's choice].")
@click.option("-p", "--ssh-port", type=int, help="SSH port of the remote hosts.")
@click.option("--start-timeout", type=int, help="Seconds horovodrun waits for all ranks to start.")
@click.option("--network-interface", metavar="IF[,IF...]",
              help="Network interfaces between the hosts (horovodrun --network-interface; "
                   "Open MPI btl_tcp_if_include and oob_tcp_if_include).")
@click.option("--bind-cores", is_flag=True,
              help="Give each rank on a machine its own slice of the cores (hvd_gradcomp/launchers/bind.py; srun --cpu-bind=cores).")
@click.option("--keep-freed-memory", is_flag=True,
              help="CPU ranks: glibc keeps the memory a rank frees instead of returning it to the kernel each "
                   "step (sets MALLOC_MMAP_MAX_=0 and MALLOC_TRIM_THRESHOLD_ on every rank).")
@click.option("--tcp", is_flag=True, help="TCP only (horovodrun --tcp; Open MPI --mca btl tcp,self).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              help="Horovod's log level (horovodrun --log-level, else HOROVOD_LOG_LEVEL).")
@click.option("--timeline-filename", metavar="FILE",
              help="Horovod timeline file (horovodrun --timeline-filename, else HOROVOD_TIMELINE).")
@click.option("-x", "--env", "env_vars", multiple=True, metavar="NAME[=VALUE]",
              help="Set NAME=VALUE on every rank, or export this shell's NAME to every rank; repeatable.")
@click.option("--lost-host-timeout", type=click.FloatRange(min=0), default=20, show_default=True, metavar="S",
              help="End the job when a remote host has not answered on its ssh port for S seconds (0: never).")
@click.option("--verbose", is_flag=True, help="Print the command and make the launcher verbose.")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="horovodrun", show_default=True,
              help="What starts the ranks; srun (--mpi=pmix) only inside a Slurm allocation; torchrun "
                   "for PyTorch DDP scripts (hvd_gradcomp.ddp), on this machine.")
@click.option("--torchrun", is_flag=True, help="Same as --launcher torchrun.")
@click.option("--compression", default="none", show_default=True,
              help=f"{', '.join(compressions())} (hvd_gradcomp.settings.compressions).")
@click.option("--codec-module", metavar="MODULE",
              help="Import MODULE first (here and on every rank): it registers codecs of its own that "
                   "--compression may name. Installed packages' codecs are found without it (entry points "
                   "in the group hvd_gradcomp.codecs).")
@click.option("--ratio", type=float, default=0.01, show_default=True, help="TopK: fraction of entries sent.")
@click.option("--bits", type=int, default=8, show_default=True, help="QSGD: bits per value (2..8).")
@click.option("--accumulate", type=int, default=1, show_default=True, help="Backward passes per optimizer step.")
@click.option("--error-feedback/--no-error-feedback", default=True, show_default=True,
              help="Keep what compression dropped and add it to the next gradient.")
@click.option("--seed", type=int, help="Seed of QSGD's stochastic rounding.")
@click.option("--dry-run", is_flag=True, help="Print the command and the environment it changes; run nothing.")
@click.option("--sbatch", is_flag=True, help="Write a Slurm batch script for this run instead of running it.")
@click.option("--nodes", type=int, default=1, show_default=True, help="--sbatch: nodes to ask for.")
@click.option("--ntasks-per-node", type=int, default=1, show_default=True, help="--sbatch: ranks per node.")
@click.option("--time", "time_limit", help="--sbatch: time limit, e.g. 1:00:00.")
@click.option("--partition", help="--sbatch: partition.")
@click.option("--job-name", default="hvdgc", show_default=True, help="--sbatch: job name.")
@click.option("--output", help="--sbatch: log file [default: %x-%j.out in the submit directory].")
@click.option("--sbatch-file", type=click.Path(dir_okay=False), help="--sbatch: write the script here "
              "[default: print it, or pipe it to sbatch with --submit].")
@click.option("--submit", is_flag=True, help="--sbatch: submit the script with sbatch.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- LAUNCHER_ARGS... --] SCRIPT [ARGS]...")
@click.pass_context
def main(ctx: click.Context, command: Tuple[str, ...], **opts: object) -> None:
    """Run SCRIPT [ARGS]... on NP Horovod ranks (PyTorch DDP ranks with --torchrun); ARGS go to it untouched."""
    launcher_args, command = _split_launcher_args(command)
    _check_script(command)
    _check_sbatch_only(ctx)
    _torchrun_flag(ctx, opts)
    env, owned = _compression_env(opts["compression"], opts["ratio"], opts["bits"], opts["accumulate"],
                                  opts["error_feedback"], opts["seed"], opts["codec_module"],
                                  given=_given(ctx, _SETTING_OPTIONS))
    try:
        if opts["sbatch"]:
            _sbatch(ctx, command, launcher_args, env, owned, opts)
            return
        argv, added, spec = _plan(command, launcher_args, env, owned, opts, os.environ)
    except LaunchError as err:
        raise click.UsageError(str(err)) from None
    unset = [name for name in owned if name in os.environ and name not in added]
    inherited = {k: v for k, v in os.environ.items() if k.startswith("HVDGC_") and k not in owned and k not in added}
    if opts["dry_run"]:
        _print_command(argv, added, unset, inherited)
        return
    if opts["verbose"]:
        _print_command(argv, added, unset, inherited, err=True)
    try:
        ctx.exit(run(argv, added, unset, _watch(spec, float(opts["lost_host_timeout"]))))
    except OSError as err:
        raise click.ClickException(f"cannot start {argv[0]}: {err.strerror}") from None


def _torchrun_flag(ctx: click.Context, opts: Dict[str, object]) -> None:
    """``--torchrun`` is ``--launcher torchrun``; with another --launcher it is a contradiction."""
    if not opts.pop("torchrun"):
        return
    if ctx.get_parameter_source("launcher") is not click.core.ParameterSource.DEFAULT and opts["launcher"] != "torchrun":
        raise click.UsageError(f"--torchrun contradicts --launcher {opts['launcher']}; give one of them")
    opts["launcher"] = "torchrun"


_SBATCH_ONLY = ("nodes", "ntasks_per_node", "time_limit", "partition", "job_name", "output", "sbatch_file", "submit")
# Options of this call that the batch script's own hvdgc-launch must not repeat.
_NOT_RELAUNCHED = ("sbatch", "dry_run", "hosts", "hostfile", *_SBATCH_ONLY)


def _check_sbatch_only(ctx: click.Context) -> None:
    """Batch options without --sbatch would be silently ignored; say so instead."""
    if ctx.params["sbatch"]:
        return
    given = [name for name in _SBATCH_ONLY
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        option = next(p.opts[0] for p in ctx.command.params if p.name == given[0])
        raise click.UsageError(f"{option} only applies with --sbatch; add --sbatch or drop it")


def _spec(command: Tuple[str, ...], launcher_args: Tuple[str, ...], env: Dict[str, str], owned: Sequence[str],
          opts: Mapping[str, object], environ: Mapping[str, str], hosts: Optional[Tuple[Host, ...]],
          origin: str, np: Optional[int]) -> LaunchSpec:
    """The LaunchSpec for these options; the one place that maps options to it."""
    extra, forwarded = _extra_env(opts["env_vars"], owned, environ)
    log_level = opts["log_level"]
    return LaunchSpec(
        command=command, np=np, hosts=hosts, hosts_origin=origin, hostfile=opts["hostfile"],
        launcher=str(opts["launcher"]),
        backend=None if opts["gloo"] is None else ("gloo" if opts["gloo"] else "mpi"),
        ssh_port=opts["ssh_port"], start_timeout=opts["start_timeout"], verbose=bool(opts["verbose"]),
        python=sys.executable, env={**env, **(KEEP_FREED_MEMORY if opts["keep_freed_memory"] else {}), **extra},
        forward_env=tuple(n for n in FORWARDED_ENV if n in environ) + forwarded,
        as_root=os.geteuid() == 0, network_interface=opts["network_interface"],
        log_level=str(log_level).upper() if log_level else None, tcp=bool(opts["tcp"]),
        timeline=opts["timeline_filename"], launcher_args=launcher_args, bind_cores=bool(opts["bind_cores"]))


def _plan(command: Tuple[str, ...], launcher_args: Tuple[str, ...], env: Dict[str, str], owned: Sequence[str],
          opts: Mapping[str, object], environ: Mapping[str, str]) -> Tuple[List[str], Dict[str, str]]:
    """Gather the facts (hosts, tool, euid) into a LaunchSpec and build it."""
    launcher = str(opts["launcher"])
    hosts, origin, slurm_ntasks = _hosts(opts["hosts"], opts["hostfile"], environ)
    if launcher == "srun":
        if opts["hosts"] is not None or "SLURM_JOB_ID" not in environ:
            raise LaunchError("--launcher srun runs inside a Slurm allocation (salloc/sbatch) and takes no -H; "
                              "use --sbatch to write one, or --launcher horovodrun")
    np = opts["np"] if opts["np"] is not None else slurm_ntasks
    spec = _spec(command, launcher_args, env, owned, opts, environ, hosts, origin, np)
    argv, added = build_command(spec)
    return [_find_tool(launcher), *argv[1:]], added, spec


def _watch(spec: LaunchSpec, lost_host_timeout: float) -> JobWatch:
    """What watches this job: which rank runs where, and which hosts to probe (ssh launchers only)."""
    np = resolve_np(spec.np, spec.hosts)
    hosts = spec.hosts or (("localhost", np),)
    remote = [] if spec.launcher == "srun" else [name for name, _ in hosts if not is_local(name)]
    return JobWatch(rank_hosts(hosts, np), remote, spec.ssh_port or 22, lost_host_timeout)


def _relaunch_args(ctx: click.Context) -> List[str]:
    """The options given on this command line that the batch script's hvdgc-launch repeats,
    rebuilt from the parsed values (a new option is forwarded without being listed here)."""
    args: List[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in _NOT_RELAUNCHED \
                or ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
            continue
        value = ctx.params[param.name]
        if param.is_flag and param.secondary_opts:      # --gloo/--mpi, --error-feedback/--no-error-feedback
            args.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            args += [param.opts[0]] if value else []
        elif param.multiple:                            # -x A=1 -x B
            args += [item for one in value for item in (param.opts[0], str(one))]
        elif value is not None:
            args += [param.opts[0], str(value)]
    return args


def _sbatch(ctx: click.Context, command: Tuple[str, ...], launcher_args: Tuple[str, ...], env: Dict[str, str],
            owned: Sequence[str], opts: Mapping[str, object]) -> None:
    """Write (and maybe submit) a batch script that runs this launch inside the allocation.

    The launch is validated here as it will run there (same checks as a direct launch, on
    the allocation asked for), so a script never carries options the launcher refuses.
    """
    if opts["hosts"] is not None or opts["hostfile"] is not None:
        raise LaunchError("-H/--hostfile do not combine with --sbatch: the allocation gives the hosts; "
                          "use --nodes and --ntasks-per-node")
    nodes, per_node = int(opts["nodes"]), int(opts["ntasks_per_node"])
    if nodes < 1 or per_node < 1:
        raise LaunchError("--nodes and --ntasks-per-node must be at least 1")
    origin = f"--nodes {nodes} x --ntasks-per-node {per_node}"
    resolve_np(opts["np"], [("allocation", nodes * per_node)], origin)
    # Node names are Slurm's to choose; any names validate the same way.
    planned = tuple((f"node{i}", per_node) for i in range(1, nodes + 1))
    build_command(_spec(command, launcher_args, env, owned, opts, os.environ, planned, origin, opts["np"]))
    inner = _self_command() + _relaunch_args(ctx)
    if launcher_args:
        inner += ["--", *launcher_args, "--"]
    inner += list(command)
    script = render_sbatch(BatchJob(
        command=tuple(inner), nodes=nodes, ntasks_per_node=per_node,
        time=opts["time_limit"], partition=opts["partition"], job_name=str(opts["job_name"]),
        output=opts["output"], workdir=os.getcwd()))
    path = opts["sbatch_file"]
    if path:
        try:
            Path(str(path)).write_text(script)
        except OSError as err:
            raise click.ClickException(f"cannot write {path}: {err.strerror}") from None
        click.echo(f"wrote {path}", err=True)
    elif not opts["submit"] or opts["dry_run"]:
        click.echo(script, nl=False)
    if opts["submit"] and not opts["dry_run"]:
        job_id = submit(script, _find_tool("sbatch"))
        click.echo(f"Submitted batch job {job_id}")


if __name__ == "__main__":
    main()
