"""Communication accounting: calls and payload bytes per collective and axis, per device.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> with fs.comm_stats() as stats:
    ...     _ = fs.shard_map(lambda x: fs.psum(x, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())(torch.ones(4))
    >>> stats.calls("psum", "tp"), stats.bytes("psum")
    (1, 8)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["CommStats", "capture", "comm_stats", "record"]

_lock = threading.Lock()
_active: list[CommStats] = []


class CommStats:
    """Calls and bytes recorded while a :func:`comm_stats` block was open.

    Counts are those of one device: by default the lowest rank that recorded anything (under ``"dist"``,
    this process; under ``"sim"``, device 0); pass ``device=rank`` to choose another.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
        >>> f = fs.shard_map(lambda x: fs.psum(x, "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P())
        >>> with fs.comm_stats() as stats:
        ...     _ = f(torch.ones(4))
        >>> stats, stats.devices()
        (CommStats(calls=1, bytes=8), [0, 1])
    """

    def __init__(self) -> None:
        self._data: dict[int, dict[tuple[str, tuple[str, ...]], list[int]]] = defaultdict(
            lambda: defaultdict(lambda: [0, 0])
        )

    def _add(self, rank: int, name: str, axes: tuple[str, ...], nbytes: int) -> None:
        row = self._data[rank][(name, axes)]
        row[0] += 1
        row[1] += nbytes

    def _rows(self, name: str | None, axis: str | tuple[str, ...] | None, device: int | None) -> list[list[int]]:
        if not self._data:
            return []
        rank = min(self._data) if device is None else device
        want = None if axis is None else frozenset((axis,) if isinstance(axis, str) else axis)
        return [
            v
            for (n, axes), v in self._data.get(rank, {}).items()
            if (name is None or n == name) and (want is None or frozenset(axes) == want)
        ]

    def calls(
        self, name: str | None = None, axis: str | tuple[str, ...] | None = None, *, device: int | None = None
    ) -> int:
        """Number of calls of collective ``name`` over ``axis`` by one device (``None`` = any)."""
        return sum(v[0] for v in self._rows(name, axis, device))

    def bytes(
        self, name: str | None = None, axis: str | tuple[str, ...] | None = None, *, device: int | None = None
    ) -> int:
        """Payload bytes (size of the input on one device) passed to ``name`` over ``axis``, summed."""
        return sum(v[1] for v in self._rows(name, axis, device))

    def devices(self) -> list[int]:
        """The ranks that recorded something."""
        return sorted(self._data)

    def rows(self, *, device: int | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(collective, "axis1,axis2"): (calls, bytes)}`` of one device, sorted.

        Example:
            >>> with comm_stats() as stats:
            ...     pass
            >>> stats.rows()
            {}
        """
        if not self._data:
            return {}
        rank = min(self._data) if device is None else device
        return {(n, ",".join(a)): (c, b) for (n, a), (c, b) in sorted(self._data.get(rank, {}).items())}

    def table(self, *, device: int | None = None) -> str:
        """One row per (collective, axes): calls and bytes of one device, with a total line."""
        rows = self.rows(device=device)
        if not rows:
            return "no collectives recorded"
        lines = [f"{'collective':<17} {'axis':<16} {'calls':>7} {'bytes':>14}", "-" * 57]
        for (name, axes), (calls, nbytes) in rows.items():
            lines.append(f"{name:<17} {axes:<16} {calls:>7} {nbytes:>14,}")
        lines.append("-" * 57)
        lines.append(f"{'total':<34} {sum(c for c, _ in rows.values()):>7} {sum(b for _, b in rows.values()):>14,}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls()}, bytes={self.bytes()})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython / Jupyter: show the table
        p.text(self.table())


def record(rank: int, name: str, axes: tuple[str, ...], nbytes: int) -> None:
    """Add one call to every open :func:`comm_stats` block (cheap when none is open)."""
    log = getattr(_capturing, "log", None)
    if log is not None:
        log.append((rank, name, axes, nbytes))
    if not _active:
        return
    with _lock:
        for s in _active:
            s._add(rank, name, axes, nbytes)


_capturing = threading.local()


@contextmanager
def capture() -> Iterator[list[tuple[int, str, tuple[str, ...], int]]]:
    """The calls :func:`record` gets in this thread within the block, as ``(rank, name, axes, nbytes)`` (they are
    still recorded as usual): a compiled body records its collectives once, when it is traced, and replays
    them at each call.

    Example:
        >>> with capture() as log:
        ...     record(0, "psum", ("tp",), 8)
        >>> log
        [(0, 'psum', ('tp',), 8)]
    """
    prev = getattr(_capturing, "log", None)
    log: list[tuple[int, str, tuple[str, ...], int]] = []
    _capturing.log = log
    try:
        yield log
    finally:
        _capturing.log = prev


@contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Record the collectives made inside the block, forward and backward.

    Example:
        >>> with comm_stats() as stats:
        ...     pass
        >>> stats.calls()
        0
    """
    s = CommStats()
    with _lock:
        _active.append(s)
    try:
        yield s
    finally:
        with _lock:
            _active.remove(s)
