"""Pipeline schedules as data: validation, placement, torch's orders as oracles, simulated bubble / peak-memory
formulas, a reference execution against the plain model, broken schedules, pictures."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
import torch

import funcshard as fs
from funcshard.pipeline import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    ScheduleError,
    by_name,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    looped_placement,
    one_f_one_b,
    v_placement,
    zbv,
    zero_bubble_h1,
)

pytestmark = pytest.mark.oracle

GRID = [(p, m) for p in range(1, 5) for m in range(p, 9)]
WIDE = [(p, m) for p in range(1, 6) for m in range(1, 13)]  # every size, m < p included
PNG = b"\x89PNG\r\n\x1a\n"


def _has(*fragments: str) -> str:
    """A regex matching a message that contains every fragment (literally, in any order)."""
    return "(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments)


def _rounds_ok(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


def _all(p: int, m: int) -> list[Schedule]:
    """Every builder's schedule for ``p`` stages and ``m`` microbatches (``v`` in 1..3 where it is free)."""
    out = [gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m), zbv(p, m)]
    out += [looped_bfs(p, m, v) for v in (1, 2, 3)]
    if m % p == 0:
        out += [interleaved_1f1b(p, m, v) for v in (1, 2, 3)]
    if _rounds_ok(p, m):
        out += [interleaved_zero_bubble(p, m, v) for v in (1, 2, 3)]
    if m >= 2 * p:
        out.append(dualpipev(p, m))
    return out


def _bubble(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


# -- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), WIDE)
def test_every_schedule_validates(p: int, m: int) -> None:
    for sched in _all(p, m):
        assert sched.validate() is sched
        assert (sched.n_stages, sched.n_microbatches) == (p, m)
        assert sched.n_virtual_stages == p * sched.n_virtual
        for s, row in enumerate(sched.actions):
            n = {k: sum(a.kind == k for a in row) for k in "FBW"}
            assert n["F"] == n["B"] == m * sched.n_virtual, (sched.name, s)
            if sched.name in ("zero_bubble_h1", "zbv", "interleaved_zero_bubble"):
                assert n["W"] == m * sched.n_virtual  # every backward split
            elif sched.name == "dualpipev":
                assert n["W"] == 2 * p - 1 - s  # only warmup's and cooldown's backwards split
            else:
                assert n["W"] == 0
            assert n["W"] == sum(sched.is_split(s, a.microbatch, a.chunk) for a in row if a.kind == "B")


@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 1), (4, 3), (3, 2)])
def test_fewer_microbatches_than_stages_validate(p: int, m: int) -> None:
    for sched in (gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)):
        sched.validate()
        assert max(sched.simulate().peak_in_flight) <= m


def test_exports_and_error_type() -> None:
    assert fs.pipeline.one_f_one_b is one_f_one_b
    for name in ("zbv", "dualpipev", "interleaved_zero_bubble", "looped_bfs", "by_name", "SCHEDULE_NAMES"):
        assert name in fs.pipeline.__all__ and hasattr(fs.pipeline, name)
    assert issubclass(ScheduleError, fs.ShardingError)
    assert issubclass(ScheduleError, ValueError)


def test_action_basics() -> None:
    a = Action("F", 3)
    assert (a.kind, a.microbatch, a.chunk, a.overlap) == ("F", 3, 0, False)
    assert str(a) == "F3" and str(Action("W", 2, 1)) == "W2c1"
    assert Action("B", 1) == Action("B", 1, 0)
    assert repr(Action("B", 1, 1)) == "Action(kind='B', microbatch=1, chunk=1)"
    assert repr(Action("B", 1, 1, overlap=True)) == "Action(kind='B', microbatch=1, chunk=1, overlap=True)"
    assert str(Action("B", 1, 1, True)) == "&B1c1"
    with pytest.raises(ScheduleError, match=_has("kind", "'X'")):
        Action("X", 0)
    with pytest.raises(ScheduleError, match=_has("microbatch", "-1")):
        Action("F", -1)
    with pytest.raises(ScheduleError, match=_has("overlap=True", "kind='F'", "on the B")):
        Action("F", 0, overlap=True)


# -- placement ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "v"), [(1, 1), (2, 2), (3, 2), (4, 3)])
def test_default_placement_is_looped(p: int, v: int) -> None:
    acts = looped_bfs(p, 2, v).actions
    sched = Schedule("hand", p, 2, v, acts)  # placement left out
    assert sched.placement == looped_placement(p, v) == looped_bfs(p, 2, v).placement
    for s in range(p):
        for c in range(v):
            assert sched.virtual_stage(s, c) == c * p + s
            assert sched.stage_of(c * p + s) == (s, c)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_v_placement(p: int) -> None:
    for sched in (zbv(p, 2 * p), dualpipev(p, 2 * p)):
        assert sched.placement == v_placement(p) == tuple((s, 2 * p - 1 - s) for s in range(p))
        assert sched.n_virtual == 2 and sched.n_virtual_stages == 2 * p
        assert sched.stage_of(0) == (0, 0) and sched.stage_of(2 * p - 1) == (0, 1)  # input and loss on stage 0
        assert sched.stage_of(p - 1) == (p - 1, 0) and sched.stage_of(p) == (p - 1, 1)  # the turn: one stage
        assert [sched.virtual_stage(*sched.stage_of(vs)) for vs in range(2 * p)] == list(range(2 * p))
    assert repr(zbv(2, 4)) == "Schedule('zbv', n_stages=2, n_microbatches=4, n_virtual=2, placement=((0, 3), (1, 2)))"


def test_placement_lookups_out_of_range() -> None:
    sched = zbv(2, 4)
    with pytest.raises(ScheduleError, match=_has("'zbv'", "stage_of", "virtual stage 4", "0..3")):
        sched.stage_of(4)
    with pytest.raises(ScheduleError, match=_has("virtual_stage", "no chunk 2 on stage 0", "chunks 0..1")):
        sched.virtual_stage(0, 2)


def test_bad_placement() -> None:
    acts = zbv(2, 4).actions
    with pytest.raises(ScheduleError, match=_has("'hand'", "duplicated [1]", "missing [3]", "v_placement(2)")):
        Schedule("hand", 2, 4, 2, acts, ((0, 1), (1, 2))).validate()
    with pytest.raises(ScheduleError, match=_has("n_virtual=2", "n_stages=2", "placement[stage][chunk]")):
        Schedule("hand", 2, 4, 2, acts, ((0, 3),)).validate()
    with pytest.raises(ScheduleError, match=_has("non-int", "'a'")):
        Schedule("hand", 2, 4, 2, acts, ((0, "a"), (1, 2))).validate()
    sched = Schedule("hand", 2, 4, 2, acts, [[0, 3], [1, 2]])  # lists are taken as tuples
    assert sched.validate().placement == v_placement(2)


def test_dependencies_follow_the_placement() -> None:
    # zbv's lists under the looped placement: stage 1's chunk 1 becomes virtual stage 3, which needs stage 0's
    # chunk 1 (virtual stage 2) first, while V's lists expect the reverse: a deadlock naming virtual stages
    with pytest.raises(ScheduleError, match=_has("deadlock", "virtual stage")):
        Schedule("looped", 2, 4, 2, zbv(2, 4).actions).validate()
    # on the V, F0c1 of stage 1 (virtual stage 2) needs F0 (virtual stage 1) on the same stage
    acts = zbv(2, 4).actions
    acts[1].remove(Action("F", 0, 1))
    acts[1].insert(0, Action("F", 0, 1))
    with pytest.raises(
        ScheduleError,
        match=_has("stage 1 stalls at F0c1 (position 0)", "needs F0 on stage 1 (virtual stage 1)", "later"),
    ):
        Schedule("broken", 2, 4, 2, acts, v_placement(2)).validate()


def test_v_turn_and_loss_cost_no_hop() -> None:
    sim = zbv(2, 4).simulate({"comm": 0.5})  # F=B=W=0.5
    row1 = {a: (b, e) for b, e, a in sim.timeline[1]}
    row0 = {a: (b, e) for b, e, a in sim.timeline[0]}
    assert row1[Action("F", 0)] == (1.0, 1.5)  # one hop from stage 0
    assert row1[Action("F", 0, 1)][0] == 1.5  # the turn of the V stays on stage 1
    assert row0[Action("F", 0, 1)][0] == row1[Action("F", 0, 1)][1] + 0.5  # back up to stage 0: one hop
    assert row0[Action("B", 0, 1)][0] == row0[Action("F", 0, 1)][1]  # the loss is on stage 0 itself


# -- torch's schedules as oracles --------------------------------------------------------------------------


def _torch_order(name: str, p: int, m: int, v: int) -> dict[int, list]:
    """``torch.distributed.pipelining``'s per-rank compute order, computed without a process group.

    The schedule classes compute their order in ``__init__`` from a few sizes; build one bare and call the
    same method (``_get_pipeline_order`` for single-stage schedules, ``_calculate_single_rank_operations``
    for the multi-stage ones).
    """
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(sched, name)
    o = cls.__new__(cls)
    o.pp_group_size, o._n_microbatches, o.n_local_stages = p, m, v
    o._num_stages = o.num_stages = p * v
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    o._stages = [None] * v
    if issubclass(cls, sched.PipelineScheduleSingle):
        return o._get_pipeline_order()
    return {r: o._calculate_single_rank_operations(r) for r in range(p)}


def _from_torch(order: dict[int, list], sched: Schedule) -> list[list[Action]]:
    """Torch's order in funcshard's terms: ``I`` (input grad) and ``B`` (full) both become ``B`` (a ``W``
    decides which), ``OVERLAP_F_B`` becomes ``F`` then ``B(overlap=True)``; torch's stage ids are virtual
    stages, mapped back to (stage, chunk) by the schedule's placement."""
    kinds = {"F": "F", "I": "B", "B": "B", "W": "W"}
    out = []
    for rank in range(sched.n_stages):
        row: list[Action] = []
        for a in order[rank]:
            if a is None:
                continue
            kind = a.computation_type.value
            if kind == "OVERLAP_F_B":
                f, b = a.sub_actions
                assert b.computation_type.value == "B"  # the backward of a pair is always full
                row.append(Action("F", f.microbatch_index, sched.stage_of(f.stage_index)[1]))
                row.append(Action("B", b.microbatch_index, sched.stage_of(b.stage_index)[1], overlap=True))
            elif kind in kinds:
                stage, chunk = sched.stage_of(a.stage_index)
                assert stage == rank
                row.append(Action(kinds[kind], a.microbatch_index, chunk))
        n_i = sum(a is not None and a.computation_type.value == "I" for a in order[rank])
        assert n_i == sum(x.kind == "W" for x in row)  # every input-only backward has its weight step
        out.append(row)
    return out


TORCH_CASES = (
    [("ScheduleGPipe", "gpipe", p, m, 1) for p, m in GRID]
    + [("Schedule1F1B", "1f1b", p, m, 1) for p, m in GRID]
    + [("ScheduleInterleaved1F1B", "interleaved", p, m, v) for p, m in GRID if m % p == 0 for v in (2, 3)]
    + [("ScheduleInterleavedZeroBubble", "zb", p, m, 1) for p, m in GRID]
    + [
        ("ScheduleInterleavedZeroBubble", "interleaved_zb", p, m, v)
        for p, m in WIDE
        if _rounds_ok(p, m)
        for v in (1, 2, 3)
    ]
    + [("ScheduleZBVZeroBubble", "zbv", p, m, 2) for p, m in WIDE]
    + [("ScheduleDualPipeV", "dualpipev", p, m, 2) for p, m in WIDE if m >= 2 * p]
    + [("ScheduleLoopedBFS", "looped_bfs", p, m, v) for p, m in WIDE for v in (1, 2, 3)]
)


@pytest.mark.parametrize(("torch_name", "name", "p", "m", "v"), TORCH_CASES)
def test_orders_equal_torch(torch_name: str, name: str, p: int, m: int, v: int) -> None:
    sched = by_name(name, p, m, v if name in ("interleaved", "interleaved_zb", "looped_bfs") else None)
    assert sched.n_virtual == v
    theirs = _from_torch(_torch_order(torch_name, p, m, v), sched)
    if torch_name == "Schedule1F1B":
        # torch's Schedule1F1B._get_pipeline_order (a picture of the schedule, not what it runs) numbers the
        # last rank's forwards from 1 (it increments before its first F when there is no warmup): compare the
        # kinds and the backwards there, everything on the other ranks
        last, ours = theirs.pop(), sched.actions[-1]
        assert [a.kind for a in last] == [a.kind for a in ours]
        assert [a for a in last if a.kind == "B"] == [a for a in ours if a.kind == "B"]
        assert [a.microbatch for a in last if a.kind == "F"] == [a.microbatch + 1 for a in ours if a.kind == "F"]
        assert theirs == sched.actions[:-1]
        return
    assert theirs == sched.actions


def test_torch_oracle_sees_overlap_and_mixed_backwards() -> None:
    """DualPipeV's order has overlapped pairs and both kinds of backward; the comparison covers them."""
    sched = dualpipev(4, 8)
    assert sum(a.overlap for row in sched.actions for a in row) == 25
    split = [
        sched.is_split(s, a.microbatch, a.chunk) for s, row in enumerate(sched.actions) for a in row if a.kind == "B"
    ]
    assert 0 < sum(split) < len(split)
    assert interleaved_zero_bubble(4, 8, 1).actions == zero_bubble_h1(4, 8).actions


# -- known results -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble_and_peak(p: int, m: int) -> None:
    g, o = gpipe(p, m).simulate(), one_f_one_b(p, m).simulate()
    assert g.bubble_fraction == pytest.approx(_bubble(p, m))
    assert o.bubble_fraction == pytest.approx(_bubble(p, m))
    assert g.makespan == o.makespan == pytest.approx(3 * (m + p - 1))
    assert g.peak_in_flight == [m] * p
    assert o.peak_in_flight == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize(
    ("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 3, 2), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 8, 4)]
)
def test_interleaved_bubble_formula(p: int, m: int, v: int) -> None:
    sched = interleaved_1f1b(p, m, v)
    explicit = sched.simulate({"F": 1 / v, "B": 2 / v})
    assert explicit.bubble_fraction == pytest.approx(_bubble(p, m, v))
    assert sched.simulate().bubble_fraction == pytest.approx(_bubble(p, m, v))  # the defaults are per chunk
    assert explicit.bubble_fraction < one_f_one_b(p, m).simulate().bubble_fraction
    assert {a.chunk for row in sched.actions for a in row} == set(range(v))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_looped_bfs_bubble_and_peak(p: int, m: int) -> None:
    for v in (1, 2, 3):
        sim = looped_bfs(p, m, v).simulate()
        assert sim.bubble_fraction == pytest.approx(_bubble(p, m, v))  # interleaved's bubble ...
        assert sim.peak_in_flight == [m * v] * p  # ... at GPipe's memory
        assert sim.peak_memory == [float(m)] * p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in WIDE if p > 1])
def test_zbv_beats_1f1b_at_its_memory(p: int, m: int) -> None:
    z, o = zbv(p, m).simulate(), one_f_one_b(p, m).simulate()
    assert z.bubble_fraction < o.bubble_fraction
    assert max(z.peak_memory) <= max(o.peak_memory)  # at most p microbatches' activations, as 1F1B's stage 0
    if m >= 2 * p:
        assert z.peak_in_flight == [2 * p] * p
        assert z.bubble_fraction < zero_bubble_h1(p, m).simulate().bubble_fraction


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in WIDE if p > 1 and m >= 2 * p])
def test_dualpipev_beats_1f1b(p: int, m: int) -> None:
    sched = dualpipev(p, m)
    d, o = sched.simulate(), one_f_one_b(p, m).simulate()
    assert d.bubble_fraction < o.bubble_fraction
    assert d.peak_in_flight == [2 * p + 1] * p  # DualPipeV's 2p + 1 chunks: p + 1/2 microbatches
    # charging a pair as less than its halves (the communication it hides) shortens the step
    assert sched.simulate({"FB": 1.0}).makespan < d.makespan


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if p > 1 and m % p == 0])
def test_interleaved_zero_bubble_beats_interleaved(p: int, m: int) -> None:
    for v in (2, 3):
        z, i = interleaved_zero_bubble(p, m, v).simulate(), interleaved_1f1b(p, m, v).simulate()
        assert z.bubble_fraction < i.bubble_fraction
        assert max(z.peak_in_flight) <= max(i.peak_in_flight)


def test_interleaved_chunk_placement() -> None:
    sched = interleaved_1f1b(2, 4, 2)
    assert [str(a) for a in sched.actions[0][:4]] == ["F0", "F1", "F0c1", "F1c1"]
    assert str(sched.actions[1][sched.actions[1].index(Action("B", 0, 1))]) == "B0c1"
    # the first backward on every stage is of the last chunk (the loss lives on virtual stage v*p - 1)
    assert all(next(a for a in row if a.kind == "B").chunk == 1 for row in sched.actions)


def test_interleaved_v1_is_1f1b() -> None:
    assert interleaved_1f1b(4, 8, 1).actions == one_f_one_b(4, 8).actions


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if p > 1])
def test_zero_bubble_h1_beats_1f1b(p: int, m: int) -> None:
    zb, o = zero_bubble_h1(p, m).simulate(), one_f_one_b(p, m).simulate()
    assert zb.bubble_fraction < o.bubble_fraction
    assert zb.makespan == pytest.approx(3 * m + p - 1)  # bubble (p-1)(F+B-W) = a third of 1F1B's 3(p-1)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert max(zb.peak_in_flight) <= max(o.peak_in_flight)


def test_zero_bubble_h1_splits_backward() -> None:
    sched = zero_bubble_h1(4, 8)
    assert sched.split_backward and not one_f_one_b(4, 8).split_backward
    assert sched.simulate().costs == {"F": 1.0, "B": 1.0, "W": 1.0, "comm": 0.0}
    # first stage: 1F1B's warmup, then B, W, F; last stage defers W by p-1 microbatches
    assert [str(a) for a in sched.actions[0][:7]] == ["F0", "F1", "F2", "F3", "B0", "W0", "F4"]
    assert [str(a) for a in sched.actions[3][:9]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0"]


def test_report_p4_m8() -> None:
    """The numbers in the report: p=4, m=8, every schedule by name (v=2 where it is free)."""
    sims = {n: by_name(n, 4, 8).simulate() for n in SCHEDULE_NAMES}
    assert {k: Fraction(r.bubble_fraction).limit_denominator(1000) for k, r in sims.items()} == {
        "gpipe": Fraction(3, 11),
        "1f1b": Fraction(3, 11),
        "interleaved": Fraction(3, 19),
        "zb": Fraction(1, 9),
        "zbv": Fraction(1, 17),
        "dualpipev": Fraction(1, 9),
        "interleaved_zb": Fraction(1, 17),
        "looped_bfs": Fraction(3, 19),
    }
    assert {k: r.peak_in_flight for k, r in sims.items()} == {
        "gpipe": [8, 8, 8, 8],
        "1f1b": [4, 3, 2, 1],
        "interleaved": [11, 9, 7, 5],  # (mb, chunk) pairs; peak_memory halves them
        "zb": [4, 4, 4, 4],
        "zbv": [8, 8, 8, 8],
        "dualpipev": [9, 9, 9, 9],
        "interleaved_zb": [8, 8, 8, 8],
        "looped_bfs": [16, 16, 16, 16],
    }
    assert sims["interleaved"].peak_memory == [5.5, 4.5, 3.5, 2.5]


def test_simulate_timeline_and_comm() -> None:
    sched = one_f_one_b(4, 8)
    sim = sched.simulate()
    for row, acts in zip(sim.timeline, sched.actions):
        assert [a for _, _, a in row] == acts
        assert all(e - b == {"F": 1.0, "B": 2.0}[a.kind] for b, e, a in row)
        assert all(row[i][1] <= row[i + 1][0] for i in range(len(row) - 1))
    assert sim.timeline[3][0][:2] == (3.0, 4.0)  # F0 reaches the last stage after three hops
    slow = sched.simulate({"comm": 0.5})
    assert slow.timeline[3][0][:2] == (4.5, 5.5)
    assert slow.makespan > sim.makespan and slow.bubble_fraction > sim.bubble_fraction
    assert gpipe(1, 4).simulate().bubble_fraction == 0.0


def test_simulate_bad_costs() -> None:
    with pytest.raises(ScheduleError, match=_has("unknown cost", "'X'", "FB")):
        gpipe(2, 2).simulate({"X": 1.0})
    with pytest.raises(ScheduleError, match=_has("'F'", ">= 0", "-1")):
        gpipe(2, 2).simulate({"F": -1})
    with pytest.raises(ScheduleError, match=_has("'FB'", ">= 0")):
        dualpipev(2, 4).simulate({"FB": "1"})


# -- overlapped pairs and mixed backwards ------------------------------------------------------------------


def test_overlapped_pair_is_one_block() -> None:
    sched = dualpipev(2, 4)  # F = B = W = 0.5; a pair's backward is full: B + W
    sim = sched.simulate()
    for s, row in enumerate(sim.timeline):
        for i, (b, e, a) in enumerate(row):
            if a.overlap:
                f = row[i - 1]
                assert f[2].kind == "F" and (f[0], f[1]) == (b, e)  # the halves share one interval
                assert e - b == pytest.approx(0.5 + 1.0)
            elif a.kind == "B":
                assert e - b == pytest.approx(0.5 if sched.is_split(s, a.microbatch, a.chunk) else 1.0)
    busy = sum(e - b for row in sim.timeline for b, e, a in row if not a.overlap)
    assert busy == pytest.approx(2 * 2 * 4 * 1.5)  # a pair's time counts once: every stage's work, F+B+W each
    assert sim.bubble_fraction == pytest.approx(1 - busy / (2 * sim.makespan))
    fast = sched.simulate({"FB": 1.0})
    assert fast.costs["FB"] == 1.0
    assert all(e - b == 1.0 for row in fast.timeline for b, e, a in row if a.overlap)


def test_broken_pairs() -> None:
    after_b = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1, overlap=True)]]
    with pytest.raises(ScheduleError, match=_has("stage 0", "&B1 (position 3)", "follows B0", "right before it")):
        Schedule("broken", 1, 2, 1, after_b).validate()
    own = [[Action("F", 0), Action("B", 0, overlap=True)]]
    with pytest.raises(ScheduleError, match=_has("stage 0", "&B0", "overlaps its own forward F0")):
        Schedule("broken", 1, 1, 1, own).validate()
    first = [[Action("B", 0, overlap=True), Action("F", 0)]]
    with pytest.raises(ScheduleError, match=_has("position 0", "follows nothing")):
        Schedule("broken", 1, 1, 1, first).validate()


def test_mixed_split_and_full_backwards() -> None:
    acts = zero_bubble_h1(2, 2).actions
    acts[1].remove(Action("W", 1))  # B1 on stage 1 becomes a full backward: valid, charged B + W
    sched = Schedule("mixed", 2, 2, 1, acts)
    assert sched.validate().split_backward
    assert sched.is_split(1, 0, 0) and not sched.is_split(1, 1, 0) and sched.is_split(0, 1, 0)
    row = {a: e - b for b, e, a in sched.simulate().timeline[1]}
    assert row[Action("B", 0)] == 1.0 and row[Action("B", 1)] == 2.0
    assert sched.simulate().peak_in_flight == zero_bubble_h1(2, 2).simulate().peak_in_flight


def _layer(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + torch.tanh(x @ w)


def _execute(sched: Schedule, w: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the schedule's actions in simulated-time order, in one process: placement, split and full
    backwards, pairs; returns the mean loss and the gradient of every virtual stage's weight."""
    last, m = sched.n_virtual_stages - 1, sched.n_microbatches
    leaves = [w[i].clone().requires_grad_() for i in range(last + 1)]
    grads = [torch.zeros_like(w[0]) for _ in leaves]
    inp, out, gout, loss = {}, {}, {}, torch.zeros((), dtype=w.dtype)
    events = sorted((b, s, i, a) for s, row in enumerate(sched.simulate().timeline) for i, (b, _, a) in enumerate(row))
    for _, s, _, a in events:
        vs, key = sched.virtual_stage(s, a.chunk), (a.microbatch, sched.virtual_stage(s, a.chunk))
        if a.kind == "F":
            xi = x[a.microbatch] if vs == 0 else out[(a.microbatch, vs - 1)].detach().requires_grad_()
            y = _layer(leaves[vs], xi)
            inp[key], out[key] = xi, ((y - t[a.microbatch]) ** 2).mean() / m if vs == last else y
            loss = loss + (out[key].detach() if vs == last else 0)
            continue
        g = None if vs == last else gout[key]
        want_x = a.kind == "B" and vs > 0
        want_w = a.kind == "W" or not sched.is_split(s, a.microbatch, a.chunk)
        tensors = [inp[key]] * want_x + [leaves[vs]] * want_w
        if not tensors:  # a split B of the first virtual stage: no input gradient to send
            continue
        got = torch.autograd.grad(out[key], tensors, g, retain_graph=True)
        if want_x:
            gout[(a.microbatch, vs - 1)] = got[0]
        if want_w:
            grads[vs] += got[-1]
    return loss, torch.stack(grads)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 6)])
def test_schedule_computes_the_plain_model(name: str, p: int, m: int) -> None:
    """Executed action by action, every schedule gives the plain model's loss and gradients."""
    sched = by_name(name, p, m)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(sched.n_virtual_stages, 3, 3, generator=g, dtype=torch.float64) * 0.5
    x, t = (torch.randn(m, 2, 3, generator=g, dtype=torch.float64) for _ in range(2))
    leaf = w.clone().requires_grad_()
    y = x.reshape(-1, 3)
    for i in range(sched.n_virtual_stages):
        y = _layer(leaf[i], y)
    ref = ((y - t.reshape(-1, 3)) ** 2).mean()
    (ref_grad,) = torch.autograd.grad(ref, leaf)
    loss, grad = _execute(sched, w, x, t)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


# -- broken schedules --------------------------------------------------------------------------------------


def _broken(actions: list[list[Action]], m: int = 2, v: int = 1) -> Schedule:
    return Schedule("broken", len(actions), m, v, actions)


def test_backward_before_its_forward() -> None:
    acts = one_f_one_b(2, 2).actions
    acts[1] = [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]
    with pytest.raises(
        ScheduleError, match=_has("'broken'", "deadlock", "stage 1", "B0", "needs F0 on stage 1", "later")
    ):
        _broken(acts).validate()


def test_weight_grad_before_its_backward() -> None:
    acts = zero_bubble_h1(2, 2).actions
    acts[0].remove(Action("W", 0))
    acts[0].insert(0, Action("W", 0))
    with pytest.raises(ScheduleError, match=_has("stage 0", "W0", "needs B0 on stage 0")):
        _broken(acts).validate()


def test_cross_stage_deadlock() -> None:
    # stage 0 waits for stage 1's B0, which stage 1 runs only after F1, which stage 0 sends only after B0
    acts = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(
        ScheduleError,
        match=_has(
            "deadlock", "stage 0 stalls at B0", "needs B0 on stage 1", "stage 1 stalls at F1", "needs F1 on stage 0"
        ),
    ):
        _broken(acts).validate()


def test_missing_and_duplicate_actions() -> None:
    acts = gpipe(2, 2).actions
    acts[1].remove(Action("B", 1))
    with pytest.raises(ScheduleError, match=_has("stage 1", "missing", "B1")):
        _broken(acts).validate()
    acts = gpipe(2, 2).actions
    acts[0].append(Action("F", 1))
    with pytest.raises(ScheduleError, match=_has("stage 0", "F1", "twice")):
        _broken(acts).validate()
    acts = zero_bubble_h1(2, 2).actions
    acts[1].append(Action("W", 1))
    with pytest.raises(ScheduleError, match=_has("stage 1", "W1", "twice")):
        _broken(acts).validate()
    acts = zbv(2, 4).actions
    acts[0].remove(Action("F", 3, 1))
    with pytest.raises(ScheduleError, match=_has("stage 0", "missing", "F3c1")):
        Schedule("broken", 2, 4, 2, acts, v_placement(2)).validate()


def test_out_of_range_and_shape() -> None:
    with pytest.raises(ScheduleError, match=_has("stage 0", "F5", "< 2")):
        _broken([[Action("F", 5)]]).validate()
    with pytest.raises(ScheduleError, match=_has("stage 0", "F0c1", "chunk < 1")):
        _broken([[Action("F", 0, 1)]]).validate()
    with pytest.raises(ScheduleError, match=_has("2 action lists", "n_stages=3")):
        Schedule("broken", 3, 2, 1, gpipe(2, 2).actions).validate()
    with pytest.raises(ScheduleError, match=_has("stage 0", "missing", "B0")):
        _broken([[Action("F", 0)]], m=1).simulate()


# -- bad arguments -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zero_bubble_h1, zbv, dualpipev])
@pytest.mark.parametrize(
    ("p", "m", "bad"),
    [
        (0, 4, "n_stages"),
        (2, 0, "n_microbatches"),
        (2.0, 4, "n_stages"),
        (2, True, "n_microbatches"),
        (-1, 4, "n_stages"),
    ],
)
def test_bad_arguments(make, p, m, bad: str) -> None:
    with pytest.raises(ScheduleError, match=_has(make.__name__, bad, "positive int")):
        make(p, m)


@pytest.mark.parametrize("make", [interleaved_1f1b, interleaved_zero_bubble, looped_bfs])
def test_bad_n_virtual(make) -> None:
    for v in (0, 1.5, None):
        with pytest.raises(ScheduleError, match=_has(make.__name__, "n_virtual", "positive int")):
            make(2, 4, v)


def test_interleaved_bad_arguments() -> None:
    msg = _has("interleaved_1f1b", "n_microbatches=6", "multiple of n_stages=4", "n_microbatches=8 or 4")
    with pytest.raises(ScheduleError, match=msg):
        interleaved_1f1b(4, 6, 2)
    msg = _has("interleaved_zero_bubble", "n_microbatches=9", "rounds", "= 2", "n_microbatches=8 or 10")
    with pytest.raises(ScheduleError, match=msg):
        interleaved_zero_bubble(4, 9, 2)


def test_dualpipev_needs_2p_microbatches() -> None:
    with pytest.raises(ScheduleError, match=_has("dualpipev", "n_microbatches=7", "2 * n_stages = 8", ">= 8", "zbv")):
        dualpipev(4, 7)


def test_by_name() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "interleaved_zb", "looped_bfs")
    built = {n: by_name(n, 4, 8) for n in SCHEDULE_NAMES}
    assert built["1f1b"].actions == one_f_one_b(4, 8).actions
    assert built["zb"].actions == zero_bubble_h1(4, 8).actions
    assert built["interleaved"].actions == interleaved_1f1b(4, 8, 2).actions
    assert built["dualpipev"].actions == dualpipev(4, 8).actions
    assert {n: s.n_virtual for n, s in built.items()} == {
        "gpipe": 1,
        "1f1b": 1,
        "interleaved": 2,
        "zb": 1,
        "zbv": 2,
        "dualpipev": 2,
        "interleaved_zb": 2,
        "looped_bfs": 2,
    }
    assert by_name("interleaved", 4, 8, 3).n_virtual == 3
    assert by_name("looped_bfs", 4, 8, n_virtual=1).actions == looped_bfs(4, 8, 1).actions
    assert by_name("zbv", 4, 8, n_virtual=2).placement == v_placement(4)
    assert by_name("1f1b", 4, 8, 1).name == "1f1b"
    with pytest.raises(ScheduleError, match=_has("unknown schedule 'zb-v'", "'gpipe'", "Did you mean 'zbv'")):
        by_name("zb-v", 4, 8)
    with pytest.raises(ScheduleError, match=_has("'1f1b'", "exactly 1 chunk", "n_virtual=2", "'interleaved'")):
        by_name("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match=_has("'dualpipev'", "exactly 2 chunk", "n_virtual=3")):
        by_name("dualpipev", 4, 8, 3)


# -- pictures ----------------------------------------------------------------------------------------------


def test_text_timeline() -> None:
    lines = str(gpipe(4, 8)).splitlines()
    assert lines[0].startswith("gpipe: 4 stages, 8 microbatches, bubble 27.3%")
    assert lines[1].startswith("stage 0 | F0 F1 F2 F3 F4 F5 F6 F7 .")
    assert lines[4].startswith("stage 3 | .  .  .  F0 F1")
    one = one_f_one_b(2, 3).text().splitlines()
    assert one[1:] == ["stage 0 | F0 F1 .  .  B0--- F2 B1--- .  B2---", "stage 1 | .  F0 B0--- F1 B1--- F2 B2--- .  ."]
    zb = zero_bubble_h1(4, 8).text().splitlines()
    assert zb[1].startswith("stage 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1")
    assert "W=1" in zb[0] and "bubble 11.1%" in zb[0]
    inter = interleaved_1f1b(2, 2, 2).text().splitlines()
    assert inter[1].startswith("stage 0 | F0c0 F1c0 F0c1 F1c1")
    assert "2 chunks/stage" in inter[0] and "V-shape" not in inter[0]
    assert repr(gpipe(2, 3)) == "Schedule('gpipe', n_stages=2, n_microbatches=3, n_virtual=1)"


def test_text_v_shapes_and_pairs() -> None:
    v = zbv(2, 4).text().splitlines()
    assert v[0].startswith("zbv: 2 stages, 4 microbatches, 2 chunks/stage (V-shape), bubble 4.0%")
    assert v[2].startswith("stage 1 | .    F0c0 F0c1 F1c0 F1c1 B0c1 W0c1")  # the turn: F0c0 then F0c1 at once
    d = dualpipev(2, 4).text({"FB": 1.0}).splitlines()
    assert "FB=1" in d[0]
    assert "F3c0&B1c1---------- " in d[1]  # a pair is one cell, two steps of 0.5 long
    custom = Schedule("hand", 2, 4, 2, zbv(2, 4).actions, ((0, 3), (1, 2))).text()
    assert "(V-shape)" in custom


@pytest.mark.parametrize(
    "sched",
    [
        gpipe(4, 8),
        one_f_one_b(4, 8),
        interleaved_1f1b(4, 8, 2),
        zero_bubble_h1(4, 8),
        one_f_one_b(1, 1),
        zbv(4, 8),
        dualpipev(4, 8),
        interleaved_zero_bubble(4, 8, 2),
        looped_bfs(4, 8, 2),
    ],
    ids=lambda s: f"{s.name}-{s.n_stages}x{s.n_microbatches}",
)
def test_plot_writes_png(sched: Schedule, tmp_path) -> None:
    out = sched.plot(tmp_path / "sub" / f"{sched.name}.png")
    assert out.read_bytes()[:8] == PNG
    out2 = fs.pipeline.plot(sched, tmp_path / "again.png", {"comm": 0.25})
    assert out2.read_bytes()[:8] == PNG
