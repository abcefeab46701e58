"""Pipeline schedules as data: per-stage lists of forward / backward / weight-gradient actions.

A schedule says, for each pipeline stage, the order in which it runs ``F`` (forward), ``B`` (backward) and,
for zero-bubble schedules, ``W`` (weight gradient) on each microbatch. With ``W`` present, ``B`` is only the
input-gradient half of the backward (what the previous stage waits for) and ``W`` the weight-gradient half;
without ``W``, ``B`` is the full backward. With ``n_virtual`` chunks per stage (interleaved schedules), chunk
``c`` of stage ``s`` is virtual stage ``c * n_stages + s``. Nothing here runs a model or imports torch: the
runtime executes a ``Schedule``; ``validate`` and ``simulate`` reason about it with unit costs.

Example:
    >>> from funcshard.pipeline import one_f_one_b
    >>> sched = one_f_one_b(2, 3)
    >>> [str(a) for a in sched.actions[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> sim = sched.simulate()  # F=1, B=2
    >>> round(sim.bubble_fraction, 3), sim.peak_in_flight  # (p-1)/(m+p-1) = 1/4
    (0.25, [2, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import ShardingError

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zero_bubble_h1",
]

KINDS = ("F", "B", "W")


class ScheduleError(ShardingError):
    """A pipeline schedule that is malformed or cannot run (bad arguments, missing action, deadlock).

    Example:
        >>> from funcshard.pipeline import Action, Schedule
        >>> Schedule("bad", 1, 1, 1, [[Action("B", 0), Action("F", 0)]]).validate()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard.pipeline.schedules.ScheduleError: Schedule 'bad': deadlock: stage 0 stalls at B0 ...
    """


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``kind`` (``"F"``, ``"B"`` or ``"W"``) on ``microbatch``, for model ``chunk``.

    Example:
        >>> Action("F", 3), str(Action("B", 3, chunk=1))
        (Action(kind='F', microbatch=3, chunk=0), 'B3c1')
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"Action: kind must be one of {KINDS}, found {self.kind!r}.")
        for name in ("microbatch", "chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ScheduleError(f"Action: {name} must be an int >= 0, found {v!r}.")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Timeline:
    """What ``Schedule.simulate`` found.

    Attributes:
        timeline: per stage, ``(start, end, action)`` in execution order.
        makespan: time at which the last action ends.
        bubble_fraction: idle time over ``n_stages * makespan``.
        peak_in_flight: per stage, the most (microbatch, chunk) pairs whose ``F`` is done and whose last
            backward action (``W`` when split, else ``B``) is not: the activation-memory proxy, in units of
            one chunk's activations for one microbatch.
        peak_memory: ``peak_in_flight / n_virtual``: the same peak in units of one microbatch's activations
            for the whole stage, comparable across interleaved and plain schedules.
        costs: the costs used (``F``, ``B``, ``W``, ``comm``).

    Example:
        >>> from funcshard.pipeline import gpipe
        >>> sim = gpipe(2, 2).simulate()  # F=1, B=2
        >>> sim.makespan, round(sim.bubble_fraction, 3), sim.peak_in_flight
        (9.0, 0.333, [2, 2])
        >>> sim.timeline[0][0]  # stage 0's first action: (start, end, action)
        (0.0, 1.0, Action(kind='F', microbatch=0, chunk=0))
    """

    timeline: list[list[tuple[float, float, Action]]]
    makespan: float
    bubble_fraction: float
    peak_in_flight: list[int]
    peak_memory: list[float]
    costs: dict[str, float] = field(default_factory=dict)


@dataclass
class Schedule:
    """Per-stage action lists plus the sizes they refer to; build one with ``gpipe``, ``one_f_one_b``, ...

    Attributes:
        name: a label for messages and plots.
        n_stages: pipeline stages (devices on the ``pp`` axis).
        n_microbatches: microbatches per step.
        n_virtual: model chunks per stage (1 unless interleaved).
        actions: ``actions[stage]`` is that stage's list of ``Action`` in execution order.

    Example:
        >>> from funcshard.pipeline import Action
        >>> sched = Schedule("tiny", 1, 2, 1, [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]])
        >>> sched.validate()  # returns the schedule
        Schedule('tiny', n_stages=1, n_microbatches=2, n_virtual=1)
        >>> print(sched.text())
        tiny: 1 stages, 2 microbatches, bubble 0.0%, peak in-flight [2]  (F=1 B=2)
        stage 0 | F0 F1 B0--- B1---
    """

    name: str
    n_stages: int
    n_microbatches: int
    n_virtual: int
    actions: list[list[Action]]

    @property
    def split_backward(self) -> bool:
        """True when the schedule has ``W`` actions (``B`` is then the input-gradient half only)."""
        return any(a.kind == "W" for acts in self.actions for a in acts)

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, n_stages={self.n_stages}, n_microbatches={self.n_microbatches}, "
            f"n_virtual={self.n_virtual})"
        )

    def __str__(self) -> str:
        return self.text()

    def _fail(self, msg: str) -> ScheduleError:
        return ScheduleError(f"Schedule {self.name!r}: {msg}")

    def _deps(self, stage: int, a: Action) -> list[tuple[str, int, int]]:
        """The actions ``a`` waits for, as ``(kind, microbatch, virtual stage)``."""
        p, last = self.n_stages, self.n_stages * self.n_virtual - 1
        vs = a.chunk * p + stage
        if a.kind == "F":
            return [("F", a.microbatch, vs - 1)] if vs > 0 else []
        if a.kind == "B":
            return [("F", a.microbatch, vs)] + ([("B", a.microbatch, vs + 1)] if vs < last else [])
        return [("B", a.microbatch, vs)]

    def _describe(self, kind: str, mb: int, vs: int) -> str:
        chunk, stage = divmod(vs, self.n_stages)
        return f"{Action(kind, mb, chunk)} on stage {stage}"

    def _check_contents(self) -> None:
        for name in ("n_stages", "n_microbatches", "n_virtual"):
            _positive_int(f"Schedule {self.name!r}", name, getattr(self, name))
        if len(self.actions) != self.n_stages:
            raise self._fail(f"has {len(self.actions)} action lists for n_stages={self.n_stages}.")
        kinds = ("F", "B", "W") if self.split_backward else ("F", "B")
        for s, acts in enumerate(self.actions):
            seen: dict[tuple[str, int, int], int] = {}
            for i, a in enumerate(acts):
                if not isinstance(a, Action):
                    raise self._fail(f"stage {s}, position {i}: expected an Action, found {a!r}.")
                if a.microbatch >= self.n_microbatches or a.chunk >= self.n_virtual:
                    raise self._fail(
                        f"stage {s}, action {a} (position {i}): microbatch must be < {self.n_microbatches} "
                        f"and chunk < {self.n_virtual}."
                    )
                key = (a.kind, a.microbatch, a.chunk)
                if key in seen:
                    raise self._fail(f"stage {s}, action {a} appears twice (positions {seen[key]} and {i}).")
                seen[key] = i
            for mb in range(self.n_microbatches):
                for c in range(self.n_virtual):
                    for k in kinds:
                        if (k, mb, c) not in seen:
                            what = " (the schedule has W actions, so every B needs its W)" if k == "W" else ""
                            raise self._fail(f"stage {s} is missing action {Action(k, mb, c)}{what}.")

    def _run(self, costs: dict[str, float]) -> list[list[tuple[float, float, Action]]]:
        """Run each stage's list in order, as soon as its dependencies are done (sends never block)."""
        p = self.n_stages
        end: dict[tuple[str, int, int], tuple[float, int]] = {}
        pos, free = [0] * p, [0.0] * p
        timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
        progress = True
        while progress:
            progress = False
            for s in range(p):
                while pos[s] < len(self.actions[s]):
                    a = self.actions[s][pos[s]]
                    deps = self._deps(s, a)
                    if any(d not in end for d in deps):
                        break
                    start = max([free[s]] + [end[d][0] + (costs["comm"] if end[d][1] != s else 0.0) for d in deps])
                    free[s] = start + costs[a.kind]
                    end[(a.kind, a.microbatch, a.chunk * p + s)] = (free[s], s)
                    timeline[s].append((start, free[s], a))
                    pos[s] += 1
                    progress = True
        stalled = [s for s in range(p) if pos[s] < len(self.actions[s])]
        if stalled:
            where = {
                (a.kind, a.microbatch, a.chunk * p + s): (s, i) for s in range(p) for i, a in enumerate(self.actions[s])
            }
            parts = []
            for s in stalled:
                a = self.actions[s][pos[s]]
                for d in (d for d in self._deps(s, a) if d not in end):
                    ds, di = where[d]
                    why = (
                        f"which comes later in stage {s}'s own list (position {di})"
                        if ds == s
                        else f"but stage {ds} is itself stalled at {self.actions[ds][pos[ds]]} (position {pos[ds]})"
                    )
                    parts.append(f"stage {s} stalls at {a} (position {pos[s]}): needs {self._describe(*d)}, {why}")
            raise self._fail("deadlock: " + "; ".join(parts) + ".")
        return timeline

    def _costs(self, costs: dict[str, float] | None) -> dict[str, float]:
        v = float(self.n_virtual)
        if self.split_backward:
            out = {"F": 1.0 / v, "B": 1.0 / v, "W": 1.0 / v, "comm": 0.0}
        else:
            out = {"F": 1.0 / v, "B": 2.0 / v, "W": 0.0, "comm": 0.0}
        for k, v in (costs or {}).items():
            if k not in out:
                raise self._fail(f"simulate: unknown cost {k!r}; expected keys F, B, W, comm.")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise self._fail(f"simulate: cost {k!r} must be a number >= 0, found {v!r}.")
            out[k] = float(v)
        return out

    def validate(self) -> Schedule:
        """Check every action is present once on the right stage and that the lists can run without deadlock.

        Returns:
            The schedule itself, for chaining.

        Raises:
            ScheduleError: naming the stage, the action and the missing or unmet dependency.

        Example:
            >>> from funcshard.pipeline import gpipe
            >>> gpipe(4, 8).validate().n_stages
            4
        """
        self._check_contents()
        self._run(self._costs(None))
        return self

    def simulate(self, costs: dict[str, float] | None = None) -> Timeline:
        """Time the schedule: each stage runs its list in order, each action as soon as its inputs arrive.

        Args:
            costs: duration of one action by kind, ``{"F": 1.0, "B": 2.0}`` by default (``B`` = full
                backward), or ``{"F": 1.0, "B": 1.0, "W": 1.0}`` when the schedule splits the backward; the
                defaults are divided by ``n_virtual`` (a chunk is that fraction of a stage's layers). Plus
                ``"comm"``, the latency of each stage-to-stage hop (default 0). Given keys override the
                defaults and are used as they are.

        Returns:
            A ``Timeline`` with the timeline, makespan, bubble fraction and peak in-flight per stage.

        Example:
            >>> from funcshard.pipeline import gpipe
            >>> round(gpipe(4, 8).simulate().bubble_fraction, 4)  # (p-1)/(m+p-1) = 3/11
            0.2727
        """
        self._check_contents()
        c = self._costs(costs)
        timeline = self._run(c)
        makespan = max((t[-1][1] for t in timeline if t), default=0.0)
        busy = sum(e - b for t in timeline for b, e, _ in t)
        total = self.n_stages * makespan
        bubble = (total - busy) / total if total > 0 else 0.0
        last = "W" if self.split_backward else "B"
        peaks = []
        for acts in self.actions:
            now = peak = 0
            for a in acts:
                now += (a.kind == "F") - (a.kind == last)
                peak = max(peak, now)
            peaks.append(peak)
        return Timeline(timeline, makespan, bubble, peaks, [x / self.n_virtual for x in peaks], c)

    def text(self, costs: dict[str, float] | None = None) -> str:
        """A compact ASCII timeline, one row per stage, aligned by simulated time (see ``visualize.text``)."""
        from .visualize import text

        return text(self, costs)

    def plot(self, path: str | Path, costs: dict[str, float] | None = None, **kwargs: Any) -> Path:
        """Draw the simulated timeline as a PNG at ``path`` (see ``visualize.plot``)."""
        from .visualize import plot

        return plot(self, path, costs, **kwargs)


def _positive_int(fn: str, name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScheduleError(f"{fn}: {name} must be a positive int, found {value!r}.")
    return value


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards. Holds all ``m`` microbatches' activations.

    Example:
        >>> [str(a) for a in gpipe(2, 2).actions[1]]
        ['F0', 'F1', 'B0', 'B1']
    """
    p, m = (_positive_int("gpipe", k, v) for k, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)))
    acts = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return Schedule("gpipe", p, m, 1, acts).validate()


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): ``p-1-s`` warmup forwards on stage ``s``, then alternate F and B, then cool down.

    Same bubble as GPipe, but stage ``s`` holds at most ``min(p - s, m)`` microbatches' activations.

    Example:
        >>> [str(a) for a in one_f_one_b(3, 4).actions[0]]
        ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    p, m = (_positive_int("one_f_one_b", k, v) for k, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)))
    acts = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        row = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            row += [Action("F", warm + i), Action("B", i)]
        row += [Action("B", i) for i in range(m - warm, m)]
        acts.append(row)
    return Schedule("1f1b", p, m, 1, acts).validate()


def interleaved_1f1b(n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: ``n_virtual`` model chunks per stage shrink the bubble ``v`` times.

    Chunk ``c`` of stage ``s`` is virtual stage ``c * n_stages + s``. Microbatches go through in groups of
    ``n_stages``, each group through every chunk in turn, so ``n_microbatches`` must be a multiple of
    ``n_stages``. With ``n_virtual=1`` this is ``one_f_one_b``.

    Example:
        >>> [str(a) for a in interleaved_1f1b(2, 2, 2).actions[0]][:4]
        ['F0', 'F1', 'F0c1', 'F1c1']
    """
    fn = "interleaved_1f1b"
    p, m, v = (
        _positive_int(fn, k, x)
        for k, x in (("n_stages", n_stages), ("n_microbatches", n_microbatches), ("n_virtual", n_virtual))
    )
    if m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        raise ScheduleError(
            f"{fn}: n_microbatches={m} is not a multiple of n_stages={p}; the interleaved schedule runs "
            f"microbatches in groups of n_stages. Use n_microbatches={hi}"
            + (f" or {lo}" if lo else "")
            + ", or one_f_one_b."
        )
    if v == 1:
        sched = one_f_one_b(p, m)
        sched.name = fn
        return sched

    def action(kind: str, k: int) -> Action:
        chunk = (k // p) % v
        return Action(kind, (k // (p * v)) * p + k % p, v - 1 - chunk if kind == "B" else chunk)

    total = m * v
    acts = []
    for s in range(p):
        warm = min((p - 1 - s) * 2 + (v - 1) * p, total)
        row = [action("F", k) for k in range(warm)]
        for k in range(total - warm):
            row += [action("F", warm + k), action("B", k)]
        row += [action("B", k) for k in range(total - warm, total)]
        acts.append(row)
    return Schedule(fn, p, m, v, acts).validate()


def zero_bubble_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split in two.

    ``B`` computes only the input gradient (what the previous stage waits for); ``W``, the weight gradient,
    is deferred on stage ``s`` by ``s`` microbatches to fill what would be the cooldown bubble. With
    ``F = B = W`` the bubble is ``(p-1)`` units instead of 1F1B's ``3(p-1)``, and no stage holds more than
    ``p`` microbatches (1F1B's peak, on its first stage).

    Example:
        >>> [str(a) for a in zero_bubble_h1(2, 3).actions[1]]
        ['F0', 'B0', 'F1', 'B1', 'W0', 'F2', 'B2', 'W1', 'W2']
    """
    fn = "zero_bubble_h1"
    p, m = (_positive_int(fn, k, v) for k, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)))
    acts = []
    for s in range(p):
        n_f = min(p - s, m)
        row = [Action("F", i) for i in range(n_f)]
        n_w = 0
        for i in range(m):
            row.append(Action("B", i))
            if i >= s:
                row.append(Action("W", i - s))
                n_w += 1
            if n_f < m:
                row.append(Action("F", n_f))
                n_f += 1
        row += [Action("W", j) for j in range(n_w, m)]
        acts.append(row)
    return Schedule(fn, p, m, 1, acts).validate()
