"""The road model and gc.Auto's decision logic, with injected measurements (pure, fast)."""
from __future__ import annotations

import pytest

from hvd_gradcomp.auto import policy
from hvd_gradcomp.auto.policy import Link, TensorCosts, choose, crossover_ranks, decide, wire_bytes


def brute_crossover(road, numel, sparse, payload=0.0):
    for p in range(2, 100_000):
        if wire_bytes("sparse", p, numel, sparse) > wire_bytes(road, p, numel, payload):
            return p
    return None


@pytest.mark.parametrize("road,numel,sparse,payload", [
    ("dense", 1_000_000, 23_400, 0), ("fp16", 1_000_000, 23_400, 0), ("fp16", 4096, 200, 0),
    ("qsgd", 1_000_000, 23_400, 1_000_300), ("qsgd", 50_000, 3_000, 50_400), ("dense", 10, 1000, 0)])
def test_crossover_matches_brute_force(road, numel, sparse, payload):
    assert crossover_ranks(road, numel, sparse, payload) == brute_crossover(road, numel, sparse, payload)


def test_crossover_closed_form_for_dense():
    # (P-1) S > 2 (P-1)/P D  <=>  P > 2 D / S
    assert crossover_ranks("dense", 1_000_000, 40_000) == 201
    assert crossover_ranks("fp16", 1_000_000, 40_000) == 101


def test_wire_bytes_flat_for_dense_and_qsgd_linear_for_allgather():
    dense = [wire_bytes("dense", p, 1000) for p in (2, 64, 1024)]
    assert dense[0] == 4000 and dense[-1] < 8000 and dense == sorted(dense)
    assert wire_bytes("sparse", 1024, 1000, 10) == 1023 * 10
    assert wire_bytes("qsgd-ag", 3, 1000, 10) == 20
    assert all(wire_bytes(r, 1, 1000, 10) == 0 for r in policy.ROADS)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown road"):
        wire_bytes("zip", 2, 10)
    with pytest.raises(ValueError, match="ranks must be"):
        wire_bytes("dense", 0, 10)
    with pytest.raises(ValueError, match="sparse_payload"):
        crossover_ranks("dense", 10, 0)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0)
    with pytest.raises(ValueError, match="no road"):
        choose({})
    with pytest.raises(ValueError, match="hysteresis"):
        choose({"dense": 1.0}, hysteresis=1.5)


def costs(sparse_codec=0.05, qsgd_codec=0.2, fp16_codec=0.01, numel=25_000_000):
    return TensorCosts(numel, payload={"sparse": numel * 4 / 170, "qsgd": numel + numel // 128},
                       codec_s={"dense": 0.0, "fp16": fp16_codec, "qsgd": qsgd_codec, "sparse": sparse_codec})


ROADS = ("dense", "fp16", "qsgd", "sparse")


def test_slow_link_picks_sparse_fast_link_picks_dense():
    # The benchmark's situation: 100 MB of gradients, a CPU-bound codec.
    assert decide(costs(), 2, Link(1.25e8), ROADS) == "sparse"       # 1 Gbit/s: 0.8 s dense vs ~0.05 s
    assert decide(costs(), 2, Link(1.25e10), ROADS) == "dense"       # 100 Gbit/s: 8 ms dense < 50 ms codec
    assert decide(costs(sparse_codec=1.0), 2, Link(1.25e8), ROADS) == "qsgd"


def test_rank_count_switches_road_past_the_crossover():
    c = costs(sparse_codec=0.01, qsgd_codec=0.05)
    link = Link(1.25e8)
    small = decide(c, 8, link, ROADS)
    big = decide(c, 1024, link, ROADS)
    assert small == "sparse" and big == "qsgd"
    cross = crossover_ranks("qsgd", c.numel, c.payload["sparse"], c.payload["qsgd"])
    assert 8 < cross < 1024


def test_hysteresis_keeps_the_current_road_on_small_differences():
    times = {"dense": 1.0, "sparse": 0.95, "qsgd": 2.0}
    assert choose(times, current="dense", hysteresis=0.1) == "dense"
    assert choose(times, current="dense", hysteresis=0.0) == "sparse"
    assert choose(times, current="qsgd", hysteresis=0.1) == "sparse"
    assert choose(times) == "sparse"
    # a current road with no measurement does not pin the choice
    assert choose({"dense": 1.0}, current="sparse") == "dense"


def test_ties_go_to_dense():
    assert choose({"sparse": 1.0, "dense": 1.0}) == "dense"


def test_roads_without_measurements_are_not_candidates():
    c = TensorCosts(1000, codec_s={"dense": 0.0})
    assert decide(c, 2, Link(1.0), ROADS) == "dense"


def test_link_from_probe_recovers_bandwidth_and_latency():
    link = Link(2e8, 1e-4)
    for p in (2, 4, 16):
        small = policy.rounds("dense", p) * link.latency
        large = small + wire_bytes("dense", p, 5_000_000) / link.bandwidth
        got = policy.link_from_probe(p, small, large, 5_000_000)
        assert got.bandwidth == pytest.approx(link.bandwidth) and got.latency == pytest.approx(link.latency)


def test_a_slow_fp16_reduction_measured_by_its_probe_sends_the_tensor_dense():
    """10 Gbit/s on CPU (the benchmark's case): by bytes alone fp16 wins, but Horovod's fp16
    allreduce, probed, moves 4x fewer bytes per second than the float32 one, so dense wins."""
    c = costs(fp16_codec=0.004, sparse_codec=0.2, qsgd_codec=0.2)   # 25M values: dense 80 ms
    n = 1 << 20
    dense_s = wire_bytes("dense", 2, n) / 1.25e9
    by_bytes = policy.link_from_probe(2, 0.0, dense_s, n)
    probed = policy.link_from_probe(2, 0.0, dense_s, n, fp16_s=2 * dense_s, gather_s=dense_s / 4)
    assert probed.bandwidth_of("fp16") == pytest.approx(1.25e9 / 4)
    assert probed.bandwidth_of("sparse") == pytest.approx(1.25e9) and probed.bandwidth_of("dense") == pytest.approx(1.25e9)
    assert decide(c, 2, by_bytes, ROADS) == "fp16" and decide(c, 2, probed, ROADS) == "dense"
