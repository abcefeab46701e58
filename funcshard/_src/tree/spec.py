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

__all__ = ["Entry", "P", "block_index", "check_spec", "format_mesh", "shard_shape", "shard_slices"]

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
            axis used twice, more entries than dims, or a dim not divisible by its axes' total size.

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
    for d, axes in enumerate(spec.dim_axes(len(shape))):
        for a in axes:
            if a not in mesh.shape:
                raise ShardingError(
                    f"{where}: {ctx} names axis '{a}', which the mesh does not have; "
                    f"use one of {list(mesh.axis_names)} or None."
                )
            if a in seen:
                raise ShardingError(f"{where}: {ctx} uses axis '{a}' twice; an axis may shard at most one dim, once.")
            seen.add(a)
        n = math.prod(mesh.shape[a] for a in axes)
        if shape[d] % n:
            raise ShardingError(
                f"{where}: {ctx}: dim {d} of size {shape[d]} is sharded over {axes} of total size {n}, and "
                f"{shape[d]} is not divisible by {n}; pad dim {d} to a multiple of {n} or shard it over "
                f"fewer axes."
            )
    return spec


def shard_shape(shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's block.

    Example:
        >>> shard_shape((8, 6), P("dp", "tp"), {"dp": 2, "tp": 3})
        (4, 2)
    """
    return tuple(
        s // math.prod(mesh_shape[a] for a in axes) for s, axes in zip(shape, spec.dim_axes(len(shape)), strict=True)
    )


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
    """The slices of the global value that the device at ``coords`` holds.

    Example:
        >>> shard_slices((8, 6), P("dp", "tp"), {"dp": 2, "tp": 3}, {"dp": 1, "tp": 2})
        (slice(4, 8, None), slice(4, 6, None))
    """
    out = []
    for s, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        i, n = block_index(axes, coords, mesh_shape)
        size = s // n
        out.append(slice(i * size, (i + 1) * size))
    return tuple(out)
