"""The block of a global value that one device holds, written out for the tests (the reference they compare
funcshard's shards with): each dim is cut into as many equal blocks as the product of the axes its spec entry
names, and the device's block index over those axes is row-major (the first axis the major one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from funcshard import P


def shard_slices(
    shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int], coords: Mapping[str, int]
) -> tuple[slice, ...]:
    """The slices of a value of ``shape`` that the device at ``coords`` holds under ``spec``.

    >>> shard_slices((8, 6), P("dp", "tp"), {"dp": 2, "tp": 3}, {"dp": 1, "tp": 2})
    (slice(4, 8, None), slice(4, 6, None))
    """
    entries = [*spec, *[None] * (len(shape) - len(spec))]
    out = []
    for size, entry in zip(shape, entries, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        index, count = 0, 1
        for axis in axes:
            index, count = index * mesh_shape[axis] + coords[axis], count * mesh_shape[axis]
        block = size // count
        out.append(slice(index * block, (index + 1) * block))
    return tuple(out)
