"""Pipeline schedules as data: validation, simulated bubble / peak-memory formulas, broken schedules, pictures."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

import funcshard as fs
from funcshard.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)

GRID = [(p, m) for p in range(1, 5) for m in range(p, 9)]
PNG = b"\x89PNG\r\n\x1a\n"


def _has(*fragments: str) -> str:
    """A regex matching a message that contains every fragment (literally, in any order)."""
    return "(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments)


def _all(p: int, m: int) -> list[Schedule]:
    out = [gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)]
    if m % p == 0:
        out += [interleaved_1f1b(p, m, v) for v in (1, 2, 3)]
    return out


def _bubble(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


# -- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
def test_every_schedule_validates(p: int, m: int) -> None:
    for sched in _all(p, m):
        assert sched.validate() is sched
        assert (sched.n_stages, sched.n_microbatches) == (p, m)
        per_stage = sched.n_microbatches * sched.n_virtual * (3 if sched.split_backward else 2)
        assert [len(row) for row in sched.actions] == [per_stage] * p


@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 1), (4, 3), (3, 2)])
def test_fewer_microbatches_than_stages_validate(p: int, m: int) -> None:
    for sched in (gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)):
        sched.validate()
        assert max(sched.simulate().peak_in_flight) <= m


def test_exports_and_error_type() -> None:
    assert fs.pipeline.one_f_one_b is one_f_one_b
    assert issubclass(ScheduleError, fs.ShardingError)
    assert issubclass(ScheduleError, ValueError)


def test_action_basics() -> None:
    a = Action("F", 3)
    assert (a.kind, a.microbatch, a.chunk) == ("F", 3, 0)
    assert str(a) == "F3" and str(Action("W", 2, 1)) == "W2c1"
    assert Action("B", 1) == Action("B", 1, 0)
    with pytest.raises(ScheduleError, match=_has("kind", "'X'")):
        Action("X", 0)
    with pytest.raises(ScheduleError, match=_has("microbatch", "-1")):
        Action("F", -1)


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
    """The numbers in the report: p=4, m=8 (interleaved v=2)."""
    sims = {
        s.name: s.simulate() for s in (gpipe(4, 8), one_f_one_b(4, 8), interleaved_1f1b(4, 8, 2), zero_bubble_h1(4, 8))
    }
    assert {k: Fraction(r.bubble_fraction).limit_denominator(100) for k, r in sims.items()} == {
        "gpipe": Fraction(3, 11),
        "1f1b": Fraction(3, 11),
        "interleaved_1f1b": Fraction(3, 19),
        "zero_bubble_h1": Fraction(1, 9),
    }
    assert {k: r.peak_in_flight for k, r in sims.items()} == {
        "gpipe": [8, 8, 8, 8],
        "1f1b": [4, 3, 2, 1],
        "interleaved_1f1b": [11, 9, 7, 5],  # (mb, chunk) pairs; peak_memory halves them
        "zero_bubble_h1": [4, 4, 4, 4],
    }
    assert sims["interleaved_1f1b"].peak_memory == [5.5, 4.5, 3.5, 2.5]


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
    with pytest.raises(ScheduleError, match=_has("unknown cost", "'X'")):
        gpipe(2, 2).simulate({"X": 1.0})
    with pytest.raises(ScheduleError, match=_has("'F'", ">= 0", "-1")):
        gpipe(2, 2).simulate({"F": -1})


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
    acts[1].remove(Action("W", 1))
    with pytest.raises(ScheduleError, match=_has("stage 1", "missing", "W1")):
        _broken(acts).validate()


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


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zero_bubble_h1])
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


def test_interleaved_bad_arguments() -> None:
    msg = _has("interleaved_1f1b", "n_microbatches=6", "multiple of n_stages=4", "n_microbatches=8 or 4")
    with pytest.raises(ScheduleError, match=msg):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match=_has("interleaved_1f1b", "n_virtual", "positive int")):
        interleaved_1f1b(2, 4, 0)


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
    assert "2 chunks/stage" in inter[0]
    assert repr(gpipe(2, 3)) == "Schedule('gpipe', n_stages=2, n_microbatches=3, n_virtual=1)"


@pytest.mark.parametrize(
    "sched",
    [gpipe(4, 8), one_f_one_b(4, 8), interleaved_1f1b(4, 8, 2), zero_bubble_h1(4, 8), one_f_one_b(1, 1)],
    ids=lambda s: f"{s.name}-{s.n_stages}x{s.n_microbatches}",
)
def test_plot_writes_png(sched: Schedule, tmp_path) -> None:
    out = sched.plot(tmp_path / "sub" / f"{sched.name}.png")
    assert out.read_bytes()[:8] == PNG
    out2 = fs.pipeline.plot(sched, tmp_path / "again.png", {"comm": 0.25})
    assert out2.read_bytes()[:8] == PNG
