"""The local MoE experts with their gather and combine in one autograd Function: each block of whole experts
gathers its rows from the tokens, runs the SwiGLU experts on them and adds its weighted outputs into the tokens'
rows before the next block starts, so no ``[T * k, d]`` tensor of rows or of outputs is ever whole in the forward.

Hugging Face's per-expert loop keeps its temporaries this small (one expert's rows at a time, recycled by the
allocator and warm in cache); a grouped path that gathers every row, then runs every expert, then combines, makes
full ``[T * k, d]`` and ``[T * k, f]`` tensors instead (fresh memory, page faults, cache misses: on CPU at 4096
tokens x top-2, d=512, f=1024 that cost it 10-25% of the forward). Here the blocks are those of
:func:`funcshard.ops.moe.grouped.grouped_swiglu` (about 4 MiB of ``[rows, f]`` on CPU; one block elsewhere).

Example:
    >>> import torch
    >>> x, tokens = torch.randn(3, 16), torch.tensor([0, 2, 1, 2])  # rows sorted by expert: 2 to expert 0, 2 to 1
    >>> row_weights, counts = torch.rand(4), torch.tensor([2, 2])
    >>> w1, w3, w2 = torch.randn(2, 32, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 32)
    >>> y = swiglu_combine(x, tokens, row_weights, w1, w3, w2, counts)
    >>> rows = grouped_swiglu(x[tokens], w1, w3, w2, counts) * row_weights[:, None]
    >>> torch.allclose(y, torch.zeros(3, 16).index_add(0, tokens, rows), rtol=1e-4, atol=1e-4)
    True
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...extend import ShardingError, one_op
from .grouped import (
    Block,
    _block_views,
    _check_swiglu,
    _plain,
    _row_blocks,
    _rows_buffer,
    _swiglu_bwd,
    _swiglu_fwd,
    _wgrad,
    grouped_swiglu,
    pick_impl,
)

__all__ = ["swiglu_combine"]


def swiglu_combine(
    x: torch.Tensor,
    tokens: torch.Tensor,
    row_weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    counts: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """``y[t] = sum over rows r of token t: row_weights[r] * swiglu_{e(r)}(x[t])``, rows sorted by expert.

    Equal to ``zeros.index_add(0, tokens, grouped_swiglu(x[tokens], ...) * row_weights[:, None])`` (the same ops,
    block by block), differentiable in ``x``, ``row_weights`` and the three weights.

    Args:
        x: ``[T, d]`` tokens.
        tokens: ``[A]`` int64, the token of each row; rows sorted by expert (``counts[e]`` rows of expert ``e`` in
            expert order, ``A == counts.sum()``).
        row_weights: ``[A]`` each row's routing weight (float32, as Mixtral's router gives them).
        w1: ``[E, f, d]`` gate projections (``F.linear`` layout per expert), ``x``'s dtype and device.
        w3: ``[E, f, d]`` up projections.
        w2: ``[E, d, f]`` down projections.
        counts: ``[E]`` integer rows per expert.
        impl: as :func:`funcshard.ops.moe.grouped_mm`; ``"segments"`` (or where ``torch._grouped_mm`` does not take
            the shapes) runs the unfused composition.

    Returns:
        ``[T, d]`` in the promoted dtype of ``x`` and ``row_weights`` (float32 for a float32 router).

    Raises:
        ShardingError: shapes that do not fit (as :func:`funcshard.ops.moe.grouped.grouped_swiglu`), or ``tokens``
            / ``row_weights`` not ``[counts.sum()]``.
        ConfigError: an unknown ``impl``, or one that cannot run here.

    Example:
        >>> import torch
        >>> x, tokens, rw = torch.randn(2, 16), torch.tensor([1, 0]), torch.ones(2)
        >>> w = torch.randn(1, 16, 16)
        >>> swiglu_combine(x, tokens, rw, w, w, w, torch.tensor([2])).shape
        torch.Size([2, 16])
    """
    a = tokens.shape[0]
    on_host = counts.device.type == "cpu"  # (elsewhere the count is not read: no host sync)
    if tokens.dim() != 1 or tuple(row_weights.shape) != (a,) or (on_host and int(counts.sum()) != a):
        raise ShardingError(
            f"swiglu_combine: tokens {tuple(tokens.shape)} and row_weights {tuple(row_weights.shape)} for counts "
            f"summing to {int(counts.sum()) if on_host else '?'}: give one token and one weight per row."
        )
    _check_swiglu(x, w1, w3, w2, counts, "swiglu_combine")
    if x.is_meta or pick_impl(x, w1, impl) == "segments":  # (meta: the unfused path's shapes and FLOPs)
        rows = x.index_select(0, tokens)  # [T, d] -> [A, d]
        out = grouped_swiglu(rows, w1, w3, w2, counts, impl=impl) * row_weights.unsqueeze(1)  # [A, d]
        acc = torch.promote_types(x.dtype, row_weights.dtype)
        return x.new_zeros(x.shape[0], x.shape[1], dtype=acc).index_add(0, tokens, out)  # [A, d] -> [T, d]
    impl = pick_impl(x, w1, impl)
    offs = torch.zeros(w1.shape[0] + 1, dtype=torch.int32, device=x.device)
    offs[1:] = counts.cumsum(0)  # [E + 1]: group e owns rows [offs[e], offs[e + 1])
    blocks = _row_blocks(offs, a, w1.shape[1] * x.element_size())
    return _combined(x, row_weights, w1, w3, w2, tokens, offs, impl, blocks)


@one_op  # (one op for the vma tracking, as grouped_swiglu's Function)
def _combined(
    x: torch.Tensor,
    row_weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    tokens: torch.Tensor,
    offs: torch.Tensor,
    impl: str,
    blocks: tuple[Block, ...] | None,
) -> torch.Tensor:
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (x, row_weights, w1, w3, w2))
    return _SwiGLUCombine.apply(x, row_weights, w1, w3, w2, tokens, offs, impl, blocks, keep)[0]  # [T, d]


def _end(blocks: tuple[Block, ...] | None, rows: int) -> int:
    return rows if blocks is None else blocks[-1][2] + blocks[-1][3][-1]


class _SwiGLUCombine(torch.autograd.Function):
    """Gather, SwiGLU experts and weighted combine per block. Returns ``y [T, d]``, then, where ``keep``, ``act``
    ``[A, f]`` (one buffer, for the down projection's weight gradient) and each block's ``gate``, ``up`` and
    expert outputs ``[rows, d]`` (the routing weights' gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor,
        row_weights: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        tokens: torch.Tensor,
        offs: torch.Tensor,
        impl: str,
        blocks: tuple[Block, ...] | None,
        keep: bool,
    ) -> tuple[torch.Tensor, ...]:
        a = tokens.shape[0]
        y = x.new_zeros(x.shape[0], x.shape[1], dtype=torch.promote_types(x.dtype, row_weights.dtype))
        act = _rows_buffer(x, a, w1.shape[1], _end(blocks, a)) if blocks and keep else None
        saved = []
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            for block in blocks or (None,):
                (tb, rwb, ab), ws, b_offs = _block_views((tokens, row_weights, act), (w1, w3, w2), offs, block)
                out, gate, up, act_b = _swiglu_fwd(x.index_select(0, tb), ws, b_offs, impl, ab, keep)  # [t, d]
                y.index_add_(0, tb, out * rwb.unsqueeze(1))  # [t, d] -> [T, d]
                saved += [gate, up, out]
        if not keep:
            return (y,)
        return (y, act_b if act is None else act, *saved)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, row_weights, w1, w3, w2, tokens, offs, impl, blocks, _ = inputs
        ctx.impl, ctx.blocks = impl, blocks
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(x, row_weights, w1, w3, w2, tokens, offs, *output[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        x, row_weights, w1, w3, w2, tokens, offs, act, *saved = (_plain(t) for t in ctx.saved_tensors)
        dy, need, impl, blocks = _plain(dy).contiguous(), ctx.needs_input_grad, ctx.impl, ctx.blocks
        a, end, f = tokens.shape[0], _end(blocks, tokens.shape[0]), w1.shape[1]
        with torch._C._DisableFuncTorch(), torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            rows = x.index_select(0, tokens)  # [T, d] -> [A, d]: the weight gradients' operand, one gather
            dx, d_rw = torch.zeros_like(x), torch.empty_like(row_weights)
            d_rows = _rows_buffer(x, a, x.shape[1], end)  # [A, d]: the experts' output cotangent, x's dtype
            full = tuple(_rows_buffer(x, a, f, end) for _ in range(2)) if blocks else None  # dgate, dup [A, f]
            for i, block in enumerate(blocks or (None,)):
                views = (tokens, row_weights, rows, d_rows, d_rw, *(full or ()))
                (tb, rwb, xb, dyb, d_rwb, *outs), ws, b_offs = _block_views(views, (w1, w3, w2), offs, block)
                g = dy.index_select(0, tb)  # [T, d] -> [t, d]
                d_rwb.copy_((g * saved[3 * i + 2]).sum(1))  # [t]: d y / d row weight = the expert's output row
                dyb.copy_(g * rwb.unsqueeze(1))  # [t, d], rounded to x's dtype
                dxb, dgate, dup = _swiglu_bwd(dyb, (xb, *saved[3 * i : 3 * i + 2]), ws, b_offs, impl, outs or None)
                dx.index_add_(0, tb, dxb)  # [t, d] -> [T, d]
            dgate, dup = full or (dgate, dup)
            dw1 = _wgrad(rows, dgate, offs, impl).to(w1.dtype) if need[2] else None  # [E, f, d]
            dw3 = _wgrad(rows, dup, offs, impl).to(w3.dtype) if need[3] else None  # [E, f, d]
            dw2 = _wgrad(act, d_rows, offs, impl).to(w2.dtype) if need[4] else None  # [E, d, f]
        return dx if need[0] else None, d_rw if need[1] else None, dw1, dw3, dw2, None, None, None, None, None
