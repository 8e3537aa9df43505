"""Run settings passed to every rank through HVDGC_* environment variables."""
import pytest

from hvd_gradcomp import QSGD, TopK, TopKQSGD
from hvd_gradcomp.config import CompressionConfig, from_env

DOCUMENTED = {"HVDGC_COMPRESSION", "HVDGC_RATIO", "HVDGC_BITS", "HVDGC_ACCUMULATE", "HVDGC_ERROR_FEEDBACK",
              "HVDGC_SEED"}


def test_defaults_when_nothing_is_set():
    cfg = from_env({})
    assert (cfg.compression, cfg.ratio, cfg.bits, cfg.accumulate, cfg.error_feedback, cfg.seed) == \
        ("none", 0.01, 8, 1, True, None)
    assert from_env({k: "" for k in DOCUMENTED}) == cfg


def test_all_variables_are_parsed():
    cfg = from_env({"HVDGC_COMPRESSION": "topk-qsgd", "HVDGC_RATIO": "0.05", "HVDGC_BITS": "4",
                    "HVDGC_ACCUMULATE": "8", "HVDGC_ERROR_FEEDBACK": "0", "HVDGC_SEED": "1234"})
    assert (cfg.compression, cfg.ratio, cfg.bits, cfg.accumulate, cfg.error_feedback, cfg.seed) == \
        ("topk-qsgd", 0.05, 4, 8, False, 1234)


def test_reads_os_environ_by_default(monkeypatch):
    for k in DOCUMENTED:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HVDGC_COMPRESSION", "qsgd")
    monkeypatch.setenv("HVDGC_BITS", "2")
    cfg = from_env()
    assert (cfg.compression, cfg.bits) == ("qsgd", 2)


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("YES", True), ("on", True), ("", True),
                                        ("0", False), ("false", False), ("No", False), (" off ", False)])
def test_error_feedback_spellings(raw, value):
    assert from_env({"HVDGC_ERROR_FEEDBACK": raw}).error_feedback is value


BAD = [
    ("HVDGC_COMPRESSION", "gzip"), ("HVDGC_COMPRESSION", "top-k"),
    ("HVDGC_RATIO", "abc"), ("HVDGC_RATIO", "0"), ("HVDGC_RATIO", "1.5"), ("HVDGC_RATIO", "-0.1"),
    ("HVDGC_RATIO", "nan"),
    ("HVDGC_BITS", "x"), ("HVDGC_BITS", "8.0"), ("HVDGC_BITS", "1"), ("HVDGC_BITS", "9"),
    ("HVDGC_ACCUMULATE", "0"), ("HVDGC_ACCUMULATE", "-2"), ("HVDGC_ACCUMULATE", "1.5"),
    ("HVDGC_ERROR_FEEDBACK", "2"), ("HVDGC_ERROR_FEEDBACK", "maybe"),
    ("HVDGC_SEED", "abc"), ("HVDGC_SEED", "1.5"),
]


@pytest.mark.parametrize("var, raw", BAD, ids=[f"{v}={r}" for v, r in BAD])
def test_bad_values_raise_naming_the_variable(var, raw):
    env = {"HVDGC_COMPRESSION": "topk-qsgd", var: raw}
    with pytest.raises(ValueError) as err:
        from_env(env)
    assert var in str(err.value)


@pytest.mark.parametrize("kwargs", [{"compression": "gzip"}, {"ratio": 0.0}, {"ratio": 1.01}, {"bits": 1},
                                    {"bits": 9}, {"accumulate": 0}])
def test_config_validates_at_construction(kwargs):
    with pytest.raises(ValueError):
        CompressionConfig(**kwargs)


@pytest.mark.parametrize("cfg", [
    CompressionConfig(),
    CompressionConfig("topk-qsgd", ratio=0.123456789012345, bits=3, accumulate=16, error_feedback=False, seed=0),
    CompressionConfig("qsgd", bits=2, seed=2 ** 40),
    CompressionConfig("topk", ratio=1.0),
    CompressionConfig("fp16", ratio=1e-7, accumulate=2),
])
def test_to_env_round_trip(cfg):
    env = cfg.to_env()
    assert set(env) <= DOCUMENTED
    assert all(isinstance(v, str) for v in env.values())
    assert from_env(env) == cfg


def test_make_compressor_returns_the_named_class():
    import horovod.torch as hvd

    assert CompressionConfig("none").make_compressor() is None
    assert CompressionConfig("fp16").make_compressor() is hvd.Compression.fp16

    q = CompressionConfig("qsgd", bits=4, error_feedback=False, seed=5).make_compressor()
    assert type(q) is QSGD and (q.bits, q.error_feedback, q.seed) == (4, False, 5)

    t = CompressionConfig("topk", ratio=0.05).make_compressor()
    assert type(t) is TopK and (t.ratio, t.error_feedback) == (0.05, True)

    tq = CompressionConfig("topk-qsgd", ratio=0.02, bits=6, seed=9).make_compressor()
    assert type(tq) is TopKQSGD and (tq.ratio, tq.bits, tq.seed, tq.error_feedback) == (0.02, 6, 9, True)
    assert repr(CompressionConfig("topk-qsgd", ratio=0.01, bits=8).make_compressor()) == \
        "TopKQSGD(ratio=0.01, bits=8, bucket_size=512, error_feedback=True)"


def test_make_compressor_from_env():
    c = from_env({"HVDGC_COMPRESSION": "qsgd", "HVDGC_BITS": "2", "HVDGC_SEED": "3"}).make_compressor()
    assert type(c) is QSGD and (c.bits, c.seed) == (2, 3)


@pytest.mark.parametrize("var, raw, field, value", [
    ("HVDGC_COMPRESSION", "topk", "compression", "topk"), ("HVDGC_RATIO", "0.05", "ratio", 0.05),
    ("HVDGC_BITS", "4", "bits", 4), ("HVDGC_ACCUMULATE", "8", "accumulate", 8),
    ("HVDGC_ERROR_FEEDBACK", "0", "error_feedback", False), ("HVDGC_SEED", "3", "seed", 3),
])
def test_one_variable_alone_leaves_the_others_at_their_defaults(var, raw, field, value):
    """hvdgc-launch exports only the options given (--ratio 0.05: HVDGC_RATIO alone); from_env reads
    every other setting as its default, as it did when the launcher exported them all."""
    assert from_env({var: raw}) == CompressionConfig(**{field: value})


def test_unread_settings_warning_names_only_the_variables_set():
    """A script building its own TopKQSGD under a launch without compression options is not warned;
    with one option given, the warning names that one."""
    from hvd_gradcomp import ddp

    assert ddp.unread_settings_message(TopKQSGD(ratio=0.01, bits=8), {}) is None
    assert ddp.unread_settings_message(TopKQSGD(ratio=0.01, bits=8), {"HVDGC_COMPILE": "0"}) is None
    message = ddp.unread_settings_message(TopKQSGD(ratio=0.01, bits=8), {"HVDGC_RATIO": "0.05"})
    assert message.startswith("HVDGC_RATIO=0.05 is set"), message
    assert not any(var in message for var in DOCUMENTED - {"HVDGC_RATIO"}), message
