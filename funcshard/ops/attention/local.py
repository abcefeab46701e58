"""Local (single-device) attention, ``[batch, heads, seq, head_dim]``, with the log-sum-exp that
context-parallel attention needs to merge partial results.

Example:
    >>> import torch
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> out, lse = attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4]))
"""

from __future__ import annotations

from types import ModuleType

import torch

from ...extend import one_op
from ._torch_kernel import attention_torch, sdpa_has_no_rule

__all__ = ["FLASH_DEVICES", "attention", "flash_kernels"]

#: devices on which ``attention(return_lse=True)`` (blocks merged by their lse) and ``ring_attention`` run the
#: Triton kernels of ``funcshard.ops.triton`` where they take the inputs; SDPA's own fused CUDA kernels serve
#: the calls without the log-sum-exp (they are the faster there), the written-out softmax every other device.
FLASH_DEVICES = ("cuda",)


@one_op  # inside shard_map(check_vma=True): one dispatch through the vma mode, not ~10 shape reads and ~3 ops
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    return_lse: bool = False,
    scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention on one device. ``k`` / ``v`` may have fewer heads than ``q`` (grouped-query
    attention: each kv head serves ``q_heads / kv_heads`` query heads).

    ``F.scaled_dot_product_attention`` computes it, except with ``return_lse`` or under forward-mode AD
    (``torch.func.jvp``, ``jacfwd``, ``hessian``) or nested ``torch.func.grad``, which SDPA's fused kernels
    have no derivative for: there the softmax is written out (float32 at least), differentiable to any order.
    With ``return_lse`` on CUDA (:data:`FLASH_DEVICES`) the Triton kernels of
    :mod:`funcshard.ops.triton` compute it where they take the inputs (Triton installed, float16 / bfloat16 /
    float32, ``head_dim <= 256``, no forward-mode AD, batching or grad of grad).

    Args:
        q: ``[b, hq, sq, d]``.
        k: ``[b, hkv, sk, d]``.
        v: ``[b, hkv, sk, d]``.
        causal: mask the keys after each query (needs as many keys as queries).
        return_lse: also return the log-sum-exp of the scores, ``[b, hq, sq]`` (float32; float64 for float64
            inputs, whose precision the softmax then keeps, as ``F.scaled_dot_product_attention``'s).
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``[b, hq, sq, d]`` (and the log-sum-exp).

    Raises:
        ShardingError: heads or shapes that do not fit.

    Example:
        >>> import torch
        >>> q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)  # 4 query heads share 2 kv heads
        >>> attention(q, kv, kv, causal=True).shape
        torch.Size([1, 4, 8, 16])
    """
    if return_lse and (flash := flash_kernels(q, k, v)) is not None:  # GQA in the kernel: no repeated k / v
        return flash.flash_attention(q, k, v, causal=causal, return_lse=True, scale=scale)
    return attention_torch(q, k, v, causal=causal, return_lse=return_lse, scale=scale)


def flash_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> ModuleType | None:
    """The module :mod:`funcshard.ops.triton` where its kernels compute attention of these inputs here (on
    :data:`FLASH_DEVICES`, inputs the kernels take, no transform they have no rule for), else None.

    Example:
        >>> import torch
        >>> flash_kernels(*(torch.zeros(1, 2, 4, 8),) * 3) is None  # CPU is not among FLASH_DEVICES
        True
    """
    if q.device.type in FLASH_DEVICES and not sdpa_has_no_rule(q, k, v):
        from . import triton as flash  # (imported here: the kernels' module imports the torch path)

        if flash.kernels_take(q, k, v):
            return flash
    return None
