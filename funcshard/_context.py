"""The per-device context that ``shard_map`` sets while a device runs the user's function."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ._errors import ShardingError

__all__ = ["DeviceContext", "axes_of", "current", "enter", "is_donated", "maybe_current"]

_local = threading.local()


@dataclass(frozen=True)
class DeviceContext:
    """Which device of which mesh is running, and whether varying axes are tracked."""

    mesh: Any
    device: Any  # a _backend.DeviceHandle
    check_vma: bool
    donated: frozenset[int] = frozenset()  # id() of the argument blocks donated to this call (written in place)


def is_donated(*ts: Any) -> bool:
    """True when every one of ``ts`` is a block donated to the running ``shard_map`` call (``donate=``), so
    the call may write into it in place (the optimisers do). False outside shard_map.

    Example:
        >>> is_donated()  # outside shard_map
        False
    """
    ctx = getattr(_local, "ctx", None)
    return ctx is not None and bool(ctx.donated) and bool(ts) and all(id(t) in ctx.donated for t in ts)


def maybe_current() -> DeviceContext | None:
    """The context of the device this thread runs, or None outside shard_map."""
    return getattr(_local, "ctx", None)


def current(fn: str) -> DeviceContext:
    """The context of the running device.

    Raises:
        ShardingError: outside shard_map.
    """
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise ShardingError(
            f"{fn}: called outside shard_map; collectives name mesh axes and only exist while a device runs "
            f"a function under fs.shard_map(f, mesh=..., in_specs=..., out_specs=...). Call {fn} inside f."
        )
    return ctx


@contextmanager
def enter(ctx: DeviceContext) -> Iterator[DeviceContext]:
    """Make ``ctx`` current in this thread for the duration of the block."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def axes_of(axis: Any, mesh: Any, fn: str) -> tuple[str, ...]:
    """Normalise ``axis`` (a name or a tuple of names) to a tuple, checked against the mesh.

    Raises:
        ShardingError: an axis the mesh lacks, an axis named twice, or an empty tuple.
    """
    axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ShardingError(
            f"{fn}: axis must be a mesh axis name or a non-empty tuple of names, found {axis!r}; "
            f"the mesh has {list(mesh.axis_names)}."
        )
    for a in axes:
        if a not in mesh.shape:
            raise ShardingError(
                f"{fn}: axis '{a}' is not an axis of the mesh {mesh.shape}; use one of {list(mesh.axis_names)}."
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(f"{fn}: axis tuple {axes} names an axis twice; name each axis once.")
    return axes
