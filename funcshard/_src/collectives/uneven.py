"""Blocks of different shapes on the devices of an axis (``torch.tensor_split``'s uneven splits): learning the
other devices' shapes, and the padding and cutting that let the even collectives move them.

A call whose arguments are all split evenly, and that made no uneven block so far, learns nothing: every device's
block is taken to have this device's shape (no communication). Otherwise the devices exchange their shapes (a few
integers each, not counted by ``comm_stats``, which counts the collectives that move the data).

Example:
    >>> import torch
    >>> pad_to(torch.ones(2, 3), (3, 4)).shape
    torch.Size([3, 4])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime.context import DeviceContext, axes_of, current, noted_uneven

__all__ = ["block_shapes", "block_sizes", "may_differ", "pad_to"]


def may_differ(ctx: DeviceContext) -> bool:
    """Whether the devices' blocks may differ in shape in the running call: an argument was split unevenly, or a
    collective or draw of this call made an uneven block (``runtime.context.note_uneven``)."""
    return ctx.uneven or noted_uneven()


def block_shapes(shape: Sequence[int], axes: tuple[str, ...], ctx: DeviceContext) -> list[tuple[int, ...]]:
    """Every device's block shape over ``axes`` (in axis order), this device's being ``shape``: learnt from the
    devices where they may differ (:func:`may_differ`), else ``shape`` for each. On a mesh that holds no data
    (``"abstract"``) there is nothing to exchange: the blocks are planned as equal (within a row of the true ones).

    Example:
        >>> # inside shard_map on tp=4, 10 rows split as P("tp"): block_shapes((3, 8), ("tp",), ctx)
        >>> # -> [(3, 8), (3, 8), (2, 8), (2, 8)]
    """
    n = 1
    for a in axes:
        n *= ctx.mesh.shape[a]
    shape = tuple(int(s) for s in shape)
    if n == 1 or not may_differ(ctx) or not ctx.mesh.backend_impl.holds_data:
        return [shape] * n
    with torch._C.DisableTorchFunction():
        mine = torch.tensor([len(shape), *shape], dtype=torch.int64, device=ctx.mesh.local_device())
        every = ctx.device.all_gather(mine, axes).tolist()  # [1 + ndim] -> [n, 1 + ndim]
    return [tuple(row[1:]) for row in every]


def block_sizes(size: int, axis: str | tuple[str, ...]) -> tuple[int, ...]:
    """The sizes of every device's block along a dim split over ``axis``, in axis order, this device's being
    ``size`` (:func:`block_shapes` of one dim): ``torch.tensor_split``'s blocks where the dim is split unevenly.

    Example:
        >>> # inside shard_map on tp=4, a vocabulary of 250 split as P("tp"): block_sizes(63, "tp") == (63, 63, 62, 62)
    """
    ctx = current("block_sizes")
    axes = axes_of(axis, ctx.mesh, "block_sizes")
    return tuple(s[0] for s in block_shapes((size,), axes, ctx))


def pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` padded with zeros at the end of each dim to ``shape`` (differentiable: the backward cuts the padding).

    Example:
        >>> pad_to(torch.ones(1, 2), (2, 2)).tolist()
        [[1.0, 1.0], [0.0, 0.0]]
    """
    for d, want in enumerate(shape):
        extra = want - t.shape[d]
        if extra > 0:
            pad = list(t.shape)
            pad[d] = extra
            t = torch.cat([t, t.new_zeros(pad)], dim=d)  # [.., s_d, ..] -> [.., want, ..]
    return t
