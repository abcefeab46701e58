"""The dropless token-choice MoE layer (Mixtral's sparse MoE block), local or expert-parallel over a mesh axis.

``moe_ffn(x, params, k, axis=...)``: route each token to its top-k experts (:func:`funcshard.ops.moe.route`),
sort the ``T * k`` assignments by expert (stable: token order within an expert), run every expert's SwiGLU on its
rows with one grouped matmul per projection (:func:`funcshard.ops.moe.grouped.grouped_swiglu`: the three and the
gating in one autograd Function), and add each output row times its routing weight into its token's row (one
``index_add``).

With ``axis`` (expert parallelism, inside ``shard_map``): device ``r`` of ``axis`` holds experts
``[r * E_local, (r + 1) * E_local)`` and its own tokens. The sorted rows are grouped by the device of their expert,
so one ``all_to_all`` of the ``[ep, E_local]`` per-expert counts and one ``ragged_all_to_all`` of the rows send
each row to its expert's device (the dispatch); the rows that arrive (by source device, then local expert) are
regrouped by local expert, go through the grouped experts, are put back in arrival order and return by the reverse
``ragged_all_to_all`` (the combine). Their backward is the reverse exchange, so the gradients are those of the
single-device layer over all devices' tokens.

Gradients over the mesh: the router is taken to be replicated over ``axis`` (and ``tp``) and made varying over
them inside (``pvary``: its gradient, a sum over this device's tokens, is summed over the devices), under
``check_vma=True`` and ``False`` alike; the expert weights are this device's own (no sum over ``axis``). Data axes
other than ``axis`` are the caller's, as for any replicated parameter (``fs.pvary`` under ``check_vma=False``).

Example:
    >>> import torch
    >>> E, d, f = 4, 8, 16
    >>> params = {"router": torch.randn(E, d), "w1": torch.randn(E, f, d), "w3": torch.randn(E, f, d),
    ...           "w2": torch.randn(E, d, f)}
    >>> x = torch.randn(2, 5, d)
    >>> y, aux = moe_ffn(x, params, 2, axis=None, return_router=True)
    >>> y.shape, aux.router_logits.shape, aux.expert_ids.shape, int(aux.dropped)
    (torch.Size([2, 5, 8]), torch.Size([10, 4]), torch.Size([10, 2]), 0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ... import lax
from ...extend import ConfigError, ShardingError, one_op, psum_owned
from .grouped import grouped_swiglu, swiglu_combine
from .routing import check_router, route

__all__ = ["MoEAux", "moe_ffn"]

PARAM_KEYS = ("router", "w1", "w3", "w2")


class MoEAux(NamedTuple):
    """What :func:`moe_ffn` returns beside its output with ``return_router=True``: this device's router outputs, for
    the load-balancing loss (:func:`funcshard.ops.moe.router_stats`) and for monitoring."""

    router_logits: torch.Tensor
    """``[T, E]`` router logits of this device's tokens (``x``'s dtype; differentiable)."""
    expert_ids: torch.Tensor
    """``[T, k]`` int64 chosen experts (global ids)."""
    dropped: torch.Tensor
    """``[]`` int64: this device's ``(token, expert)`` assignments dropped by ``capacity_factor`` (0 without one)."""


def moe_ffn(
    x: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    k: int,
    *,
    axis: str | None = "ep",
    tp: str | None = None,
    norm_topk: bool = True,
    capacity_factor: float | None = None,
    return_router: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, MoEAux]:
    """The token-choice top-k MoE layer with SwiGLU experts: ``sum_j w_j * w2[e_j] (silu(w1[e_j] x) * w3[e_j] x)``.

    Equal to Hugging Face's ``MixtralSparseMoeBlock`` (``gate.weight = router``, ``experts.gate_up_proj =
    cat(w1, w3, dim=1)``, ``experts.down_proj = w2``) and, with ``norm_topk`` as its ``norm_topk_prob``,
    ``Qwen3MoeSparseMoeBlock``. Dropless unless ``capacity_factor`` is set.

    Args:
        x: ``[..., d]`` this device's tokens.
        params: ``"router"`` ``[E, d]`` (replicated), ``"w1"`` (gate) and ``"w3"`` (up) ``[E_local, f, d]``,
            ``"w2"`` (down) ``[E_local, d, f]``: ``F.linear`` layout per expert; ``E_local = E / ep``, the experts
            ``[r * E_local, (r + 1) * E_local)`` of device ``r`` of ``axis`` (``P(axis)`` on the expert dim), all
            ``E`` with ``axis=None``. With ``tp``: ``f / tp`` of each expert's hidden features.
        k: experts per token.
        axis: the expert-parallel mesh axis (tokens differ per device: it carries data too); ``None``: every
            expert is local, plain local math.
        tp: a mesh axis the experts' hidden dim is split over (``w1`` / ``w3`` ``P(axis, "tp")``, ``w2``
            ``P(axis, None, "tp")``; ``x`` replicated over it): each device computes its part, summed by a ``psum``
            over ``tp`` (Megatron's column- then row-parallel pair). ``None``: not split.
        norm_topk: renormalise the k routing weights (Mixtral: always; Qwen3-MoE: ``norm_topk_prob``).
        capacity_factor: None (dropless), or each expert takes at most ``ceil(capacity_factor * T * k / E)`` of this
            device's assignments (``T`` its tokens), the first in token order; the others are dropped (they
            contribute 0) and counted in :attr:`MoEAux.dropped`.
        return_router: also return :class:`MoEAux` (router logits, expert ids, dropped count).
        impl: the grouped matmul's implementation (:func:`funcshard.ops.moe.grouped_mm`).

    Returns:
        ``[..., d]`` in ``x``'s dtype (invariant over ``tp``), or ``(y, MoEAux)`` with ``return_router``.

    Raises:
        ShardingError: params that do not fit (missing keys, shapes, ``E`` not divisible by the size of ``axis``,
            ``E_local`` not ``E / ep``).
        ConfigError: ``k`` outside ``[1, E]``, a capacity factor that is not positive.

    Example:
        >>> # inside shard_map over {"ep": 4}: params P("ep") on the expert dim, router P(), tokens P("ep")
        >>> # y = moe_ffn(x, params, 2, axis="ep")  # [b/ep, s, d] -> [b/ep, s, d]
        >>> import torch
        >>> p = {"router": torch.randn(4, 8), "w1": torch.randn(4, 16, 8), "w3": torch.randn(4, 16, 8),
        ...      "w2": torch.randn(4, 8, 16)}
        >>> moe_ffn(torch.randn(3, 8), p, 2, axis=None).shape
        torch.Size([3, 8])
    """
    n_experts = _check(x, params, k, axis, tp, capacity_factor)
    h = x.reshape(-1, x.shape[-1])  # [..., d] -> [T, d]
    router = params["router"]
    axes = tuple(a for a in (axis, tp) if a is not None)
    if tp is not None:
        h = lax.pvary(h, tp)  # identity forward, psum backward over tp (x is replicated over it)
    if axes:
        router = lax.pvary(router, axes)  # [E, d]: its gradient is summed over the devices' tokens
    weights, ids, logits = route(h, router, k, norm_topk=norm_topk)  # [T, k] f32, [T, k], [T, E]
    cap = None if capacity_factor is None else math.ceil(capacity_factor * h.shape[0] * k / n_experts)
    order, counts, dropped = _sort_assignments(ids, n_experts, cap)  # [T*k or fewer], [E], []
    ws = (params["w1"], params["w3"], params["w2"])
    if axis is None:  # gather, experts and combine block by block (grouped.swiglu_combine)
        row_weights = weights.reshape(-1).index_select(0, order)  # [T*k] -> [A], each sorted row's weight
        y = swiglu_combine(h, order // k, row_weights, *ws, counts, impl=impl).to(x.dtype)  # [T, d] -> [T, d]
    else:
        rows = h.index_select(0, order // k)  # [T, d] -> [A, d], sorted by expert
        out = _dispatch_experts_combine(rows, counts, ws, axis, impl)  # [A, d] -> [A, d]
        y = _combine(out, order, weights, x.dtype)  # [A, d] -> [T, d]
    if tp is not None:
        y = psum_owned(y, tp)  # [T, d] -> [T, d]: the sum of the tp devices' partial outputs
    y = y.reshape(x.shape)
    return (y, MoEAux(logits, ids, dropped)) if return_router else y


def _dispatch_experts_combine(
    rows: torch.Tensor, counts: torch.Tensor, ws: tuple[torch.Tensor, ...], axis: str, impl: str
) -> torch.Tensor:
    """The experts' outputs ``[A, d]`` for ``rows`` (sorted by global expert, ``counts [E]``), the experts spread
    over ``axis``: dispatch, local grouped experts, combine."""
    n = lax.axis_size(axis)
    e_local = ws[0].shape[0]
    send_counts = counts.view(n, e_local)  # [E] -> [ep, E_local]: row j for device j's experts
    recv_counts = lax.all_to_all(send_counts, axis, 0, 0)  # [ep, E_local] -> [ep, E_local]: row i from device i
    send_sizes, recv_sizes = send_counts.sum(1), recv_counts.sum(1)  # [ep], [ep]
    got = lax.ragged_all_to_all(rows, send_sizes, recv_sizes, axis)  # [A, d] -> [R, d], by source, then expert
    perm, local_counts = _regroup(recv_counts, got.shape[0])  # [R], [E_local]
    out = _experts(got.index_select(0, perm), *ws, local_counts, impl)  # [R, d] -> [R, d], by local expert
    out = out.new_zeros(out.shape).index_copy(0, perm, out)  # [R, d]: back in arrival order
    return lax.ragged_all_to_all(out, recv_sizes, send_sizes, axis)  # [R, d] -> [A, d]


@one_op  # one op for check_vma's tracking (integer bookkeeping), not its ~10
def _sort_assignments(
    ids: torch.Tensor, n_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, counts, dropped)``: the flat assignment indices (``token * k + slot``) sorted by expert, stable,
    those over ``capacity`` per expert left out; the rows per expert ``[E]``; the number left out ``[]``."""
    flat = ids.reshape(-1)  # [T, k] -> [T*k]
    sorted_ids, order = torch.sort(flat, stable=True)  # [T*k]
    counts = flat.new_zeros(n_experts).index_add(0, flat, torch.ones_like(flat))  # [T*k] -> [E] (meta too)
    if capacity is None or ids.is_meta:  # (meta: eval_shape, an abstract mesh: dropless shapes, the upper bound)
        return order, counts, torch.zeros((), dtype=torch.int64, device=ids.device)
    starts = counts.cumsum(0) - counts  # [E]: each expert's first sorted position
    keep = torch.arange(flat.shape[0], device=ids.device) - starts[sorted_ids] < capacity  # [T*k]
    return order[keep], counts.clamp(max=capacity), (~keep).sum()


@one_op  # (integer bookkeeping)
def _regroup(recv_counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, counts)``: the order that groups the ``rows`` received by source device, then local expert
    (``recv_counts [ep, E_local]`` of them), by local expert (stable: by source within one), and its ``[E_local]``
    counts."""
    n, e_local = recv_counts.shape
    if recv_counts.is_meta:  # unknown counts (an abstract mesh): the shapes alone
        return torch.arange(rows, device=recv_counts.device), recv_counts.sum(0)
    local_ids = torch.arange(e_local, device=recv_counts.device).repeat(n)  # [ep * E_local]
    row_ids = torch.repeat_interleave(local_ids, recv_counts.reshape(-1))  # [R]: each row's local expert
    return torch.argsort(row_ids, stable=True), recv_counts.sum(0)


def _experts(
    rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, impl: str
) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert (``counts`` per expert): one grouped matmul per projection, the
    three and the gating in one autograd Function (:func:`funcshard.ops.moe.grouped.grouped_swiglu`)."""
    return grouped_swiglu(rows, w1, w3, w2, counts, impl=impl)  # [R, d] -> [R, f] -> [R, d]


def _combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, d]``: each token's k expert outputs (``out``, in ``order``; dropped ones 0) times their weights, summed
    in float32 (Mixtral multiplies in float32) and returned in ``dtype``: the weighted rows added into their tokens'
    rows by one ``index_add`` (as Hugging Face's loop does per expert), no ``[T * k, d]`` unsorted copy."""
    t, k = weights.shape
    w = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T*k] -> [A, 1], the weight of each sorted row
    acc = torch.promote_types(out.dtype, weights.dtype)
    y = out.new_zeros(t, out.shape[1], dtype=acc).index_add(0, order // k, out * w)  # [A, d] -> [T, d]
    return y.to(dtype)


def _check(
    x: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    k: int,
    axis: str | None,
    tp: str | None,
    capacity_factor: float | None,
) -> int:
    """The number of experts ``E``; ShardingError / ConfigError for params, ``k`` or a capacity that do not fit."""
    missing = [key for key in PARAM_KEYS if key not in params]
    if missing:
        raise ShardingError(
            f"moe_ffn: params lack {missing}; they need {list(PARAM_KEYS)}: router [E, d], w1 / w3 [E_local, f, d], "
            f"w2 [E_local, d, f]."
        )
    router, w1, w3, w2 = (params[key] for key in PARAM_KEYS)
    check_router(x, router, k, "moe_ffn")
    n_experts, d = router.shape
    n = 1 if axis is None else lax.axis_size(axis)
    shapes = f"router {tuple(router.shape)}, w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}"
    if n_experts % n:
        raise ShardingError(
            f"moe_ffn: {n_experts} experts (router {tuple(router.shape)}) are not divisible by the size {n} of axis "
            f"{axis!r}; use a number of experts divisible by it, or a smaller {axis!r} axis."
        )
    e_local = n_experts // n
    ok = w1.dim() == w3.dim() == w2.dim() == 3 and w1.shape == w3.shape
    if not ok or w1.shape[0] != e_local or w1.shape[2] != d or tuple(w2.shape) != (e_local, d, w1.shape[1]):
        where = "all E experts (axis=None)" if axis is None else f"E / {n} = {e_local} experts (P({axis!r}) on dim 0)"
        raise ShardingError(
            f"moe_ffn: {shapes} for tokens of width {d}: need w1 / w3 [E_local, f, d] and w2 [E_local, d, f] "
            f"(F.linear layout per expert) holding {where}"
            + (f", with f split over {tp!r}" if tp is not None else "")
            + "; check the in_specs of the expert weights."
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(f"moe_ffn: capacity_factor is {capacity_factor!r}; give a positive number, or None.")
    return n_experts
