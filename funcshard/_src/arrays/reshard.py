"""Resharding as data: the fewest collectives that take one layout to another, and the per-device code that
runs them. ``shard_map`` runs these steps on the devices before the function when an argument's layout
differs from its in_spec, so ``fs.reshard`` is an identity shard_map.

Example:
    >>> from funcshard import P
    >>> reshard_plan(P("a"), P(None, "a"), 2)
    [('all_to_all', 'a', 1, 0)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..collectives import lax
from ..tree.spec import P, split_sizes

__all__ = ["apply_reshard", "comparable", "reshard_plan"]

Step = tuple[Any, ...]


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return b[: len(a)] == a


def reshard_plan(
    src: P, dst: P, ndim: int, shape: Sequence[int] | None = None, mesh_shape: Mapping[str, int] | None = None
) -> list[Step]:
    """The collectives that take layout ``src`` to ``dst``: a list of steps
    ``("all_to_all", axis, split_dim, concat_dim)``, ``("all_gather", axes, dim)``, ``("slice", axes, dim)``.

    Given the global ``shape`` and the ``mesh_shape``, a dim that ``src`` or ``dst`` splits unevenly
    (``torch.tensor_split``'s blocks, whose nesting is not that of the even split) is gathered whole and cut
    again: ``("all_gather", axes, dim, sizes)`` and ``("slice", axes, dim, sizes)``, ``sizes`` the blocks of the
    dim in axis order.

    Example:
        >>> reshard_plan(P("a"), P(None, "a"), 2)
        [('all_to_all', 'a', 1, 0)]
        >>> reshard_plan(P("a"), P(None, "a"), 2, (10, 4), {"a": 4})
        [('all_gather', ('a',), 0, (3, 3, 2, 2)), ('slice', ('a',), 1)]
    """
    if shape is not None and mesh_shape is not None:
        uneven = _uneven_dims(src, dst, shape, mesh_shape)
        if uneven:
            return _regather_plan(src, dst, shape, mesh_shape, uneven)
    cur = list(src.dim_axes(ndim))
    want = list(dst.dim_axes(ndim))
    steps: list[Step] = []
    while True:
        step = None
        for i in range(ndim):
            if cur[i] and not _is_prefix(cur[i], want[i]):
                a = cur[i][-1]
                for j in range(ndim):
                    if j != i and _is_prefix((*cur[j], a), want[j]):
                        step = ("all_to_all", a, j, i)
                        cur[i], cur[j] = cur[i][:-1], (*cur[j], a)
                        break
            if step:
                break
        if step is None:
            for i in range(ndim):
                if not _is_prefix(cur[i], want[i]):
                    k = 0
                    while k < min(len(cur[i]), len(want[i])) and cur[i][k] == want[i][k]:
                        k += 1
                    step = ("all_gather", cur[i][k:], i)
                    cur[i] = cur[i][:k]
                    break
        if step is None:
            break
        steps.append(step)
    for j in range(ndim):
        extra = want[j][len(cur[j]) :]
        if extra:
            steps.append(("slice", extra, j))
    return steps


def _uneven_dims(src: P, dst: P, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> set[int]:
    """The dims whose layout changes and that ``src`` or ``dst`` split unevenly."""
    out = set()
    for d, (a, b) in enumerate(zip(src.dim_axes(len(shape)), dst.dim_axes(len(shape)), strict=True)):
        if a != b and any(shape[d] % math.prod(mesh_shape[x] for x in axes) for axes in (a, b)):
            out.add(d)
    return out


def _regather_plan(src: P, dst: P, shape: Sequence[int], mesh_shape: Mapping[str, int], uneven: set[int]) -> list[Step]:
    """:func:`reshard_plan` of a layout with an uneven dim: every dim whose layout changes is gathered whole
    (an uneven one by its blocks' sizes), then each is cut by its new axes (an uneven one likewise)."""
    cur, want = src.dim_axes(len(shape)), dst.dim_axes(len(shape))
    moved = [d for d in range(len(shape)) if cur[d] != want[d]]
    steps: list[Step] = []
    for d in moved:
        if cur[d]:
            n = math.prod(mesh_shape[a] for a in cur[d])
            sizes = (split_sizes(shape[d], n),) if d in uneven and shape[d] % n else ()
            steps.append(("all_gather", cur[d], d, *sizes))
    for d in moved:
        if want[d]:
            n = math.prod(mesh_shape[a] for a in want[d])
            sizes = (split_sizes(shape[d], n),) if d in uneven and shape[d] % n else ()
            steps.append(("slice", want[d], d, *sizes))
    return steps


def apply_reshard(x: torch.Tensor, steps: list[Step]) -> torch.Tensor:
    """Run ``steps`` (from :func:`reshard_plan`) on this device's block ``x``, inside shard_map.

    Differentiable: each step's transpose moves the cotangent back to the source layout.

    Example:
        >>> # inside shard_map: y = apply_reshard(x, reshard_plan(P("a"), P(None, "a"), 2))
    """
    for step in steps:
        if step[0] == "all_to_all":
            _, axis, split_dim, concat_dim = step
            # [.., s_j, .., s_i/n, ..] -> [.., s_j/n, .., s_i, ..]
            x = lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)
        elif step[0] == "all_gather":
            axes, d = step[1], step[2]
            if len(step) > 3:  # uneven blocks: padded to the largest, gathered, cut to their sizes
                x = gather_blocks(x, axes, d, step[3])  # [.., sizes[i], ..] -> [.., sum(sizes), ..]
            else:
                x = lax.all_gather_invariant(x, axes, dim=d, tiled=True)  # [.., s_d/n, ..] -> [.., s_d, ..]
        else:
            axes, d = step[1], step[2]
            x = lax.pvary(x, axes)  # the backward psum collects every device's block of the cotangent
            i = lax.axis_index_int(axes)
            if len(step) > 3:  # uneven blocks: tensor_split's
                sizes = step[3]
                x = x.narrow(d, sum(sizes[:i]), sizes[i])  # [.., s_d, ..] -> [.., sizes[i], ..]
            else:
                size = x.shape[d] // lax.axis_size(axes)
                x = x.narrow(d, i * size, size)  # [.., s_d, ..] -> [.., s_d/n, ..]
    return x


def gather_blocks(x: torch.Tensor, axes: tuple[str, ...], dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """All-gather (invariant) of blocks of different ``sizes`` along ``dim`` (in axis order; this device's is
    ``x``): each padded to the largest, gathered, and the padding cut away. Differentiable (the backward keeps
    this device's block of the cotangent).

    Example:
        >>> # inside shard_map on tp=4, blocks of 3, 3, 2, 2 rows: full = gather_blocks(x, ("tp",), 0, (3, 3, 2, 2))
    """
    m = max(sizes)
    pad = m - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)  # [.., sizes[i], ..] -> [.., m, ..]
    full = lax.all_gather_invariant(x, axes, dim=dim, tiled=True)  # [.., m, ..] -> [.., n m, ..]
    parts = [full.narrow(dim, i * m, s) for i, s in enumerate(sizes)]
    return torch.cat(parts, dim=dim)  # [.., n m, ..] -> [.., sum(sizes), ..]


def comparable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype that torch's comparisons and arithmetic take, holding the same values exactly: float8 as
    float16, complex32 as complex64 (neither has ``torch.equal`` nor, float8, an add); other tensors as they are.

    Example:
        >>> import torch
        >>> comparable(torch.ones(2, dtype=torch.float8_e4m3fn)).dtype
        torch.float16
    """
    if t.dtype == torch.complex32:
        return t.to(torch.complex64)
    if t.is_floating_point() and t.element_size() == 1:
        return t.to(torch.float16)
    return t
