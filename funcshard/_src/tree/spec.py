"""``P``: how each dim of a tensor is laid out over named mesh axes, and the arithmetic of shards.

Pure data: this module knows nothing of backends. A "mesh" here is anything with ``axis_names`` (tuple)
and ``shape`` (dict name -> size).

Example:
    >>> spec = P(None, "tp")
    >>> spec
    P(None, 'tp')
    >>> spec.dim_axes(2)
    ((), ('tp',))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ShardingError

__all__ = [
    "Entry",
    "P",
    "block_index",
    "check_spec",
    "format_mesh",
    "is_even",
    "shard_shape",
    "shard_slices",
    "split_sizes",
    "uneven_axes",
]

Entry = str | tuple[str, ...] | None


class P:
    """A partition spec: one entry per tensor dim, each ``None``, an axis name, or a tuple of axis names.

    A tuple shards the dim over the product of its axes, major to minor. Missing trailing entries mean
    ``None``; an axis the spec does not name means the value is replicated over that axis.

    Args:
        *entries: one per leading tensor dim.

    Example:
        >>> P("dp", None) == P("dp")
        True
        >>> P(("dp", "fsdp"), "tp").axes
        ('dp', 'fsdp', 'tp')
    """

    __slots__ = ("_axes", "_entries", "_norm")

    def __init__(self, *entries: Entry) -> None:
        norm: list[tuple[str, ...]] = []
        for e in entries:
            if e is None:
                norm.append(())
            elif isinstance(e, str):
                norm.append((e,))
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                norm.append(tuple(e))
            else:
                raise ShardingError(
                    f"P: entry {e!r} is not None, an axis name (str) or a tuple of axis names; "
                    f"write e.g. P(None, 'tp') or P(('dp', 'fsdp'), None)."
                )
        while norm and norm[-1] == ():
            norm.pop()
        object.__setattr__(self, "_entries", tuple(entries))
        object.__setattr__(self, "_norm", tuple(norm))
        object.__setattr__(self, "_axes", tuple(a for e in norm for a in e))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("P is immutable")

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The entries as written."""
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):  # noqa: ANN204 - iterator of entries
        return iter(self._entries)

    def __getitem__(self, i: int) -> Entry:
        return self._entries[i]

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec names, in order of appearance."""
        return self._axes

    def dim_axes(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        """The axes of each of ``ndim`` dims (``()`` for a replicated dim), padded with ``()``."""
        return self._norm + ((),) * max(0, ndim - len(self._norm))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self._norm == other._norm

    def __hash__(self) -> int:
        return hash(("P", self._norm))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) if not isinstance(e, list) else repr(tuple(e)) for e in self._entries) + ")"

    def __reduce__(self) -> tuple[Any, tuple[Entry, ...]]:
        return (P, self._entries)


def is_spec(x: Any) -> bool:
    """True for a ``P`` (used as the leaf test of spec trees)."""
    return isinstance(x, P)


def format_mesh(mesh: Any) -> str:
    """``{'dp': 2, 'tp': 4}`` as text, for error messages."""
    return "{" + ", ".join(f"'{n}': {mesh.shape[n]}" for n in mesh.axis_names) + "}"


def _where(fn: str, path: str) -> str:
    loc = f" at '{path}'" if path else ""
    return f"{fn}{loc}"


def check_spec(spec: Any, shape: Sequence[int], mesh: Any, *, path: str = "", fn: str = "spec") -> P:
    """Validate ``spec`` for a value of ``shape`` on ``mesh``; return it.

    Raises:
        ShardingError: naming the function, the pytree path, spec, shape and mesh, for an unknown axis, an
            axis used twice, or more entries than dims. A dim its axes do not divide is valid: it is split
            unevenly, as ``torch.tensor_split`` splits it (:func:`split_sizes`).

    Example:
        >>> class M: axis_names = ("tp",); shape = {"tp": 2}
        >>> check_spec(P(None, "tp"), (3, 4), M())
        P(None, 'tp')
    """
    where = _where(fn, path)
    if not isinstance(spec, P):
        raise ShardingError(
            f"{where}: expected a spec P(...), found {spec!r} (type {type(spec).__name__}); "
            f"wrap axis names in P, e.g. P('dp') or P() for replicated."
        )
    ctx = f"spec {spec!r} for shape {tuple(shape)} on mesh {format_mesh(mesh)}"
    if len(spec) > len(shape):
        raise ShardingError(
            f"{where}: {ctx} has {len(spec)} entries but the value has only {len(shape)} dims; "
            f"give at most one entry per dim."
        )
    seen: set[str] = set()
    for axes in spec.dim_axes(len(shape)):
        for a in axes:
            if a not in mesh.shape:
                raise ShardingError(
                    f"{where}: {ctx} names axis '{a}', which the mesh does not have; "
                    f"use one of {list(mesh.axis_names)} or None."
                )
            if a in seen:
                raise ShardingError(f"{where}: {ctx} uses axis '{a}' twice; an axis may shard at most one dim, once.")
            seen.add(a)
    return spec


def split_sizes(size: int, count: int) -> tuple[int, ...]:
    """The block sizes of a dim of ``size`` split over ``count`` devices, as ``torch.tensor_split`` splits it:
    the first ``size % count`` blocks are one row longer (some are empty when ``size < count``).

    Example:
        >>> split_sizes(10, 4)
        (3, 3, 2, 2)
        >>> split_sizes(2, 4)
        (1, 1, 0, 0)
    """
    q, r = divmod(size, count)
    return tuple(q + 1 if i < r else q for i in range(count))


def _block(size: int, index: int, count: int) -> tuple[int, int]:
    """``(start, length)`` of block ``index`` of ``count`` of a dim of ``size`` (``torch.tensor_split``'s)."""
    q, r = divmod(size, count)
    return index * q + min(index, r), q + (1 if index < r else 0)


def is_even(shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int]) -> bool:
    """Whether every dim of ``shape`` is divided evenly by its axes' total size (every block the same shape).

    Example:
        >>> is_even((8, 6), P("dp", "tp"), {"dp": 2, "tp": 3}), is_even((10,), P("dp"), {"dp": 4})
        (True, False)
    """
    for s, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        if axes and s % math.prod(mesh_shape[a] for a in axes):
            return False
    return True


def uneven_axes(shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The axes of the dims of ``shape`` that their axes do not divide (the devices' blocks differ along them).

    Example:
        >>> uneven_axes((10, 6), P("dp", "tp"), {"dp": 4, "tp": 3})
        ('dp',)
    """
    out: list[str] = []
    for s, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        if axes and s % math.prod(mesh_shape[a] for a in axes):
            out.extend(axes)
    return tuple(out)


def shard_shape(
    shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int], coords: Mapping[str, int] | None = None
) -> tuple[int, ...]:
    """The shape of one device's block: the device at ``coords``, or (``coords=None``) the first device, whose
    block is the largest where a dim is split unevenly (``torch.tensor_split``'s blocks).

    Example:
        >>> shard_shape((8, 6), P("dp", "tp"), {"dp": 2, "tp": 3})
        (4, 2)
        >>> shard_shape((10, 6), P("dp"), {"dp": 4}, {"dp": 3})
        (2, 6)
    """
    out = []
    for s, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        if not axes:
            out.append(s)
            continue
        i, n = block_index(axes, coords, mesh_shape) if coords is not None else (0, _count(axes, mesh_shape))
        out.append(_block(s, i, n)[1])
    return tuple(out)


def _count(axes: Iterable[str], mesh_shape: Mapping[str, int]) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def block_index(axes: Iterable[str], coords: Mapping[str, int], mesh_shape: Mapping[str, int]) -> tuple[int, int]:
    """``(index, count)``: the row-major index of ``coords`` over ``axes`` (major first) and their total size.

    Example:
        >>> block_index(("dp", "tp"), {"dp": 1, "tp": 2}, {"dp": 2, "tp": 4})
        (6, 8)
    """
    idx, count = 0, 1
    for a in axes:
        idx = idx * mesh_shape[a] + coords[a]
        count *= mesh_shape[a]
    return idx, count


def shard_slices(
    shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int], coords: Mapping[str, int]
) -> tuple[slice, ...]:
    """The slices of the global value that the device at ``coords`` holds (``torch.tensor_split``'s blocks
    where a dim is split unevenly).

    Example:
        >>> shard_slices((8, 6), P("dp", "tp"), {"dp": 2, "tp": 3}, {"dp": 1, "tp": 2})
        (slice(4, 8, None), slice(4, 6, None))
        >>> shard_slices((10,), P("dp"), {"dp": 4}, {"dp": 2})
        (slice(6, 8, None),)
    """
    out = []
    for s, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        i, n = block_index(axes, coords, mesh_shape)
        start, length = _block(s, i, n)
        out.append(slice(start, start + length))
    return tuple(out)
