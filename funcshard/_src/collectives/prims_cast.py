"""Collectives that change dtype on the way: mixed precision's gather and gradient sum (see ``_precision``).

A gradient's reduction runs in the dtype of the collective's output: autograd hands a Function the cotangent
in its output's dtype and casts what it returns to its input's dtype. So "gather in bfloat16, reduce the
gradients in float32" (FSDP2's default ``MixedPrecisionPolicy``) cannot be a cast and a plain all-gather: the
cast has to be inside the collective. These two Functions are that, each with the four rules of ``_prims``:

- :class:`AllGatherCast`: ``x`` (the parameter dtype) cast to ``dtype`` and all-gathered (the forward moves
  ``dtype``); the backward casts the cotangent to ``grad_dtype``, reduce-scatters it and casts the shard
  back to ``x``'s dtype.
- :class:`PvaryCast`: ``x`` cast to ``dtype`` and marked varying (no communication); the backward casts the
  cotangents to ``grad_dtype``, sums them over the axes in one bucketed all-reduce, and casts them back.

With ``dtype == grad_dtype == x.dtype`` they are ``AllGather`` and ``PvaryBucket``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..runtime.stats import record
from .prims import AllReduce, Dims, Prim, ReduceScatter, call, move_batch, nbytes

if TYPE_CHECKING:
    from torch._functorch.autograd_function import VmapInfo

__all__ = ["AllGatherCast", "PvaryCast"]


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


class AllGatherCast(Prim):
    """All-gather ``[*s] -> [n, *s]`` of ``x`` cast to ``dtype``; the gradient reduced in ``grad_dtype``.

    - forward: ``y[i] = x.to(dtype) on member i``; the result varies over ``axes`` (as ``AllGather``).
    - backward: ``reduce_scatter(g.to(grad_dtype)).to(x.dtype)``, ``[n, *s] -> [*s]``.
    - jvp: the same cast and all-gather of the tangent.
    - vmap: ``[B, *s] -> [n, B, *s]`` in one all-gather (out dim 1).
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: the result varies over ``axes``, as ``AllGather``'s."""
        return have | axes

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor, dev: Any, axes: tuple[str, ...], dtype: torch.dtype, grad_dtype: torch.dtype
    ) -> torch.Tensor:
        xc = _cast(x, dtype)
        record(dev.rank, "all_gather", axes, nbytes(xc))
        return dev.all_gather(xc, axes)  # [*s] (dtype) -> [n, *s] (dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes, ctx.dtype, ctx.grad_dtype = inputs[1:5]
        ctx.in_dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        shard = call(ReduceScatter, _cast(g, ctx.grad_dtype), ctx.dev, ctx.axes)  # [n, *s] -> [*s] (grad_dtype)
        return _cast(shard, ctx.in_dtype), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(AllGatherCast, t, ctx.dev, ctx.axes, ctx.dtype, ctx.grad_dtype)  # [*s] -> [n, *s]

    @staticmethod
    def vmap(
        info: VmapInfo,
        in_dims: Dims,
        x: torch.Tensor,
        dev: Any,
        axes: tuple[str, ...],
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, int]:
        return call(
            AllGatherCast, move_batch(x, in_dims[0], 0), dev, axes, dtype, grad_dtype
        ), 1  # [B, *s] -> [n, B, *s]


class PvaryCast(Prim):
    """Several tensors cast to ``dtype`` and marked varying over ``axes``; their gradients summed in
    ``grad_dtype`` with one collective.

    - forward: ``ys = [x.to(dtype) for x in xs]`` (no communication).
    - backward: the cotangents cast to ``grad_dtype``, flattened into one buffer, all-reduced once, split and
      cast back to each input's dtype.
    - jvp: ``PvaryCast`` of the tangents present (outputs whose input has none get none).
    - vmap: ``PvaryCast`` of the operands as they come, each batch dim where it was.
    """

    #: vma: the operand is taken as it is (no ``Pvary`` first)
    operand_varies = False

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each result varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(  # type: ignore[override]
        dev: Any, axes: tuple[str, ...], dtype: torch.dtype, grad_dtype: torch.dtype, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tuple(x.view_as(x) if x.dtype == dtype else x.to(dtype) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dev, ctx.axes, ctx.dtype, ctx.grad_dtype = inputs[:4]
        ctx.shapes = [x.shape for x in inputs[4:]]
        ctx.in_dtypes = [x.dtype for x in inputs[4:]]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        flat = torch.cat([_cast(g, ctx.grad_dtype).reshape(-1) for g in gs])  # k x [*s_i] -> [sum |s_i|]
        total = call(AllReduce, flat, ctx.dev, ctx.axes, "sum", "psum")  # [sum |s_i|] -> [sum |s_i|]
        parts = total.split([s.numel() for s in ctx.shapes])
        grads = (_cast(p.view(s), d) for p, s, d in zip(parts, ctx.shapes, ctx.in_dtypes, strict=True))
        return (None, None, None, None, *grads)

    @staticmethod
    def jvp(
        ctx: Any, _dev: None, _axes: None, _dt: None, _gdt: None, *ts: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        have = [i for i, t in enumerate(ts) if t is not None]
        out: list[torch.Tensor | None] = [None] * len(ts)
        if have:
            ys = call(PvaryCast, ctx.dev, ctx.axes, ctx.dtype, ctx.grad_dtype, *(ts[i] for i in have))
            for i, y in zip(have, ys, strict=True):
                out[i] = y
        return tuple(out)

    @staticmethod
    def vmap(
        info: VmapInfo,
        in_dims: Dims,
        dev: Any,
        axes: tuple[str, ...],
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        *xs: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], Dims]:
        return call(PvaryCast, dev, axes, dtype, grad_dtype, *xs), tuple(in_dims[4:])  # k x [*s_i] -> same
