"""The settings the library reads, checked in one place; imports nothing (no torch, no Horovod).

* Checks of ratio, bits, bucket size, ``min_k`` and ``min_ratio``, used by the codecs (:mod:`hvd_gradcomp.codecs.compressor`)
  and by the ``HVDGC_*`` settings alike, so a value is refused with the same message
  wherever it is given. Each message starts with the setting's name.
* The ``HVDGC_*`` variables (:data:`VARIABLES`; the table is in :mod:`hvd_gradcomp.config`),
  their parsing, and :func:`unread_settings_message` for settings a script never read.

>>> check_ratio(0.01), check_bits(8), check_bucket_size(512)
(0.01, 8, 512)
>>> check_bits(9)
Traceback (most recent call last):
ValueError: bits must be in 2..8, got 9: an int, 1 sign bit + level bits
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ratio(ratio: Any) -> float:
    """TopK's share of entries sent, in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}: the share of entries sent")
    return float(ratio)


def check_bits(bits: Any) -> int:
    """QSGD's bits per value, 2..8."""
    if not _is_int(bits) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits!r}: an int, 1 sign bit + level bits")
    return bits


MIN_SELECTED = 32
"""The fewest values a top-k codec sends of a compressed tensor (``TopK(min_k=...)`` in
:mod:`hvd_gradcomp.codecs.compressor`), whatever the ratio: below about 32 (8-bit values, delta-coded
indices) a payload's values and indices take fewer bytes than its own header (40 bytes plus 8 per dimension), so sending fewer saves
almost nothing, while the tensor starves: at ratio 0.001 a 4096-element projection would send 5
values per step and each coordinate wait ~800 steps for its turn (the study's transformer ended
+4.8% above uncompressed training without the floor; benchmarks/results/STUDY.md has it with the floor). Large
tensors never reach it (ratio 0.01 of 3,200 elements is 32)."""


def check_min_k(min_k: Any) -> int:
    """TopK's fewest values sent of a compressed tensor, >= 1."""
    if not _is_int(min_k) or min_k < 1:
        raise ValueError(f"min_k must be an int >= 1 (the fewest values sent of a compressed tensor; "
                         f"default {MIN_SELECTED}), got {min_k!r}")
    return min_k


def check_min_ratio(value: Any) -> Dict[str, float]:
    """TopK's per-name floors of the share sent: ``{regular expression: ratio in (0, 1]}`` (None: none).

    >>> check_min_ratio({"^head": 0.01})
    {'^head': 0.01}
    >>> check_min_ratio({"out": 0})
    Traceback (most recent call last):
    ValueError: min_ratio['out'] must be in (0, 1], got 0: the least share sent of tensors whose name matches
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"min_ratio must be a dict {{regular expression: share in (0, 1]}} matched against "
                         f"parameter names (e.g. {{r'^head\\.': 0.01}}), got {value!r}")
    out = {}
    for pattern, ratio in value.items():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(f"min_ratio keys must be regular expressions matched against parameter names, "
                             f"got {pattern!r}: {exc}") from None
        try:
            out[pattern] = check_ratio(ratio)   # the one range of a share
        except ValueError:
            raise ValueError(f"min_ratio[{pattern!r}] must be in (0, 1], got {ratio!r}: the least share sent of "
                             "tensors whose name matches") from None
    return out


MAX_BUCKET_SIZE = (1 << 32) - 1  # the wire format stores it in 32 bits


def check_bucket_size(bucket_size: Any) -> int:
    """QSGD's values per norm, 1..2**32 - 1."""
    if not _is_int(bucket_size) or not 1 <= bucket_size <= MAX_BUCKET_SIZE:
        raise ValueError(f"bucket_size must be an int in 1..2**32 - 1, got {bucket_size!r}: values per QSGD norm "
                         "(the wire format stores it in 32 bits)")
    return bucket_size


class Checked:
    """A codec setting checked on every assignment, in the constructor or later (``c.ratio = 0.05``),
    by one of the checks above; the value lives in ``_<name>`` on the instance.

    >>> class Codec:
    ...     bits = Checked(check_bits, "Bits per value.")
    >>> c = Codec(); c.bits = 4; c.bits
    4
    >>> c.bits = 9
    Traceback (most recent call last):
    ValueError: bits must be in 2..8, got 9: an int, 1 sign bit + level bits
    """

    def __init__(self, check: Callable[[Any], Any], doc: str) -> None:
        self.check, self.__doc__ = check, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, self.check(value))


def check_settings(compression: str, ratio: Any, bits: Any, accumulate: Any) -> None:
    """The checks of :class:`hvd_gradcomp.config.CompressionConfig`."""
    known = compressions()
    if compression not in known:
        raise ValueError(f"unknown compression {compression!r}; choose one of {', '.join(known)}")
    check_ratio(ratio)
    check_bits(bits)
    if not _is_int(accumulate) or accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate!r}")


# ---------------------------------------------------------------- HVDGC_* variables
COMPRESSIONS = ("none", "fp16", "qsgd", "topk", "topk-qsgd", "powersgd", "auto")
"""The built-in settings of ``HVDGC_COMPRESSION`` (:func:`compressions` adds those registered since)."""


def compressions() -> Tuple[str, ...]:
    """Every setting ``HVDGC_COMPRESSION`` takes: ``none``, ``fp16``, each compressor in the registry
    (:mod:`hvd_gradcomp.codecs`, one of your own included once registered) and ``auto``.

    >>> compressions()[:5]
    ('none', 'fp16', 'qsgd', 'topk', 'topk-qsgd')
    """
    from . import codecs  # imports nothing heavy

    return ("none", "fp16", *codecs.names(), "auto")

ENV_COMPRESSION = "HVDGC_COMPRESSION"
ENV_CODEC_MODULE = "HVDGC_CODEC_MODULE"
ENV_RATIO = "HVDGC_RATIO"
ENV_BITS = "HVDGC_BITS"
ENV_ACCUMULATE = "HVDGC_ACCUMULATE"
ENV_ERROR_FEEDBACK = "HVDGC_ERROR_FEEDBACK"
ENV_SEED = "HVDGC_SEED"
ENV_COMPILE = "HVDGC_COMPILE"

VARIABLES = {
    ENV_COMPRESSION: ("compression", "none | fp16 | qsgd | topk | topk-qsgd | powersgd | auto", "none"),
    ENV_RATIO: ("ratio", "TopK ratio, in (0, 1]", "0.01"),
    ENV_BITS: ("bits", "QSGD bits, 2..8", "8"),
    ENV_ACCUMULATE: ("accumulate", "backward passes per optimizer step, >= 1", "1"),
    ENV_ERROR_FEEDBACK: ("error_feedback", "1 or 0", "1"),
    ENV_SEED: ("seed", "seed of the stochastic rounding", "unset"),
    ENV_COMPILE: (None, "torch.compile the kernels: auto | 0 | 1", "auto"),
    ENV_CODEC_MODULE: (None, "a module to import: it registers codecs of its own", "unset"),
}
"""variable -> (CompressionConfig field, or None when the library reads it itself; meaning; default)."""

_read = False   # has this process read os.environ through config.from_env()? (then the script owns them)


def mark_read() -> None:
    """Called by :func:`hvd_gradcomp.config.from_env` when it reads ``os.environ``."""
    global _read
    _read = True


def _parse(env: Mapping[str, str], key: str, kind: type, default: Any) -> Any:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a valid {kind.__name__}; unset it or fix it") from None


def parse_env(env: Mapping[str, str]) -> Dict[str, Any]:
    """The CompressionConfig fields the variables in ``env`` give, checked; errors name the variable.

    >>> parse_env({"HVDGC_COMPRESSION": "topk", "HVDGC_RATIO": "0.05"})["ratio"]
    0.05
    """
    if env.get(ENV_CODEC_MODULE, ""):   # its codecs first: HVDGC_COMPRESSION may name one of them
        from . import codecs
        try:
            codecs.load_module(env[ENV_CODEC_MODULE])
        except ValueError as exc:
            raise ValueError(f"{ENV_CODEC_MODULE}: {exc}") from None
    ef_raw = env.get(ENV_ERROR_FEEDBACK, "1").strip().lower()
    if ef_raw not in ("1", "0", "true", "false", "yes", "no", "on", "off", ""):
        raise ValueError(f"{ENV_ERROR_FEEDBACK}={ef_raw!r}: use 1 or 0")
    fields = {
        "compression": env.get(ENV_COMPRESSION, "none") or "none",
        "ratio": _parse(env, ENV_RATIO, float, 0.01),
        "bits": _parse(env, ENV_BITS, int, 8),
        "accumulate": _parse(env, ENV_ACCUMULATE, int, 1),
        "error_feedback": ef_raw in ("1", "true", "yes", "on", ""),
        "seed": _parse(env, ENV_SEED, int, None),
    }
    try:
        check_settings(fields["compression"], fields["ratio"], fields["bits"], fields["accumulate"])
    except ValueError as exc:
        # Name the variable, not the field: the user set the variable.
        first = str(exc).split()[0]
        raise ValueError(f"{_FIELD_VARS.get(first, 'HVDGC_*')}: {exc}") from None
    return fields


_FIELD_VARS = {"unknown": ENV_COMPRESSION, "ratio": ENV_RATIO, "bits": ENV_BITS, "accumulate": ENV_ACCUMULATE}


def unread_settings_message(built: Mapping[str, Any], env: Optional[Mapping[str, str]] = None,
                            what: str = "an optimizer") -> Optional[str]:
    """The warning for settings that are set but have no effect; None when there is nothing to say.

    ``built`` holds the :class:`~hvd_gradcomp.config.CompressionConfig` fields of what the script built (only those
    it determines). Nothing to say when no setting is set, when the script called
    ``config.from_env()`` (it owns them, and its flags may override them), or when what it built
    agrees with every setting. It names only the variables set (non-empty) in ``env``; ``hvdgc-launch``
    sets only those of the options given, so a launch without compression options sets none, and a
    script that builds its own compressor there hears nothing.

    >>> unread_settings_message({"compression": "topk-qsgd", "ratio": 0.01, "bits": 8}, {}) is None
    True
    >>> env = {"HVDGC_COMPRESSION": "topk", "HVDGC_RATIO": "0.05"}
    >>> print(unread_settings_message({"compression": "none"}, env, "DistributedOptimizer(compression=None)"))
    HVDGC_COMPRESSION=topk HVDGC_RATIO=0.05 are set (hvdgc-launch sets them), but this script built DistributedOptimizer(compression=None) without reading them, so they have no effect: read them with hvd_gradcomp.config.from_env() (cfg.make_compressor(), cfg.accumulate), or drop the launcher's compression options.
    >>> unread_settings_message({"compression": "topk", "ratio": 0.05}, env) is None
    True
    """
    if _read and env is None:
        return None
    env = os.environ if env is None else env
    given = {var: env[var] for var, (field, _, _) in VARIABLES.items() if field and env.get(var, "")}
    if not given:
        return None
    try:
        values = parse_env(env)
    except ValueError as exc:
        return f"{exc} (this script does not read the HVDGC_* settings; unset the variable)"
    fields = {VARIABLES[var][0] for var in given}
    if all(built[f] == values[f] for f in fields if f in built):
        return None
    settings = " ".join(f"{var}={raw}" for var, raw in given.items())
    return (f"{settings} {'are' if len(given) > 1 else 'is'} set (hvdgc-launch sets them), but this script "
            f"built {what} without reading them, so they have no effect: read them with "
            "hvd_gradcomp.config.from_env() (cfg.make_compressor(), cfg.accumulate), or drop the launcher's "
            "compression options.")
