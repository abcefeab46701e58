"""Resharding as data: the fewest collectives that take one layout to another, and the per-device code that
runs them. ``shard_map`` runs these steps on the devices before the function when an argument's layout
differs from its in_spec, so ``fs.reshard`` is an identity shard_map.

Example:
    >>> from funcshard import P
    >>> reshard_plan(P("a"), P(None, "a"), 2)
    [('all_to_all', 'a', 1, 0)]
"""

from __future__ import annotations

from typing import Any

import torch

from ..collectives import lax
from ..tree.spec import P

__all__ = ["apply_reshard", "comparable", "reshard_plan"]

Step = tuple[Any, ...]


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return b[: len(a)] == a


def reshard_plan(src: P, dst: P, ndim: int) -> list[Step]:
    """The collectives that take layout ``src`` to ``dst``: a list of steps
    ``("all_to_all", axis, split_dim, concat_dim)``, ``("all_gather", axes, dim)``, ``("slice", axes, dim)``.

    Example:
        >>> reshard_plan(P("a"), P(None, "a"), 2)
        [('all_to_all', 'a', 1, 0)]
    """
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
            _, axes, d = step
            x = lax.all_gather_invariant(x, axes, dim=d, tiled=True)  # [.., s_d/n, ..] -> [.., s_d, ..]
        else:
            _, axes, d = step
            x = lax.pvary(x, axes)  # the backward psum collects every device's block of the cotangent
            size = x.shape[d] // lax.axis_size(axes)
            x = x.narrow(d, lax.axis_index_int(axes) * size, size)  # [.., s_d, ..] -> [.., s_d/n, ..]
    return x


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
