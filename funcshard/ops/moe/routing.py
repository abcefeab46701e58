"""Token-choice top-k routing and the Switch / Mixtral load-balancing loss.

- :func:`route`: router logits ``x @ router^T``, softmax in float32, top-k, renormalised over the k (Mixtral;
  Qwen3-MoE's ``norm_topk_prob``).
- :func:`load_balancing_loss`: Hugging Face's ``load_balancing_loss_func`` (Switch Transformer eq. 4-6) over one
  layer or several pooled; :func:`router_stats` and :func:`balancing_loss_from_stats` split it into additive
  statistics (per-expert assignment counts, per-expert probability sums, the row count) and the loss formed from
  them, so a sharded model sums the statistics over its layers and ``psum``\\ s them over its data axes (the whole
  global batch, as Hugging Face pools it) before forming the loss.

The equivalence with Hugging Face (transformers 5.x,
``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``), for layers ``l`` with logits
``z_l [T_l, E]``, expert ids ``i_l [T_l, k]`` and probabilities ``p_l = softmax(z_l)``::

    counts[e]    = sum_l #{(t, j): i_l[t, j] = e}          (top-k assignments; each row gives k)
    prob_sums[e] = sum_l sum_t p_l[t, e]
    n_rows       = sum_l T_l
    loss         = E * sum_e (counts[e] / n_rows) * (prob_sums[e] / n_rows)

which is ``tokens_per_expert_sum / total_rows`` times ``router_prob_sum / total_rows``, summed, times E, exactly
Hugging Face's pooled form; with a mask, each row is weighted by it (``attention_mask``'s rows). Two differences,
both nil for float32 logits: the probabilities here are computed in float32 (Hugging Face's softmax keeps the
logits' dtype), and the counts come from the expert ids :func:`route` chose (Hugging Face takes the top-k of its
softmax again).

Example:
    >>> import torch
    >>> x, router = torch.randn(6, 8), torch.randn(4, 8)
    >>> weights, ids, logits = route(x, router, 2)
    >>> loss = load_balancing_loss(logits, ids, 4)
    >>> stats = router_stats(logits, ids, 4)
    >>> torch.allclose(loss, balancing_loss_from_stats(*stats, 4))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...extend import ConfigError, ShardingError

__all__ = ["RouterStats", "balancing_loss_from_stats", "load_balancing_loss", "route", "router_stats"]


def route(
    x: torch.Tensor, router_w: torch.Tensor, k: int, *, norm_topk: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k token-choice routing, as Hugging Face's Mixtral / Qwen3-MoE routers.

    ``logits = x @ router_w^T`` in ``x``'s dtype; ``probs = softmax(logits)`` in float32; the ``k`` largest
    probabilities per row (``torch.topk``: ties to the lower expert id) and their experts; with ``norm_topk`` the
    k weights are divided by their sum (Mixtral always; Qwen3-MoE where ``norm_topk_prob``).

    The weights stay float32, as Mixtral's router returns them (Mixtral multiplies the experts' outputs by them in
    float32 and rounds the product to ``x``'s dtype); Qwen3-MoE rounds them to ``x``'s dtype first. For float32
    ``x`` both are these values.

    Args:
        x: ``[..., d]`` tokens (flattened to ``[T, d]``).
        router_w: ``[E, d]`` router weight (``F.linear`` layout: Hugging Face's ``gate.weight``).
        k: experts per token, ``1 <= k <= E``.
        norm_topk: renormalise the k weights to sum to 1.

    Returns:
        ``(weights [T, k] float32, expert_ids [T, k] int64, router_logits [T, E] in x's dtype)``.

    Raises:
        ShardingError: ``router_w`` not ``[E, d]`` for ``x``'s ``d``.
        ConfigError: ``k`` outside ``[1, E]``.

    Example:
        >>> import torch
        >>> x, router = torch.randn(3, 8), torch.randn(4, 8)
        >>> weights, ids, logits = route(x, router, 2)
        >>> weights.shape, ids.shape, logits.shape, torch.allclose(weights.sum(-1), torch.ones(3))
        (torch.Size([3, 2]), torch.Size([3, 2]), torch.Size([3, 4]), True)
    """
    check_router(x, router_w, k, "route")
    h = x.reshape(-1, x.shape[-1])  # [..., d] -> [T, d]
    logits = F.linear(h, router_w)  # [T, d] @ [d, E] -> [T, E]
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E] float32
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, E] -> [T, k], [T, k]
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids, logits


def check_router(x: torch.Tensor, router_w: torch.Tensor, k: int, fn: str) -> None:
    """ShardingError / ConfigError for a router weight that does not fit ``x``, or a ``k`` outside ``[1, E]``.

    Example:
        >>> import torch
        >>> check_router(torch.zeros(2, 8), torch.zeros(4, 8), 2, "route")  # fits: nothing raised
    """
    if router_w.dim() != 2 or x.dim() < 1 or router_w.shape[1] != x.shape[-1]:
        raise ShardingError(
            f"{fn}: the router weight has shape {tuple(router_w.shape)} for tokens of shape {tuple(x.shape)}; it "
            f"must be [n_experts, d] with d = {x.shape[-1] if x.dim() else '?'} (F.linear layout, Hugging Face's "
            f"gate.weight), replicated."
        )
    n = router_w.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ConfigError(f"{fn}: k (experts per token) is {k!r}; it must be an int in [1, {n}] ({n} experts).")


class RouterStats(NamedTuple):
    """Additive router statistics of one or more layers (a pytree: sum them with ``optree.tree_map``, ``psum`` them
    over the data axes), from :func:`router_stats`; :func:`balancing_loss_from_stats` forms the loss."""

    counts: torch.Tensor
    """``[E]`` float32: top-k assignments per expert (no gradient)."""
    prob_sums: torch.Tensor
    """``[E]`` float32: router probabilities summed over the rows (differentiable in the logits)."""
    n_rows: torch.Tensor
    """``[]`` float32: the rows (tokens) counted (their mask's sum, with a mask)."""


def router_stats(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    expert_ids: torch.Tensor | Sequence[torch.Tensor],
    n_experts: int,
    *,
    mask: torch.Tensor | None = None,
) -> RouterStats:
    """The additive statistics of the load-balancing loss (see the module for the formulas).

    Args:
        router_logits: ``[T, E]`` (or ``[..., E]``) logits of one layer, or a sequence of them (layers).
        expert_ids: the matching ``[T, k]`` (or ``[..., k]``) expert ids from :func:`route`, or a sequence.
        n_experts: ``E``.
        mask: optional ``[T]`` (or ``[...]``) weights of the rows, 1 for a real token and 0 for padding
            (Hugging Face's flattened ``attention_mask``), the same for every layer.

    Returns:
        :class:`RouterStats` ``(counts [E], prob_sums [E], n_rows [])``, float32.

    Example:
        >>> import torch
        >>> logits, ids = torch.zeros(3, 4), torch.tensor([[0, 1], [0, 2], [0, 3]])
        >>> stats = router_stats(logits, ids, 4)
        >>> stats.counts, stats.prob_sums, stats.n_rows
        (tensor([3., 1., 1., 1.]), tensor([0.7500, 0.7500, 0.7500, 0.7500]), tensor(3.))
    """
    logits_l, ids_l = _layers(router_logits, expert_ids, n_experts)
    dev = logits_l[0].device
    counts = torch.zeros(n_experts, dtype=torch.float32, device=dev)
    prob_sums = torch.zeros(n_experts, dtype=torch.float32, device=dev)
    n_rows = torch.zeros((), dtype=torch.float32, device=dev)
    m = None if mask is None else mask.reshape(-1).to(device=dev, dtype=torch.float32)  # [T]
    for z, ids in zip(logits_l, ids_l, strict=True):
        probs = torch.softmax(z.reshape(-1, n_experts).float(), dim=-1)  # [T, E]
        k = ids.numel() // probs.shape[0] if probs.shape[0] else ids.shape[-1]  # (no rows: a device's empty batch)
        flat = ids.reshape(probs.shape[0], k)  # [T, k]
        if m is None:
            hits = torch.ones(flat.shape, dtype=torch.float32, device=dev)
            n_rows = n_rows + probs.shape[0]
        else:
            hits = m.unsqueeze(1).expand(flat.shape)  # [T, k]
            probs = probs * m.unsqueeze(1)
            n_rows = n_rows + m.sum()
        counts = counts.index_add(0, flat.reshape(-1), hits.reshape(-1))  # [T * k] -> [E]
        prob_sums = prob_sums + probs.sum(0)  # [T, E] -> [E]
    return RouterStats(counts, prob_sums, n_rows)


def balancing_loss_from_stats(
    counts: torch.Tensor, prob_sums: torch.Tensor, n_rows: torch.Tensor | float, n_experts: int
) -> torch.Tensor:
    """``E * sum_e (counts[e] / n_rows) * (prob_sums[e] / n_rows)``: the load-balancing loss of pooled statistics.

    Args:
        counts: ``[E]`` top-k assignments per expert (summed over layers and devices).
        prob_sums: ``[E]`` router probabilities summed over rows (likewise).
        n_rows: the rows counted (likewise).
        n_experts: ``E``.

    Returns:
        ``[]`` float32.

    Example:
        >>> import torch
        >>> # perfectly balanced, k = 1: each of 4 experts gets a quarter of the tokens and of the probability
        >>> balancing_loss_from_stats(torch.full((4,), 2.0), torch.full((4,), 2.0), 8.0, 4)
        tensor(1.)
    """
    return (counts / n_rows * (prob_sums / n_rows)).sum() * n_experts  # [E] -> []


def load_balancing_loss(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    expert_ids: torch.Tensor | Sequence[torch.Tensor],
    n_experts: int,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch / Mixtral load-balancing loss, Hugging Face's ``load_balancing_loss_func`` (see the module):
    the layers given as sequences are pooled (their rows counted together), not averaged.

    Args:
        router_logits: ``[T, E]`` logits of one layer, or a sequence of them.
        expert_ids: the matching ``[T, k]`` expert ids, or a sequence.
        n_experts: ``E``.
        mask: optional ``[T]`` row weights (padding 0), as Hugging Face's ``attention_mask``.

    Returns:
        ``[]`` float32; 1.0 for a perfectly balanced top-1 router, ``k`` for top-k.

    Example:
        >>> import torch
        >>> logits = [torch.randn(5, 4) for _ in range(3)]  # three layers
        >>> ids = [torch.topk(z, 2).indices for z in logits]
        >>> load_balancing_loss(logits, ids, 4).shape
        torch.Size([])
    """
    return balancing_loss_from_stats(*router_stats(router_logits, expert_ids, n_experts, mask=mask), n_experts)


def _layers(
    router_logits: torch.Tensor | Sequence[torch.Tensor], expert_ids: torch.Tensor | Sequence[torch.Tensor], e: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    logits_l = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    ids_l = [expert_ids] if isinstance(expert_ids, torch.Tensor) else list(expert_ids)
    if not logits_l or len(logits_l) != len(ids_l):
        raise ShardingError(
            f"router_stats: {len(logits_l)} router logits and {len(ids_l)} expert ids given; give one of each per "
            f"layer (and at least one)."
        )
    for i, (z, ids) in enumerate(zip(logits_l, ids_l, strict=True)):
        rows = z.numel() // e if z.dim() and z.shape[-1] == e else -1
        if rows < 0 or ids.dim() < 1 or ids.numel() % max(rows, 1) or (rows == 0) != (ids.numel() == 0):
            raise ShardingError(
                f"router_stats: layer {i}: router logits of shape {tuple(z.shape)} and expert ids of shape "
                f"{tuple(ids.shape)} do not fit {e} experts: need logits [T, {e}] and ids [T, k]."
            )
    return logits_l, ids_l
