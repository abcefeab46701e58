"""The per-device context that ``shard_map`` sets while a device runs the user's function."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..errors import ShardingError

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


class enter(AbstractContextManager):  # used as a function: ``with enter(ctx):``
    """Make ``ctx`` current in this thread for the duration of the block (a plain class: entered on every
    ``shard_map`` call, where a generator-based context manager costs several frames)."""

    __slots__ = ("ctx", "prev")

    def __init__(self, ctx: DeviceContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> DeviceContext:
        self.prev = getattr(_local, "ctx", None)
        _local.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _local.ctx = self.prev


def axes_of(axis: Any, mesh: Any, fn: str) -> tuple[str, ...]:
    """Normalise ``axis`` (a name or a tuple of names) to a tuple, checked against the mesh.

    Raises:
        ShardingError: an axis the mesh lacks, an axis named twice, or an empty tuple.
    """
    # keyed by the mesh object (a Mesh's own hash is a Python call); the entry holds the mesh, so its id is not
    # reused while the entry is there
    key = (axis, id(mesh)) if isinstance(axis, (str, tuple)) else None
    try:
        hit = _AXES.get(key) if key is not None else None
    except TypeError:  # a tuple holding something unhashable: checked (and refused) below
        key = hit = None
    if hit is not None and hit[1] is mesh:  # checked before: the same name(s) on the same mesh
        return hit[0]
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
    if key is not None:
        if len(_AXES) > 256:
            _AXES.clear()
        _AXES[key] = (axes, mesh)
    return axes


_AXES: dict[tuple[Any, int], tuple[tuple[str, ...], Any]] = {}  # (axis, id(mesh)) -> its checked axes, the mesh
