"""The torch path of :func:`funcshard.ops.attention`: SDPA, or the softmax written out (with the log-sum-exp,
or under transforms SDPA has no derivative for). Kept apart from ``local.py`` so that the Triton kernels'
module (which falls back to it) and the ring (which calls it under transforms) do not import the dispatcher;
with :func:`needs_autograd_ring`, which both ask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...extend import ShardingError, has_tangent, one_op, transforms_active

__all__ = ["attention_torch", "needs_autograd_ring", "sdpa_has_no_rule"]


def needs_autograd_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a transform the :class:`RingAttention` Function has no rule for is active (``vmap``, ``jvp``,
    functionalize, a forward-mode dual input): then the ring is differentiated by autograd instead.

    Example:
        >>> needs_autograd_ring(*(torch.zeros(1),) * 3)
        False
    """
    if transforms_active():
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        if not all(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters()):
            return True
    return has_tangent((q, k, v))


def sdpa_has_no_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a transform is active that SDPA's fused kernels have no derivative for: forward-mode AD
    (``torch.func.jvp``, ``jacfwd``, ``hessian``, a dual input) or a gradient of a gradient (nested
    ``torch.func.grad`` / ``vjp``). The explicit softmax is differentiable to any order."""
    if transforms_active():
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        kinds = [i.key() for i in retrieve_all_functorch_interpreters()]
        if TransformType.Jvp in kinds or kinds.count(TransformType.Grad) > 1:
            return True
    return has_tangent((q, k, v))


@one_op  # inside shard_map(check_vma=True): one dispatch through the vma mode, not ~10 shape reads and ~3 ops
def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    return_lse: bool = False,
    scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`funcshard.ops.attention` by torch's ops (same arguments, results and errors): SDPA, except with
    ``return_lse`` or under forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``) or nested
    ``torch.func.grad``, which SDPA's fused kernels have no derivative for: there the softmax is written out
    (float32 at least), differentiable to any order.

    Example:
        >>> import torch
        >>> q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)  # 4 query heads share 2 kv heads
        >>> out, lse = attention_torch(q, kv, kv, causal=True, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 8, 16]), torch.Size([1, 4, 8]))
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShardingError(
            f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need 4-d "
            f"[batch, heads, seq, head_dim] tensors (move the heads to dim 1: x.transpose(1, 2))."
        )
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv or k.shape != v.shape or k.shape[0] != b or k.shape[-1] != d:
        raise ShardingError(
            f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: need "
            f"[b, hq, s, d] and [b, hkv, s, d] with hq divisible by hkv."
        )
    if causal and k.shape[2] != sq:
        raise ShardingError(f"attention(causal=True): q has {sq} positions but k has {k.shape[2]}; they must match.")
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, dim=1)  # [b, hkv, s, d] -> [b, hq, s, d]
        v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not return_lse and not sdpa_has_no_rule(q, k, v):
        if q.is_meta:  # an abstract run: the fused kernel's memory and FLOPs (meta's SDPA is the unfused math)
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 at least (float64 stays float64)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale  # [b, h, sq, d] @ [b, h, d, sk] -> [b, h, sq, sk]
    if causal:
        mask = torch.ones(sq, sq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, sq]
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(acc)  # [b, h, sq, sk] @ [b, h, sk, d] -> [b, h, sq, d]
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)
