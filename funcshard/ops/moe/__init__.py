"""Mixture of experts: top-k routing, grouped expert matmuls, the MoE layer (local or expert-parallel over a mesh
axis) and the load-balancing loss.

- :func:`route` ``(x, router_w, k, *, norm_topk=True) -> (weights [T, k] f32, expert_ids [T, k], router_logits
  [T, E])``: Mixtral's / Qwen3-MoE's router.
- :func:`moe_ffn` ``(x, params, k, *, axis="ep", tp=None, norm_topk=True, capacity_factor=None,
  return_router=False, impl="auto")``: the dropless token-choice layer with SwiGLU experts; ``params`` holds
  ``router [E, d]``, ``w1`` / ``w3`` ``[E_local, f, d]`` and ``w2 [E_local, d, f]``; with ``axis`` the experts
  are sharded over it and the tokens travel by ``fs.lax.ragged_all_to_all``; ``return_router=True`` also returns
  :class:`MoEAux` ``(router_logits, expert_ids, dropped)``.
- :func:`load_balancing_loss` ``(router_logits, expert_ids, n_experts)``: Hugging Face's
  ``load_balancing_loss_func``; :func:`router_stats` -> :class:`RouterStats` ``(counts, prob_sums, n_rows)`` and
  :func:`balancing_loss_from_stats` for a loss pooled over layers and devices (sum the stats, ``psum`` them over the
  data axes, then form the loss).
- :func:`grouped_mm` ``(x_sorted, w, counts, *, impl="auto")``: ``torch._grouped_mm``, a Triton grouped GEMM
  (CUDA; CPU under ``TRITON_INTERPRET=1``) or one matmul per expert.

Example:
    >>> import torch
    >>> from funcshard.ops import moe
    >>> E, d, f = 4, 8, 16
    >>> params = {"router": torch.randn(E, d), "w1": torch.randn(E, f, d), "w3": torch.randn(E, f, d),
    ...           "w2": torch.randn(E, d, f)}
    >>> x = torch.randn(6, d)
    >>> y, aux = moe.moe_ffn(x, params, 2, axis=None, return_router=True)
    >>> aux_loss = moe.load_balancing_loss(aux.router_logits, aux.expert_ids, E)
    >>> y.shape, aux_loss.shape
    (torch.Size([6, 8]), torch.Size([]))
"""

from .grouped import IMPLS as IMPLS
from .grouped import grouped_mm as grouped_mm
from .grouped import pick_impl as pick_impl
from .layer import MoEAux as MoEAux
from .layer import moe_ffn as moe_ffn
from .routing import RouterStats as RouterStats
from .routing import balancing_loss_from_stats as balancing_loss_from_stats
from .routing import load_balancing_loss as load_balancing_loss
from .routing import route as route
from .routing import router_stats as router_stats

__all__ = [
    "IMPLS",
    "MoEAux",
    "RouterStats",
    "balancing_loss_from_stats",
    "grouped_mm",
    "load_balancing_loss",
    "moe_ffn",
    "pick_impl",
    "route",
    "router_stats",
]
