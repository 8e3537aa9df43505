"""Slurm support: read the allocation a job runs in, and write or submit batch scripts.

Inside ``salloc``/``sbatch`` (``SLURM_JOB_ID`` set) the hosts and slots come from Slurm::

    >>> alloc = allocation_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[1-2]",
    ...                              "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS": "8"})
    >>> alloc.hosts, alloc.ntasks
    ((('gpu1', 4), ('gpu2', 4)), 8)

The node list is expanded here, in Python, so that parsing is tested without Slurm and
works where ``scontrol`` is not on the PATH. ``render_sbatch`` writes a batch script that
runs ``hvdgc-launch`` inside the allocation it asks for; ``submit`` hands it to ``sbatch``.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

from .command import Host, LaunchError

ENV_JOB_ID = "SLURM_JOB_ID"
ENV_NODELIST = "SLURM_JOB_NODELIST"
ENV_NTASKS = "SLURM_NTASKS"
ENV_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
ENV_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
ENV_NUM_NODES = "SLURM_JOB_NUM_NODES"
# Beyond any machine a launcher here would start; a node list naming more is a mistake.
MAX_NODES = 100_000

_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME_RE = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")


class SlurmError(LaunchError):
    """A Slurm variable or batch option that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Allocation:
    """The part of a Slurm allocation a launcher needs."""

    job_id: str
    hosts: Tuple[Host, ...]
    ntasks: Optional[int]
    nodelist: str


def expand_nodelist(spec: str, limit: Optional[int] = None) -> List[str]:
    """Expand a Slurm host list, as ``scontrol show hostnames`` does.

    The names are counted before any is made, so a list naming more than ``limit`` nodes
    (default :data:`MAX_NODES`) fails at once instead of filling memory.

    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> expand_nodelist("r[1-2]n[1-2]")
    ['r1n1', 'r1n2', 'r2n1', 'r2n2']
    >>> expand_nodelist("node[1-1000000000]", limit=2)
    Traceback (most recent call last):
    ...
    hvd_gradcomp.launchers.slurm.SlurmError: SLURM_JOB_NODELIST='node[1-1000000000]' names 1000000000 nodes, more than 2
    """
    limit = MAX_NODES if limit is None else limit
    total = count_nodelist(spec)
    if total > limit:
        raise SlurmError(f"{ENV_NODELIST}={spec!r} names {total} nodes, more than {limit}")
    return [host for item in _split_top_level(spec) for host in _expand_item(item, spec)]


def count_nodelist(spec: str) -> int:
    """How many hosts a Slurm host list names, without making them.

    >>> count_nodelist("node[1-1000000000],gpu[1-2]")
    1000000002
    """
    items = _split_top_level(spec)
    if not spec.strip() or any(not item for item in items):
        raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: empty host name")
    return sum(_count_item(item, spec) for item in items)


def _split_top_level(spec: str) -> List[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(spec[start:i].strip())
            start = i + 1
    if depth:
        raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: unclosed '['")
    return items + [spec[start:].strip()]


def _parse_item(item: str, spec: str) -> Optional[Tuple[str, List[Tuple[int, int, int]], str]]:
    """``prefix[ranges]rest`` -> (prefix, [(low, high, width)], rest); None for a plain name."""
    match = re.match(r"^([^\[\]]*)\[([^\]]*)\](.*)$", item)
    if not match:
        if not _NAME_CHARS.match(item):
            raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: bad host name {item!r}")
        return None
    prefix, ranges, rest = match.groups()
    if not _NAME_CHARS.match(prefix):
        raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: bad host name {prefix!r}")
    return prefix, _parse_ranges(ranges, spec), rest


def _count_item(item: str, spec: str) -> int:
    parsed = _parse_item(item, spec)
    if parsed is None:
        return 1
    _, ranges, rest = parsed
    return sum(high - low + 1 for low, high, _ in ranges) * (_count_item(rest, spec) if rest else 1)


def _expand_item(item: str, spec: str) -> Iterator[str]:
    parsed = _parse_item(item, spec)
    if parsed is None:
        yield item
        return
    prefix, ranges, rest = parsed
    for low, high, width in ranges:
        for number in range(low, high + 1):
            for tail in (_expand_item(rest, spec) if rest else [""]):
                yield f"{prefix}{str(number).zfill(width)}{tail}"


def _parse_ranges(ranges: str, spec: str) -> List[Tuple[int, int, int]]:
    """``01-03,07`` -> ``[(1, 3, 2), (7, 7, 2)]``; the low end's width sets zero padding."""
    parsed = []
    for part in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not match:
            raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: bad range {part!r} (want N or N-M)")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise SlurmError(f"{ENV_NODELIST}={spec!r} is malformed: range {part!r} runs backwards")
        parsed.append((int(low), int(high), len(low)))
    return parsed


def parse_tasks_per_node(spec: str, name: str = ENV_TASKS_PER_NODE, limit: int = MAX_NODES,
                         limit_from: str = "hvdgc-launch handles") -> List[int]:
    """Expand Slurm's compressed tasks-per-node list (at most ``limit`` nodes).

    >>> parse_tasks_per_node("4(x2),2")
    [4, 4, 2]
    >>> parse_tasks_per_node("8")
    [8]
    """
    parts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise SlurmError(f"{name}={spec!r} is malformed: expected forms like 4 or 4(x2),2")
        parts.append((int(match.group(1)), int(match.group(2) or 1)))
    total = sum(repeat for _, repeat in parts)
    if total > limit:
        raise SlurmError(f"{name}={spec!r} gives {total} nodes, more than the {limit} {limit_from}; they must match")
    return [count for count, repeat in parts for _ in range(repeat)]


def allocation_from_env(env: Mapping[str, str]) -> Optional[Allocation]:
    """The allocation described by ``env``, or None outside Slurm (``SLURM_JOB_ID`` unset).

    Slots per node come from ``SLURM_NTASKS_PER_NODE`` when set (one value for every node),
    else from ``SLURM_TASKS_PER_NODE``; ``ntasks`` is ``SLURM_NTASKS`` (None if unset).
    """
    job_id = env.get(ENV_JOB_ID, "")
    if not job_id:
        return None
    nodelist = env.get(ENV_NODELIST) or env.get("SLURM_NODELIST", "")
    if not nodelist:
        raise SlurmError(f"{ENV_JOB_ID} is set but {ENV_NODELIST} is not; run inside salloc/sbatch, "
                         f"or unset {ENV_JOB_ID} to launch outside Slurm")
    nodes = expand_nodelist(nodelist, _num_nodes(env, nodelist))
    slots = _slots(env, len(nodes))
    hosts = tuple(zip(nodes, slots))  # _slots returns one count per node
    return Allocation(job_id=job_id, hosts=hosts, ntasks=_ntasks(env), nodelist=nodelist)


def _num_nodes(env: Mapping[str, str], nodelist: str) -> int:
    """``SLURM_JOB_NUM_NODES`` (else ``SLURM_NNODES``), which bounds the node list; MAX_NODES if unset.

    A node list that names another number of nodes is an error (a copied or stale variable).
    """
    name = ENV_NUM_NODES if env.get(ENV_NUM_NODES) else "SLURM_NNODES"
    raw = env.get(name, "")
    if not raw:
        return MAX_NODES
    if not raw.strip().isdigit() or int(raw) < 1:
        raise SlurmError(f"{name}={raw!r} is malformed: expected a whole number >= 1")
    count = count_nodelist(nodelist)
    if count != int(raw):
        raise SlurmError(f"{ENV_NODELIST}={nodelist!r} names {count} nodes but {name}={raw}; they must match "
                         "(run inside the allocation, or unset the stale variables)")
    return int(raw)


def _slots(env: Mapping[str, str], n_nodes: int) -> List[int]:
    name = ENV_NTASKS_PER_NODE if env.get(ENV_NTASKS_PER_NODE) else ENV_TASKS_PER_NODE
    if not env.get(name):
        raise SlurmError(f"neither {ENV_NTASKS_PER_NODE} nor {ENV_TASKS_PER_NODE} is set; "
                         "ask Slurm for tasks, e.g. sbatch --ntasks-per-node=4")
    counts = parse_tasks_per_node(env[name], name, n_nodes, f"in {ENV_NODELIST}")
    if len(counts) == 1:
        return counts * n_nodes
    if len(counts) != n_nodes:
        raise SlurmError(f"{name}={env[name]!r} gives {len(counts)} nodes but {ENV_NODELIST} has {n_nodes}; "
                         "they must match")
    return counts


def _ntasks(env: Mapping[str, str]) -> Optional[int]:
    raw = env.get(ENV_NTASKS, "")
    if not raw:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise SlurmError(f"{ENV_NTASKS}={raw!r} is malformed: expected a whole number >= 1")
    return int(raw)


@dataclass(frozen=True)
class BatchJob:
    """What ``render_sbatch`` needs: the resources to ask for and the command to run.

    ``command`` is the full command run in the allocation, usually
    ``hvdgc-launch [options] script [args]``; it is shell-quoted into the script and run
    in ``workdir`` (default: the directory sbatch was called from).
    """

    command: Tuple[str, ...]
    nodes: int = 1
    ntasks_per_node: int = 1
    time: Optional[str] = None
    partition: Optional[str] = None
    job_name: str = "hvdgc"
    output: Optional[str] = None
    workdir: Optional[str] = None


def render_sbatch(job: BatchJob) -> str:
    """A batch script for ``job``; user-given values are validated, arguments shell-quoted.

    >>> print(render_sbatch(BatchJob(command=("hvdgc-launch", "train.py", "--note", "a b")))
    ...       .splitlines()[-4])
    hvdgc-launch train.py --note 'a b'
    """
    _check_batch(job)
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}",
                  f"--ntasks-per-node={job.ntasks_per_node}"]
    directives += [f"--{key}={value}" for key, value in
                   (("time", job.time), ("partition", job.partition), ("output", job.output or "%x-%j.out"))
                   if value]
    # A cd in the body, not #SBATCH --chdir: sbatch cannot quote a directory with spaces.
    cd = [f"cd {shlex.quote(job.workdir)} || exit 1"] if job.workdir else []
    lines = ["#!/bin/bash",
             "# Written by hvdgc-launch --sbatch. Edit freely; submit with: sbatch THIS_FILE",
             *(f"#SBATCH {d}" for d in directives),
             "",
             *cd,
             'echo "hvdgc: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, $SLURM_NTASKS tasks"',
             "# hvdgc-launch reads the hosts and slots from Slurm's environment.",
             shlex.join(job.command),
             "rc=$?",
             'echo "hvdgc: finished with exit code $rc"',
             "exit $rc",
             ""]
    return "\n".join(lines)


def _check_batch(job: BatchJob) -> None:
    """Reject values that would break (or inject) #SBATCH lines, with the option to fix."""
    if not job.command:
        raise SlurmError("missing training script; usage: hvdgc-launch --sbatch [OPTIONS] SCRIPT [ARGS]...")
    if job.nodes < 1 or job.ntasks_per_node < 1:
        raise SlurmError("--nodes and --ntasks-per-node must be at least 1")
    if job.time is not None and not _TIME_RE.match(job.time):
        raise SlurmError(f"--time {job.time!r} is not a Slurm time; use minutes, H:MM:SS or D-HH:MM:SS")
    for option, value in (("--partition", job.partition), ("--job-name", job.job_name)):
        if value is not None and (not value or not _NAME_CHARS.match(value)):
            raise SlurmError(f"{option} {value!r} may only contain letters, digits, '_', '.' and '-'")
    if job.output is not None and (not job.output or any(c.isspace() for c in job.output)):
        raise SlurmError(f"--output {job.output!r} must be a path without spaces (sbatch cannot read them)")


def submit(script: str, sbatch: str = "sbatch") -> str:
    """Submit ``script`` (its text, passed on stdin) with ``sbatch``; return the job id."""
    proc = subprocess.run([sbatch, "--parsable"], input=script, capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise SlurmError(f"sbatch failed (exit {proc.returncode}): {why}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str, scontrol: str = "scontrol") -> Tuple[str, str]:
    """``(JobState, ExitCode)`` of a job from ``scontrol show job``, e.g. ``('COMPLETED', '0:0')``."""
    proc = subprocess.run([scontrol, "show", "job", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SlurmError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    fields = dict(re.findall(r"(\w+)=(\S+)", proc.stdout))
    return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")


def launcher_args(options: Sequence[Tuple[str, object]]) -> List[str]:
    """Option pairs to argv, dropping unset ones; ``True`` is a bare flag.

    >>> launcher_args([("--ratio", 0.01), ("--verbose", True), ("-p", None), ("--dry-run", False)])
    ['--ratio', '0.01', '--verbose']
    """
    argv: List[str] = []
    for name, value in options:
        if value is None or value is False:
            continue
        argv += [name] if value is True else [name, str(value)]
    return argv
