"""The planner's step-time model: alpha-beta collectives at their placement, overlap, bubble, MFU."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.job.plan import (
    Placement,
    StepTime,
    bubble_fraction,
    collective_time,
    comm_time,
    hardware,
    model_flops,
    placement,
    step_time,
)

H100 = hardware("h100")
NO_LATENCY = dataclasses.replace(H100, intra_latency=0.0, inter_latency=0.0)
GiB = 2**30


# ---- bus-bandwidth factors (latency set to zero, so time * bandwidth / size is the factor) -------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bus_bandwidth_factors(n: int) -> None:
    bw, size = NO_LATENCY.intra_bandwidth, 3 * GiB
    ring = collective_time("psum", size, n, NO_LATENCY, algorithm="ring")
    assert ring * bw / size == pytest.approx(2 * (n - 1) / n)
    # all_gather's payload is the local shard: the factor is (n-1)/n of the full result, n shards
    assert collective_time("all_gather", size / n, n, NO_LATENCY) * bw / size == pytest.approx((n - 1) / n)
    assert collective_time("psum_scatter", size, n, NO_LATENCY) * bw / size == pytest.approx((n - 1) / n)
    assert collective_time("all_to_all", size, n, NO_LATENCY) * bw / size == pytest.approx((n - 1) / n)
    assert collective_time("ppermute", size, n, NO_LATENCY) * bw / size == pytest.approx(1.0)


def test_names_of_one_collective_agree() -> None:
    for a, b in [("psum", "all_reduce"), ("pmean", "psum"), ("psum_scatter", "reduce_scatter"), ("send", "p2p")]:
        assert collective_time(a, GiB, 8, H100) == collective_time(b, GiB, 8, H100)


def test_one_device_or_no_bytes_costs_nothing() -> None:
    assert collective_time("psum", GiB, 1, H100) == 0.0
    assert collective_time("all_gather", 0, 8, H100) == 0.0


# ---- placement ------------------------------------------------------------------------------------------------


def test_tp_inside_a_node_fsdp_across_nodes() -> None:
    mesh = {"fsdp": 64, "tp": 8}
    assert placement(mesh, "tp") == Placement(8, 1, 8)
    assert placement(mesh, "fsdp") == Placement(64, 64, 1)  # one member per node: every hop crosses
    assert placement(mesh, ("fsdp", "tp")) == placement(mesh, "fsdp,tp") == Placement(512, 64, 8)


def test_a_small_mesh_is_one_node() -> None:
    mesh = {"dp": 2, "tp": 4}
    assert all(placement(mesh, axes).intra_node for axes in ("dp", "tp", ("dp", "tp")))
    assert not placement({"dp": 2, "tp": 8}, "dp").intra_node
    assert placement({"fsdp": 16}, "fsdp") == Placement(16, 2, 8)


def test_unaligned_groups_take_the_worst() -> None:
    mesh = {"a": 3, "b": 4}  # 12 ranks, nodes of 8: a's groups {0, 4, 8}, ... straddle two nodes
    assert placement(mesh, "b").intra_node  # 0-3, 4-7, 8-11
    assert placement(mesh, "a") == Placement(3, 2, 1)
    assert placement({"x": 8}, "x", node_size=4) == Placement(8, 2, 4)


def test_placement_errors() -> None:
    with pytest.raises(fs.ConfigError, match="pp"):
        placement({"dp": 2}, "pp")
    with pytest.raises(fs.ConfigError):
        placement({"dp": 2}, ("dp", "dp"))


def test_node_boundary_slows_every_collective() -> None:
    mesh = {"fsdp": 8, "tp": 8}  # two groups of 8: tp inside a node, fsdp one member per node
    for name in ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute"):
        for nbytes in (8, 2**20, GiB):
            assert comm_time(name, nbytes, mesh, "tp", H100) < comm_time(name, nbytes, mesh, "fsdp", H100)


# ---- monotonicity ---------------------------------------------------------------------------------------------

NAMES = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")


@pytest.mark.parametrize("name", NAMES)
def test_time_grows_with_bytes(name: str) -> None:
    for group in (Placement(8, 1, 8), Placement(64, 64, 1), Placement(32, 4, 8)):
        times = [collective_time(name, 2**k, group, H100) for k in range(0, 34, 3)]
        assert all(a < b for a, b in itertools.pairwise(times)), (group, times)


@pytest.mark.parametrize("name", NAMES[:4])
def test_time_grows_with_group_size(name: str) -> None:
    sizes = [2, 4, 8, 16, 32, 64, 128]
    for nbytes in (8, 2**20, GiB):
        times = [comm_time(name, nbytes, {"x": n}, "x", H100) for n in sizes]  # n > 8 crosses nodes
        assert all(a < b for a, b in itertools.pairwise(times)), (nbytes, times)


# ---- tree against ring ----------------------------------------------------------------------------------------


def _tree_ring(nbytes: float, group: Placement) -> tuple[float, float]:
    tree, ring = (collective_time("psum", nbytes, group, H100, algorithm=a) for a in ("tree", "ring"))
    return tree, ring


@pytest.mark.parametrize("group", [Placement(8, 1, 8), Placement(64, 64, 1), Placement(512, 64, 8)])
def test_tree_for_small_messages_ring_for_large(group: Placement) -> None:
    tree, ring = _tree_ring(1024, group)
    assert tree < ring
    tree, ring = _tree_ring(4 * GiB, group)
    # the ring's 2(n-1) steps cost 1022 network latencies on 512 devices: the tree wins there even at 4 GiB
    # (the crossover is n (n - 1 - log2 n) alpha B, ~0.5 TB), as NCCL's tuner picks trees at scale
    assert (ring < tree) == (group.size < 512)
    for k in range(0, 34):  # the default is whichever is faster
        assert collective_time("psum", 2**k, group, H100) == min(_tree_ring(2**k, group))


def test_tree_only_for_all_reduce() -> None:
    with pytest.raises(fs.ConfigError, match="tree"):
        collective_time("all_gather", GiB, 8, H100, algorithm="tree")
    with pytest.raises(fs.ConfigError, match="all_gather"):
        collective_time("gather", GiB, 8, H100)
    with pytest.raises(fs.ConfigError):
        collective_time("psum", -1, 8, H100)


# ---- hand-computed examples -----------------------------------------------------------------------------------


def test_hand_computed_times() -> None:
    # tp=8 inside a node, 1 GiB: ring 2(n-1) = 14 steps of 1 us, 2 * 7/8 GiB over 450 GB/s
    assert comm_time("psum", GiB, {"fsdp": 64, "tp": 8}, "tp", H100) == pytest.approx(14e-6 + 1.75 * GiB / 450e9)
    # fsdp=64, one member per node: 63 steps of 5 us, 63 local shards of 128 MiB through a 50 GB/s NIC
    shard = 128 * 2**20
    expect = 63 * 5e-6 + 63 * shard / 50e9
    assert comm_time("all_gather", shard, {"fsdp": 64, "tp": 8}, "fsdp", H100) == pytest.approx(expect)
    # fsdp=16 on two nodes of 8: the ring's bandwidth is min(NVLink 450, 8 NICs x 50) = 400 GB/s
    ring = 30 * 5e-6 + 2 * 15 / 16 * GiB / 400e9
    assert comm_time("psum", GiB, {"fsdp": 16}, "fsdp", H100) == pytest.approx(ring)
    # an all-to-all over 16 on two nodes: half of the input leaves the node through this GPU's own NIC
    a2a = 15 * 5e-6 + 8 / 16 * GiB / 50e9
    assert comm_time("all_to_all", GiB, {"ep": 16}, "ep", H100) == pytest.approx(a2a)
    # a pipeline send between nodes: one hop through the NIC
    assert comm_time("send", GiB, {"pp": 2, "tp": 8}, "pp", H100) == pytest.approx(5e-6 + GiB / 50e9)
    # A100: NVLink3 300 GB/s per direction
    assert comm_time("psum_scatter", GiB, {"tp": 4}, "tp", "a100") == pytest.approx(3e-6 + 0.75 * GiB / 300e9)


# ---- pipeline bubble ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16), (8, 32)])
def test_one_f_one_b_bubble_from_the_simulator(p: int, m: int) -> None:
    assert bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction("interleaved", p, m) < bubble_fraction("1f1b", p, m)


def test_no_pipeline_no_bubble() -> None:
    assert bubble_fraction("1f1b", 1, 4) == 0.0


# ---- the step -------------------------------------------------------------------------------------------------


def test_compute_only_step() -> None:
    t = step_time(1e15, {}, {"dp": 8}, "h100", dtype="bf16")
    assert t.compute == pytest.approx(1e15 / (989e12 * 0.6)) and t.total == t.compute
    assert t.bubble == 0.0 and t.comm == {} and t.exposed == 0.0
    fp32 = step_time(1e15, {}, {"dp": 8}, "h100", dtype=torch.float32)
    assert fp32.compute == pytest.approx(1e15 / (67e12 * 0.6))
    memory = step_time(0.0, {}, {"dp": 8}, "h100", memory_bytes=3.35e12)
    assert memory.compute == pytest.approx(1.0)  # memory-bound bytes at HBM bandwidth


def test_calls_are_timed_one_by_one() -> None:
    mesh = {"fsdp": 8, "tp": 8}
    t = step_time(0.0, {("psum", "tp"): (10, 10 * 2**20)}, mesh, "h100", overlap={})
    assert t.comm["tp"] == pytest.approx(10 * comm_time("psum", 2**20, mesh, "tp", "h100"))
    assert t.exposed_comm == t.comm and t.total == pytest.approx(t.comm["tp"])


def test_overlap_hides_under_compute_only() -> None:
    mesh = {"fsdp": 64, "tp": 8}
    comm = {("all_gather", "fsdp"): (1, 2**26), ("psum", "tp"): (1, 2**26)}
    ag, ps = (comm_time(n, 2**26, mesh, a, H100) for n, a in [("all_gather", "fsdp"), ("psum", "tp")])
    big = 100 * (ag + ps) * H100.achieved("bf16")  # compute far longer than the communication
    t = step_time(big, comm, mesh, H100, overlap={"fsdp": 1.0, "tp": 0.0})
    assert t.exposed_comm == {"fsdp": 0.0, "tp": pytest.approx(ps)}
    assert t.total == pytest.approx(t.compute + ps)
    half = step_time(big, comm, mesh, H100, overlap={"fsdp": 0.5, "tp": 0.5})
    assert half.exposed_comm == {"fsdp": pytest.approx(ag / 2), "tp": pytest.approx(ps / 2)}
    # compute shorter than the overlappable communication: what does not fit is exposed
    short = step_time(ag / 4 * H100.achieved("bf16"), comm, mesh, H100, overlap={"fsdp": 1.0, "tp": 0.0})
    assert short.exposed_comm["fsdp"] == pytest.approx(ag - short.compute)
    assert short.total == pytest.approx(ag + ps)


def test_default_overlap_by_role() -> None:
    mesh = {"fsdp": 64, "tp": 8}
    comm = {("all_gather", "fsdp"): (1, 2**20), ("psum", "tp"): (1, 2**20)}
    t = step_time(1e15, comm, mesh, H100)
    assert t.exposed_comm["fsdp"] == 0.0 and t.exposed_comm["tp"] == t.comm["tp"] > 0
    both = step_time(1e15, {("psum", ("fsdp", "tp")): (1, 2**20)}, mesh, H100)  # the least of its axes'
    assert both.exposed_comm["fsdp,tp"] == both.comm["fsdp,tp"]
    own = step_time(1e15, {("psum", ("fsdp", "tp")): (1, 2**20)}, mesh, H100, overlap={("fsdp", "tp"): 1.0})
    assert own.exposed_comm["fsdp,tp"] == 0.0


def test_bubble_stretches_the_busy_time() -> None:
    b = bubble_fraction("1f1b", 4, 8)
    comm = {("psum", "tp"): (8, 2**30)}
    flat = step_time(1e15, comm, {"pp": 4, "tp": 8}, H100)
    piped = step_time(1e15, comm, {"pp": 4, "tp": 8}, H100, bubble=b)
    busy = flat.total
    assert piped.total == pytest.approx(busy / (1 - b))
    assert piped.bubble == pytest.approx(piped.total - busy) and piped.bubble / piped.total == pytest.approx(b)


def test_step_errors() -> None:
    with pytest.raises(fs.ConfigError, match="bubble"):
        step_time(1e15, {}, {"pp": 2}, H100, bubble=1.0)
    with pytest.raises(fs.ConfigError, match="overlap"):
        step_time(1e15, {("psum", "tp"): (1, 8)}, {"tp": 2}, H100, overlap={"tp": 1.5})
    with pytest.raises(fs.ConfigError, match="cp"):
        step_time(1e15, {("psum", "cp"): (1, 8)}, {"tp": 2}, H100)
    with pytest.raises(fs.ConfigError, match="fp8"):
        step_time(1e15, {}, {"tp": 2}, H100, dtype="fp8")


def test_comm_stats_feed_the_step() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")

    def body(x: torch.Tensor) -> torch.Tensor:  # x: [2, 4]
        return fs.psum(fs.all_gather(x, "tp", dim=1, tiled=True), "dp")  # [2, 4] -> [2, 8] -> [2, 8]

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"),), out_specs=P(None, "tp"))
    with fs.comm_stats() as stats:
        f(torch.ones(4, 8))
    rows = stats.rows()
    assert rows == {("all_gather", "tp"): (1, 32), ("psum", "dp"): (1, 64)}
    t = step_time(1e9, stats, mesh.shape, H100)
    assert t == step_time(1e9, rows, mesh.shape, H100)
    assert t.comm["tp"] == pytest.approx(comm_time("all_gather", 32, mesh.shape, "tp", H100))
    assert t.comm["dp"] == pytest.approx(comm_time("psum", 64, mesh.shape, "dp", H100))


# ---- MFU ------------------------------------------------------------------------------------------------------


def test_model_flops_is_six_n_t_plus_attention() -> None:
    n, layers, dim, seq, tokens = 7e9, 32, 4096, 8192, 2 * 8192
    assert model_flops(n, layers, dim, seq, tokens) == 6 * n * tokens + 12 * layers * dim * seq * tokens
    assert model_flops(n, layers, dim, seq, 2 * tokens) == 2 * model_flops(n, layers, dim, seq, tokens)
    # attention's share grows with the sequence: 12 L d s against 6 N per token
    short, long = (model_flops(n, layers, dim, s, 1) - 6 * n for s in (2048, 8192))
    assert long == 4 * short


def test_mfu_arithmetic() -> None:
    t = StepTime(compute=0.6, comm={}, exposed_comm={}, bubble=0.0, total=1.5, peak_flops=989e12)
    assert t.mfu(989e12) == pytest.approx(1 / 1.5)
    step = step_time(6e14, {}, {"dp": 8}, H100)
    # no communication, no bubble, no remat: MFU is the efficiency itself
    assert step.mfu(6e14) == pytest.approx(H100.efficiency)
    # remat's recomputation is in the step's FLOPs, not in the model FLOPs: MFU falls by its share
    remat = step_time(6e14 * 4 / 3, {}, {"dp": 8}, H100)
    assert remat.mfu(6e14) == pytest.approx(H100.efficiency * 3 / 4)
    assert math.isclose(step.total * step.mfu(6e14) * step.peak_flops, 6e14)
