"""Pipeline schedules as data: per-stage lists of forward / backward / weight-gradient actions, and a placement.

A schedule says, for each pipeline stage, the order in which it runs ``F`` (forward), ``B`` (backward) and,
for zero-bubble schedules, ``W`` (weight gradient) on each microbatch and model chunk. A ``B`` whose
(microbatch, chunk) has a ``W`` on the same stage is only the input-gradient half of the backward (what the
previous virtual stage waits for) and that ``W`` the weight-gradient half; a ``B`` without one is the full
backward. ``Schedule.placement[stage][chunk]`` is the virtual stage (model chunk, 0 = first layers) that
chunk ``chunk`` of ``stage`` holds: ``c * n_stages + s`` for looped / interleaved schedules, ``(s, 2p-1-s)``
for the V-shaped ``zbv`` and ``dualpipev`` (whose last virtual stage sits on stage 0). A ``B`` with
``overlap=True`` runs fused with the ``F`` just before it (DualPipe's overlapped F&B pair). Nothing here runs
a model or imports torch: the runtime executes a ``Schedule``; ``validate`` and ``simulate`` reason about it.

Example:
    >>> from funcshard.pipeline import one_f_one_b, zbv
    >>> sched = one_f_one_b(2, 3)
    >>> [str(a) for a in sched.actions[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> sim = sched.simulate()  # F=1, B=2
    >>> round(sim.bubble_fraction, 3), sim.peak_in_flight  # (p-1)/(m+p-1) = 1/4
    (0.25, [2, 1])
    >>> zbv(2, 4).placement  # V-shape: stage 0 holds the first and the last virtual stage
    ((0, 3), (1, 2))
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..extend import ShardingError

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "by_name",
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "looped_bfs",
    "looped_placement",
    "one_f_one_b",
    "v_placement",
    "zbv",
    "zero_bubble_h1",
]

KINDS = ("F", "B", "W")
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "interleaved_zb", "looped_bfs")
Placement = tuple[tuple[int, ...], ...]
Key = tuple[str, int, int]  # (kind, microbatch, virtual stage): one action wherever it runs


class ScheduleError(ShardingError):
    """A pipeline schedule that is malformed or cannot run (bad arguments, missing action, deadlock).

    Example:
        >>> from funcshard.pipeline import Action, Schedule
        >>> Schedule("bad", 1, 1, 1, [[Action("B", 0), Action("F", 0)]]).validate()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard.pipeline.schedules.ScheduleError: Schedule 'bad': deadlock: stage 0 stalls at B0 ...
    """


@dataclass(frozen=True, repr=False)
class Action:
    """One step of one stage: ``kind`` (``"F"``, ``"B"`` or ``"W"``) on ``microbatch``, for model ``chunk``.

    ``overlap=True`` (a ``B`` only) marks the backward half of an overlapped F&B pair: it runs fused with the
    ``F`` right before it in the stage's list, as DualPipe overlaps one microbatch's forward with another's
    backward. A runtime may also run the two one after the other; ``simulate`` charges the pair as one block.

    Example:
        >>> Action("F", 3), str(Action("B", 3, chunk=1))
        (Action(kind='F', microbatch=3, chunk=0), 'B3c1')
        >>> str(Action("B", 1, 1, overlap=True))  # '&': paired with the F before it
        '&B1c1'
    """

    kind: str
    microbatch: int
    chunk: int = 0
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"Action: kind must be one of {KINDS}, found {self.kind!r}.")
        for name in ("microbatch", "chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ScheduleError(f"Action: {name} must be an int >= 0, found {v!r}.")
        if not isinstance(self.overlap, bool) or (self.overlap and self.kind != "B"):
            raise ScheduleError(
                f"Action: overlap=True marks the B of an overlapped F&B pair; found kind={self.kind!r}, "
                f"overlap={self.overlap!r}. Put overlap=True on the B that follows the F it pairs with."
            )

    def __repr__(self) -> str:
        more = ", overlap=True" if self.overlap else ""
        return f"Action(kind={self.kind!r}, microbatch={self.microbatch}, chunk={self.chunk}{more})"

    def __str__(self) -> str:
        pre = "&" if self.overlap else ""
        return f"{pre}{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def looped_placement(n_stages: int, n_virtual: int) -> Placement:
    """The looped (interleaved) placement: chunk ``c`` of stage ``s`` holds virtual stage ``c * n_stages + s``.

    Example:
        >>> looped_placement(2, 2)
        ((0, 2), (1, 3))
    """
    return tuple(tuple(c * n_stages + s for c in range(n_virtual)) for s in range(n_stages))


def v_placement(n_stages: int) -> Placement:
    """The V-shaped placement of ``zbv`` / ``dualpipev``: stage ``s`` holds virtual stages ``s`` and ``2p-1-s``.

    The model goes down the stages and back up, so the last stage holds two consecutive virtual stages and
    the loss (virtual stage ``2p - 1``) lives on stage 0, next to the input.

    Example:
        >>> v_placement(3)
        ((0, 5), (1, 4), (2, 3))
    """
    return tuple((s, 2 * n_stages - 1 - s) for s in range(n_stages))


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Timeline:
    """What ``Schedule.simulate`` found.

    Attributes:
        timeline: per stage, ``(start, end, action)`` in execution order; the two halves of an overlapped F&B
            pair share one interval.
        makespan: time at which the last action ends.
        bubble_fraction: idle time over ``n_stages * makespan``.
        peak_in_flight: per stage, the most (microbatch, chunk) pairs whose ``F`` is done and whose last
            backward action (its ``W`` when it has one, else its ``B``) is not: the activation-memory proxy,
            in units of one chunk's activations for one microbatch.
        peak_memory: ``peak_in_flight / n_virtual``: the same peak in units of one microbatch's activations
            for the whole stage, comparable across interleaved and plain schedules.
        costs: the costs used (``F``, ``B``, ``W``, ``comm``, and ``FB`` when given).

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
    """Per-stage action lists, the sizes they refer to and the placement of chunks; see ``gpipe``, ``zbv``, ...

    Attributes:
        name: a label for messages and plots.
        n_stages: pipeline stages (devices on the ``pp`` axis).
        n_microbatches: microbatches per step.
        n_virtual: model chunks per stage (1 unless interleaved or V-shaped).
        actions: ``actions[stage]`` is that stage's list of ``Action`` in execution order.
        placement: ``placement[stage][chunk]`` is the virtual stage (model chunk, 0 = first layers) that
            chunk ``chunk`` of ``stage`` holds; every virtual stage ``0 .. n_stages * n_virtual - 1`` exactly
            once. Left empty, it is ``looped_placement(n_stages, n_virtual)`` (``c * n_stages + s``).

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
    placement: Placement = ()

    def __post_init__(self) -> None:
        if not self.placement and _is_size(self.n_stages) and _is_size(self.n_virtual):
            self.placement = looped_placement(self.n_stages, self.n_virtual)
        elif isinstance(self.placement, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in self.placement):
            self.placement = tuple(tuple(r) for r in self.placement)  # lists of lists are taken as tuples

    @property
    def n_virtual_stages(self) -> int:
        """The number of virtual stages (model chunks in all): ``n_stages * n_virtual``."""
        return self.n_stages * self.n_virtual

    @property
    def split_backward(self) -> bool:
        """True when the schedule has ``W`` actions (each ``B`` with a ``W`` is then the input-gradient half)."""
        return any(a.kind == "W" for acts in self.actions for a in acts)

    @property
    def placement_kind(self) -> str:
        """``"looped"`` (chunk ``c`` of stage ``s`` is virtual stage ``c*p+s``), ``"v"`` (``zbv`` / ``dualpipev``'s
        V-shape) or ``"custom"``.

        Example:
            >>> from funcshard.pipeline import zbv
            >>> zbv(2, 4).placement_kind
            'v'
        """
        if self.placement == looped_placement(self.n_stages, self.n_virtual):
            return "looped"
        if self.n_virtual == 2 and self.placement == v_placement(self.n_stages):
            return "v"
        return "custom"

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The virtual stage (model chunk, 0 = first layers) that chunk ``chunk`` of ``stage`` holds.

        Example:
            >>> from funcshard.pipeline import zbv
            >>> zbv(4, 8).virtual_stage(0, 1)  # V-shape: stage 0's second chunk is the last of 8
            7
        """
        if not (0 <= stage < len(self.placement)) or not (0 <= chunk < len(self.placement[stage])):
            raise self._fail(
                f"virtual_stage: no chunk {chunk!r} on stage {stage!r}; stages are 0..{self.n_stages - 1} "
                f"and chunks 0..{self.n_virtual - 1}."
            )
        return self.placement[stage][chunk]

    def stage_of(self, virtual_stage: int) -> tuple[int, int]:
        """The ``(stage, chunk)`` that holds ``virtual_stage``: the inverse of ``virtual_stage``.

        Example:
            >>> from funcshard.pipeline import interleaved_1f1b, zbv
            >>> interleaved_1f1b(4, 8, 2).stage_of(5), zbv(4, 8).stage_of(5)
            ((1, 1), (2, 1))
        """
        for s, row in enumerate(self.placement):
            for c, v in enumerate(row):
                if v == virtual_stage:
                    return s, c
        raise self._fail(f"stage_of: virtual stage {virtual_stage!r} is not in 0..{self.n_virtual_stages - 1}.")

    def is_split(self, stage: int, microbatch: int, chunk: int) -> bool:
        """True when ``stage`` splits the backward of (``microbatch``, ``chunk``): its ``B`` has a ``W``.

        A ``B`` without a ``W`` is the full backward (input and weight gradients at once).

        Example:
            >>> from funcshard.pipeline import dualpipev
            >>> sched = dualpipev(2, 4)
            >>> [sched.is_split(0, mb, 0) for mb in range(4)]  # DualPipeV splits only its last backwards
            [False, False, True, True]
        """
        if not (isinstance(stage, int) and 0 <= stage < len(self.actions)):
            raise self._fail(f"is_split: no stage {stage!r}; stages are 0..{len(self.actions) - 1}.")
        return Action("W", microbatch, chunk) in self.actions[stage]

    def __repr__(self) -> str:
        default = _is_size(self.n_stages) and self.placement == looped_placement(self.n_stages, self.n_virtual)
        return (
            f"Schedule({self.name!r}, n_stages={self.n_stages}, n_microbatches={self.n_microbatches}, "
            f"n_virtual={self.n_virtual}" + ("" if default else f", placement={self.placement}") + ")"
        )

    def __str__(self) -> str:
        return self.text()

    def _fail(self, msg: str) -> ScheduleError:
        return ScheduleError(f"Schedule {self.name!r}: {msg}")

    def _key(self, stage: int, a: Action) -> Key:
        return (a.kind, a.microbatch, self.placement[stage][a.chunk])

    def _deps(self, stage: int, a: Action) -> list[Key]:
        """The actions ``a`` waits for, as ``(kind, microbatch, virtual stage)``, wherever they are placed."""
        vs, mb = self.placement[stage][a.chunk], a.microbatch
        if a.kind == "F":
            return [("F", mb, vs - 1)] if vs > 0 else []
        if a.kind == "B":
            return [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs < self.n_virtual_stages - 1 else [])
        return [("B", mb, vs)]

    def _describe(self, kind: str, mb: int, vs: int) -> str:
        stage, chunk = self.stage_of(vs)
        where = f" (virtual stage {vs})" if self.n_virtual > 1 else ""
        return f"{Action(kind, mb, chunk)} on stage {stage}{where}"

    def _check_placement(self) -> None:
        p, v, pl = self.n_stages, self.n_virtual, self.placement
        if not (isinstance(pl, tuple) and len(pl) == p and all(isinstance(r, tuple) and len(r) == v for r in pl)):
            raise self._fail(
                f"placement must list n_virtual={v} virtual stages for each of the n_stages={p} stages "
                f"(placement[stage][chunk]), found {pl!r}. Use looped_placement({p}, {v}) or v_placement({p})."
            )
        flat = [x for r in pl for x in r]
        bad = [x for x in flat if not isinstance(x, int) or isinstance(x, bool)]
        dup = sorted({x for x in flat if not bad and flat.count(x) > 1})
        missing = [x for x in range(p * v) if x not in flat]
        if bad or dup or missing:
            raise self._fail(
                f"placement {pl} must hold each virtual stage 0..{p * v - 1} exactly once; "
                + (f"found non-int {bad[0]!r}" if bad else f"duplicated {dup}, missing {missing}")
                + f". Use looped_placement({p}, {v}) or v_placement({p})."
            )

    def _check_pair(self, stage: int, acts: list[Action], i: int) -> None:
        """An overlapped ``B`` at position ``i`` must follow an ``F`` of another (microbatch, chunk)."""
        a, prev = acts[i], acts[i - 1] if i > 0 else None
        if prev is None or prev.kind != "F":
            raise self._fail(
                f"stage {stage}, action {a} (position {i}) is overlapped (overlap=True) but follows "
                f"{prev if prev is not None else 'nothing'}: an overlapped B pairs with the F right before it. "
                "Put its F just before it or drop overlap."
            )
        if (prev.microbatch, prev.chunk) == (a.microbatch, a.chunk):
            raise self._fail(
                f"stage {stage}, action {a} (position {i}) overlaps its own forward {prev}, which it needs "
                "first. Pair it with the F of another microbatch or chunk."
            )

    def _check_row(self, s: int, acts: list[Action]) -> None:
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
            if a.overlap:
                self._check_pair(s, acts, i)
        for mb in range(self.n_microbatches):
            for c in range(self.n_virtual):
                for k in ("F", "B"):
                    if (k, mb, c) not in seen:
                        raise self._fail(f"stage {s} is missing action {Action(k, mb, c)}.")

    def _check_contents(self) -> None:
        for name in ("n_stages", "n_microbatches", "n_virtual"):
            _positive_int(f"Schedule {self.name!r}", name, getattr(self, name))
        self._check_placement()
        if not isinstance(self.actions, (list, tuple)) or len(self.actions) != self.n_stages:
            n = len(self.actions) if isinstance(self.actions, (list, tuple)) else self.actions
            raise self._fail(f"has {n} action lists for n_stages={self.n_stages}.")
        for s, acts in enumerate(self.actions):
            self._check_row(s, acts)

    def _unit(self, s: int, i: int) -> list[Action]:
        """The action at position ``i`` of stage ``s``, with the overlapped ``B`` that follows it, if any."""
        acts = self.actions[s]
        return acts[i : i + 2] if i + 1 < len(acts) and acts[i + 1].overlap else acts[i : i + 1]

    def _duration(self, unit: list[Action], costs: dict[str, float], weighted: set[tuple[int, int]] | None) -> float:
        """How long ``unit`` (one action or an overlapped F&B pair) takes.

        ``weighted``: the stage's split (microbatch, chunk) pairs, ``None`` when the schedule has no ``W``; a
        ``B`` outside it in a schedule with ``W`` actions is a full backward and costs ``B + W``.
        """
        if len(unit) == 2 and "FB" in costs:
            return costs["FB"]
        full = [weighted is not None and a.kind == "B" and (a.microbatch, a.chunk) not in weighted for a in unit]
        return sum(costs[a.kind] + (costs["W"] if f else 0.0) for a, f in zip(unit, full))

    def _weighted(self) -> list[set[tuple[int, int]]]:
        """Per stage, the (microbatch, chunk) pairs whose backward is split (a ``W`` is listed)."""
        return [{(a.microbatch, a.chunk) for a in acts if a.kind == "W"} for acts in self.actions]

    def _run(self, costs: dict[str, float]) -> list[list[tuple[float, float, Action]]]:
        """Run each stage's list in order, as soon as its dependencies are done (sends never block)."""
        p, weighted, split = self.n_stages, self._weighted(), self.split_backward
        end: dict[Key, tuple[float, int]] = {}
        pos, free = [0] * p, [0.0] * p
        timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
        progress = True
        while progress:
            progress = False
            for s in range(p):
                while pos[s] < len(self.actions[s]):
                    unit = self._unit(s, pos[s])
                    deps = [d for a in unit for d in self._deps(s, a)]
                    if any(d not in end for d in deps):
                        break
                    start = max([free[s]] + [end[d][0] + (costs["comm"] if end[d][1] != s else 0.0) for d in deps])
                    free[s] = start + self._duration(unit, costs, weighted[s] if split else None)
                    for a in unit:
                        end[self._key(s, a)] = (free[s], s)
                        timeline[s].append((start, free[s], a))
                    pos[s] += len(unit)
                    progress = True
        if any(pos[s] < len(self.actions[s]) for s in range(p)):
            raise self._fail("deadlock: " + self._stalls(pos, end) + ".")
        return timeline

    def _stalls(self, pos: list[int], end: dict[Key, tuple[float, int]]) -> str:
        """Why each stalled stage cannot go on: the dependency it waits for and where that one is stuck."""
        where = {self._key(s, a): (s, i) for s, acts in enumerate(self.actions) for i, a in enumerate(acts)}
        parts = []
        for s in (s for s in range(self.n_stages) if pos[s] < len(self.actions[s])):
            for a in self._unit(s, pos[s]):
                for d in (d for d in self._deps(s, a) if d not in end):
                    ds, di = where[d]
                    why = (
                        f"which comes later in stage {s}'s own list (position {di})"
                        if ds == s
                        else f"but stage {ds} is itself stalled at {self.actions[ds][pos[ds]]} (position {pos[ds]})"
                    )
                    parts.append(f"stage {s} stalls at {a} (position {pos[s]}): needs {self._describe(*d)}, {why}")
        return "; ".join(parts)

    def _costs(self, costs: dict[str, float] | None) -> dict[str, float]:
        v = float(self.n_virtual)
        if self.split_backward:
            out = {"F": 1.0 / v, "B": 1.0 / v, "W": 1.0 / v, "comm": 0.0}
        else:
            out = {"F": 1.0 / v, "B": 2.0 / v, "W": 0.0, "comm": 0.0}
        for k, x in (costs or {}).items():
            if k not in (*out, "FB"):
                raise self._fail(f"simulate: unknown cost {k!r}; expected keys F, B, W, FB, comm.")
            if not isinstance(x, (int, float)) or isinstance(x, bool) or x < 0:
                raise self._fail(f"simulate: cost {k!r} must be a number >= 0, found {x!r}.")
            out[k] = float(x)
        return out

    def validate(self) -> Schedule:
        """Check every action is present once on the right stage and that the lists can run without deadlock.

        Dependencies follow the placement: ``F`` of virtual stage ``v`` waits for ``F`` of ``v - 1`` on the
        stage holding it, ``B`` of ``v`` for its own ``F`` and for ``B`` of ``v + 1``, ``W`` for its ``B``.

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
                backward), or ``{"F": 1.0, "B": 1.0, "W": 1.0}`` when the schedule has ``W`` actions (a ``B``
                without its ``W`` then costs ``B + W``); the defaults are divided by ``n_virtual`` (a chunk
                is that fraction of a stage's layers). ``"FB"``: the duration of an overlapped F&B pair
                (default: the sum of its halves, as compute does not shrink; give less to model the
                communication one half hides behind the other). ``"comm"``: the latency of each
                stage-to-stage hop (default 0). Given keys override the defaults and are used as they are.

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
        busy = sum(e - b for t in timeline for b, e, a in t if not a.overlap)
        total = self.n_stages * makespan
        bubble = (total - busy) / total if total > 0 else 0.0
        peaks = []
        for acts, weighted in zip(self.actions, self._weighted()):
            now = peak = 0
            for a in acts:
                now += (a.kind == "F") - (a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in weighted))
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
    if not _is_size(value):
        raise ScheduleError(f"{fn}: {name} must be a positive int, found {value!r}.")
    return value  # type: ignore[return-value]


def _sizes(fn: str, **sizes: object) -> tuple[int, ...]:
    """The builder's size arguments, each checked to be a positive int."""
    return tuple(_positive_int(fn, k, v) for k, v in sizes.items())


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards. Holds all ``m`` microbatches' activations.

    Example:
        >>> [str(a) for a in gpipe(2, 2).actions[1]]
        ['F0', 'F1', 'B0', 'B1']
    """
    p, m = _sizes("gpipe", n_stages=n_stages, n_microbatches=n_microbatches)
    acts = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return Schedule("gpipe", p, m, 1, acts).validate()


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): ``p-1-s`` warmup forwards on stage ``s``, then alternate F and B, then cool down.

    Same bubble as GPipe, but stage ``s`` holds at most ``min(p - s, m)`` microbatches' activations.

    Example:
        >>> [str(a) for a in one_f_one_b(3, 4).actions[0]]
        ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    p, m = _sizes("one_f_one_b", n_stages=n_stages, n_microbatches=n_microbatches)
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
    p, m, v = _sizes(fn, n_stages=n_stages, n_microbatches=n_microbatches, n_virtual=n_virtual)
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
    p, m = _sizes(fn, n_stages=n_stages, n_microbatches=n_microbatches)
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


class _Row:
    """One stage's action list as a builder writes it: microbatches numbered in order per (kind, chunk).

    Example:
        >>> r = _Row()
        >>> r.f(0); r.f(1); r.b(1); r.pair(0, 0); r.w_oldest(); [str(a) for a in r.finish()]
        ['F0', 'F0c1', 'B0c1', 'F1', '&B0', 'W0c1']
    """

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[str, int], int] = {}
        self.unweighted: list[tuple[int, int]] = []  # (microbatch, chunk) of split B's without a W yet, oldest first

    def next(self, kind: str, chunk: int) -> int:
        """The microbatch the next ``kind`` action of ``chunk`` will take."""
        return self.count.get((kind, chunk), 0)

    def f(self, chunk: int) -> None:
        """Append the next forward of ``chunk``."""
        self.actions.append(Action("F", self.next("F", chunk), chunk))
        self.count["F", chunk] = self.next("F", chunk) + 1

    def b(self, chunk: int, *, split: bool = True, overlap: bool = False) -> None:
        """Append the next backward of ``chunk``: input-gradient only (a ``W`` follows later) if ``split``."""
        mb = self.next("B", chunk)
        self.actions.append(Action("B", mb, chunk, overlap))
        self.count["B", chunk] = mb + 1
        if split:
            self.unweighted.append((mb, chunk))

    def pair(self, f_chunk: int, b_chunk: int) -> None:
        """Append an overlapped F&B pair: the next forward of ``f_chunk`` with a full backward of ``b_chunk``."""
        self.f(f_chunk)
        self.b(b_chunk, split=False, overlap=True)

    def w(self, chunk: int) -> None:
        """Append the ``W`` of the oldest split backward of ``chunk`` still without one."""
        mb, c = next(x for x in self.unweighted if x[1] == chunk)
        self.unweighted.remove((mb, c))
        self.actions.append(Action("W", mb, c))

    def w_oldest(self) -> None:
        """Append the ``W`` of the oldest split backward still without one (of any chunk), if there is one."""
        if self.unweighted:
            self.w(self.unweighted[0][1])

    def finish(self) -> list[Action]:
        """The actions, after the ``W`` of every split backward still without one, oldest first."""
        while self.unweighted:
            self.w_oldest()
        return self.actions


def interleaved_zero_bubble(n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """Interleaved zero bubble (ZB1P of Qi et al. 2023): interleaved 1F1B with ``W`` deferred into the bubbles.

    Looped placement (chunk ``c`` of stage ``s`` is virtual stage ``c * n_stages + s``); microbatches go in
    rounds of ``m // max(1, m // p)``, so ``n_microbatches`` must be a multiple of ``max(1, m // p)`` (any
    ``m <= 2p - 1``, every multiple of ``p``). Warmup is ``(v-1) * round + p-1-s`` forwards; stage ``s``
    defers each ``W`` by ``s`` backwards. The order is torch's ``ScheduleInterleavedZeroBubble``; with
    ``n_virtual=1`` it is ``zero_bubble_h1``.

    Example:
        >>> sched = interleaved_zero_bubble(2, 4, 2)
        >>> [str(a) for a in sched.actions[1]][:7]  # stage 1 defers each W by one backward
        ['F0', 'F1', 'F0c1', 'B0c1', 'F1c1', 'B1c1', 'W0c1']
    """
    fn = "interleaved_zero_bubble"
    p, m, v = _sizes(fn, n_stages=n_stages, n_microbatches=n_microbatches, n_virtual=n_virtual)
    rounds = max(1, m // p)
    if m % rounds:
        ok = [n for n in range(1, 2 * m + p) if n % max(1, n // p) == 0]
        lo, hi = max(n for n in ok if n < m), min(n for n in ok if n > m)
        raise ScheduleError(
            f"{fn}: n_microbatches={m} is not a multiple of its number of rounds max(1, m // n_stages) = "
            f"{rounds}; microbatches go through in rounds of equal size. Use n_microbatches={lo} or {hi}."
        )
    per = m // rounds
    acts = []
    for s in range(p):
        total, warm, r = m * v, min((v - 1) * per + p - 1 - s, m * v), _Row()
        for op in range(total + warm):
            if op < total:
                r.f((op // per) % v)
            if op >= warm:
                r.b(v - 1 - ((op - warm) // per) % v)
                if op - warm >= s:
                    r.w_oldest()
        acts.append(r.finish())
    return Schedule(fn, p, m, v, acts).validate()


def looped_bfs(n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """Breadth-first looped pipeline (Lamy-Poirier 2023): each chunk runs all microbatches before the next.

    Looped placement (chunk ``c`` of stage ``s`` is virtual stage ``c * n_stages + s``). Stage ``s`` runs the
    forwards of chunk 0 for every microbatch, then of chunk 1, ...; then the full backwards, last chunk
    first, last microbatch first. Like GPipe it holds every microbatch's activations (of every chunk); the
    order is torch's ``ScheduleLoopedBFS``.

    Example:
        >>> [str(a) for a in looped_bfs(2, 2, 2).actions[0]]
        ['F0', 'F1', 'F0c1', 'F1c1', 'B1c1', 'B0c1', 'B1', 'B0']
    """
    p, m, v = _sizes("looped_bfs", n_stages=n_stages, n_microbatches=n_microbatches, n_virtual=n_virtual)
    row = [Action("F", i, c) for c in range(v) for i in range(m)]
    row += [Action("B", i, c) for c in reversed(range(v)) for i in reversed(range(m))]
    return Schedule("looped_bfs", p, m, v, [list(row) for _ in range(p)]).validate()


def _zbv_row(p: int, n: int, s: int) -> list[Action]:
    """Stage ``s`` of ZB-V for ``n`` microbatches (torch's ``ScheduleZBVZeroBubble`` order)."""
    r = _Row()
    for _ in range(2 * (p - s) - 1):
        r.f(0)
    for _ in range(s):
        r.f(1)
        r.f(0)
    for _ in range(p - s):
        r.f(1)
        r.b(1)
        r.w(1)
    while r.next("F", 1) < r.next("F", 0) or r.next("F", 0) < n:
        if r.next("F", 0) < n:
            r.f(0)
        r.b(0)
        r.w(0)
        r.f(1)
        r.b(1)
        r.w(1)
    for _ in range(s):
        r.b(0)
        r.b(1)
    for _ in range(p - s):
        r.b(0)
        r.w(0)
    while any(c == 1 for _, c in r.unweighted):
        r.w(1)
    return r.finish()


def zbv(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2023, section 6): zero bubble on a V-shaped placement of two chunks per stage.

    Stage ``s`` holds virtual stages ``s`` and ``2p-1-s`` (``v_placement``): the model runs down the stages
    and back up, so the loss sits on stage 0 and the turn on stage ``p-1`` costs no communication. Every
    backward is split (``B`` then ``W``); with ``F = B = W`` the bubble nearly vanishes for ``m >= 2p``, at
    1F1B's activation memory. The order is torch's ``ScheduleZBVZeroBubble``.

    Example:
        >>> sched = zbv(2, 4)
        >>> [str(a) for a in sched.actions[1]][:6]  # stage 1 holds virtual stages 1 and 2 (c1)
        ['F0', 'F0c1', 'F1', 'F1c1', 'B0c1', 'W0c1']
    """
    p, m = _sizes("zbv", n_stages=n_stages, n_microbatches=n_microbatches)
    n = max(2 * p - 1, m)  # build for a full pipeline, then drop the microbatches that do not exist
    acts = [[a for a in _zbv_row(p, n, s) if a.microbatch < m] for s in range(p)]
    return Schedule("zbv", p, m, 2, acts, v_placement(p)).validate()


def _dualpipev_row(p: int, m: int, s: int) -> list[Action]:
    """Stage ``s`` of DualPipeV (torch's ``ScheduleDualPipeV`` order); chunk 0 goes down, chunk 1 back up."""
    r = _Row()
    for _ in range(2 * (p - s - 1)):
        r.f(0)
    for _ in range(s + 1):
        r.f(0)
        r.f(1)
    for _ in range(p - s - 1):
        r.b(1)
        r.w_oldest()
        r.f(1)
    for i in range(m - 2 * p + s + 1):
        if i == 0 and s == p - 1:  # the turn of the V: not overlapped, to shorten the bubble
            r.f(0)
            r.b(1, split=False)
        else:
            r.pair(0, 1)
        r.pair(1, 0)
    for _ in range(p - s - 1):
        r.b(1, split=False)
        r.pair(1, 0)
    split = False
    for i in range(s + 1):  # the second half of these backwards is split, to fill the cooldown with W
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        r.b(1, split=split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        r.b(0, split=split)
    for _ in range(p - s - 1):
        r.w_oldest()
        r.b(0, split=split)
    return r.finish()


def dualpipev(n_stages: int, n_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe, cut to a V): V placement with overlapped F&B pairs in steady state.

    Stage ``s`` holds virtual stages ``s`` and ``2p-1-s`` (``v_placement``). In steady state each step is an
    overlapped pair (``F`` of one chunk, then ``B`` with ``overlap=True`` of the other, a full backward):
    DualPipe hides the communication of one half behind the compute of the other. Warmup and cooldown
    split some backwards (``B`` + ``W``) to fill bubbles. Needs ``n_microbatches >= 2 * n_stages``. The
    order is torch's ``ScheduleDualPipeV``.

    Example:
        >>> sched = dualpipev(2, 4)
        >>> [str(a) for a in sched.actions[0][7:11]]  # two overlapped pairs: F3 with B1c1, F2c1 with B0
        ['F3', '&B1c1', 'F2c1', '&B0']
    """
    fn = "dualpipev"
    p, m = _sizes(fn, n_stages=n_stages, n_microbatches=n_microbatches)
    if m < 2 * p:
        raise ScheduleError(
            f"{fn}: n_microbatches={m} is below 2 * n_stages = {2 * p}, which DualPipeV needs to fill its V. "
            f"Use n_microbatches >= {2 * p}, or zbv."
        )
    return Schedule(fn, p, m, 2, [_dualpipev_row(p, m, s) for s in range(p)], v_placement(p)).validate()


_BUILDERS: dict[str, tuple[Callable[..., Schedule], int | None]] = {  # name -> (builder, fixed n_virtual)
    "gpipe": (gpipe, 1),
    "1f1b": (one_f_one_b, 1),
    "interleaved": (interleaved_1f1b, None),
    "zb": (zero_bubble_h1, 1),
    "zbv": (zbv, 2),
    "dualpipev": (dualpipev, 2),
    "interleaved_zb": (interleaved_zero_bubble, None),
    "looped_bfs": (looped_bfs, None),
}


def by_name(name: str, n_stages: int, n_microbatches: int, n_virtual: int | None = None) -> Schedule:
    """Build a schedule from its name in ``SCHEDULE_NAMES`` (the CLI's and the model config's spelling).

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb"`` (ZB-H1), ``"zbv"``, ``"dualpipev"``,
            ``"interleaved_zb"`` or ``"looped_bfs"``.
        n_stages: pipeline stages.
        n_microbatches: microbatches per step.
        n_virtual: chunks per stage for ``"interleaved"``, ``"interleaved_zb"`` and ``"looped_bfs"``
            (default 2); the others fix it (1, or 2 for the V-shaped ``"zbv"`` and ``"dualpipev"``), and a
            different value is an error.

    Returns:
        The validated ``Schedule``.

    Example:
        >>> by_name("interleaved", 4, 8).n_virtual, by_name("zbv", 4, 8).placement[0]
        (2, (0, 7))
    """
    if name not in _BUILDERS:
        close = difflib.get_close_matches(str(name).lower(), SCHEDULE_NAMES, n=1)  # 1F1B, ZB-V, GPipe
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ScheduleError(f"by_name: unknown schedule {name!r}; expected one of {SCHEDULE_NAMES}.{hint}")
    build, fixed = _BUILDERS[name]
    if fixed is None:
        return build(n_stages, n_microbatches, 2 if n_virtual is None else n_virtual)
    if n_virtual not in (None, fixed):
        others = ", ".join(repr(k) for k, (_, f) in _BUILDERS.items() if f is None)
        raise ScheduleError(
            f"by_name: schedule {name!r} has exactly {fixed} chunk(s) per stage, found n_virtual={n_virtual!r}. "
            f"Drop n_virtual, or use one of {others} for a chosen number of chunks."
        )
    return build(n_stages, n_microbatches)
