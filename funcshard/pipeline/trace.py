"""The wall-clock timeline of real pipeline steps, beside the one ``Schedule.simulate`` predicts.

Inside ``with trace() as tr:``, every action that :func:`funcshard.pipeline.run` executes is recorded with the
time it started and ended on its stage (after its input had arrived: waiting shows as a gap), so
``tr.timeline`` has the shape of ``Schedule.simulate().timeline`` and can be drawn the same way. Under ``"sim"``
every stage runs in this process and all of them are recorded; under ``"dist"`` each process records its own
stage (the rows of the others stay empty).

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.pipeline import one_f_one_b, run, trace
    >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
    >>> sched = one_f_one_b(2, 4)
    >>> def step(w, xs):
    ...     return run(sched, lambda p, x: x @ p[0], w, xs, loss_fn=lambda y: y.sum())
    >>> f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P()), out_specs=(P(), P("pp")))
    >>> with trace() as tr:
    ...     _ = f(torch.ones(2, 1, 3, 3), torch.ones(4, 2, 3))
    >>> [len(row) for row in tr.timeline]  # 4 forwards and 4 backwards on each stage
    [8, 8]
    >>> 0.0 <= tr.bubble_fraction < 1.0
    True
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .schedules import Action

__all__ = ["Trace", "active_trace", "trace"]


class Trace:
    """Actions recorded while a :func:`trace` is active: per stage, ``(start, end, action)`` in seconds from
    the first recorded start, in the order they ran.

    Attributes:
        timeline: per stage (0 to the highest stage recorded), ``(start, end, action)`` tuples.
        makespan: seconds from the first start to the last end (0.0 when nothing was recorded).
        bubble_fraction: idle time over ``stages * makespan`` (waiting for inputs, and the pipeline's ramp).

    Example:
        >>> from funcshard.pipeline import Action
        >>> tr = Trace()
        >>> tr.add(0, 10.0, 11.0, Action("F", 0)); tr.add(1, 11.0, 12.0, Action("F", 0))
        >>> tr.makespan, tr.bubble_fraction
        (2.0, 0.5)
    """

    def __init__(self) -> None:
        self._rows: dict[int, list[tuple[float, float, Action]]] = {}
        self._lock = threading.Lock()

    def add(self, stage: int, start: float, end: float, action: Action) -> None:
        """Record that ``stage`` ran ``action`` from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        with self._lock:
            self._rows.setdefault(stage, []).append((start, end, action))

    @property
    def timeline(self) -> list[list[tuple[float, float, Action]]]:
        with self._lock:
            rows = {s: list(r) for s, r in self._rows.items()}
        if not rows:
            return []
        t0 = min(b for r in rows.values() for b, _, _ in r)
        return [[(b - t0, e - t0, a) for b, e, a in rows.get(s, [])] for s in range(max(rows) + 1)]

    @property
    def makespan(self) -> float:
        tl = self.timeline
        return max((e for row in tl for _, e, _ in row), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        tl, span = self.timeline, self.makespan
        if not tl or span <= 0:
            return 0.0
        busy = sum(e - b for row in tl for b, e, _ in row)
        return 1.0 - busy / (len(tl) * span)


_lock = threading.Lock()
_active: list[Trace] = []  # not thread-local: the simulated devices run in threads of their own


def active_trace() -> Trace | None:
    """The innermost active :func:`trace`, or None."""
    return _active[-1] if _active else None


@contextmanager
def trace() -> Iterator[Trace]:
    """Record the wall-clock timeline of every pipeline step run inside the block (see the module docstring).

    Example:
        >>> with trace() as tr:
        ...     pass  # run pipelined steps here
        >>> tr.timeline
        []
    """
    tr = Trace()
    with _lock:
        _active.append(tr)
    try:
        yield tr
    finally:
        with _lock:
            _active.remove(tr)


def now() -> float:
    """The clock the trace uses."""
    return time.perf_counter()
