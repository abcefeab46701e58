"""Flash attention in Triton (FlashAttention-2, forward and backward), ``[batch, heads, seq, head_dim]``, with
the log-sum-exp that context-parallel attention merges blocks by.

:func:`flash_attention` has the signature and results of :func:`funcshard.ops.attention`. It runs the Triton
kernels on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` (the Triton interpreter, slow, for
tests); elsewhere (CPU, or Triton not installed: ``pip install 'funcshard[triton]'``) it is
:func:`funcshard.ops.attention`, the torch path, with the same results. Importing this module never imports
Triton; the kernels are compiled (or, interpreted, decorated) at the first call. Triton reads part of
``TRITON_INTERPRET`` when it is first imported (``torch._dynamo`` imports it too): set the variable before that.

- forward: tiled online softmax in float32 accumulators; saves only ``out`` and the log-sum-exp.
- backward: ``delta = rowsum(dout * out)``, then ``p`` recomputed from ``q``, ``k`` and the log-sum-exp,
  ``dv = p^T dout``, ``ds = p (dout v^T - delta)``, ``dq = ds k scale``, ``dk = ds^T q scale``; a kv head's
  dk / dv sum over the query heads of its group (GQA). A cotangent of the returned log-sum-exp enters ``ds``.
- ``torch.func.grad`` / ``vjp`` go through the kernels; under ``vmap`` / ``jvp`` (or a forward-mode dual input)
  the call is :func:`funcshard.ops.attention`, which those transforms differentiate. Grad of grad: not
  supported (the backward is a kernel).

The log-sum-exp is ``lse[b, h, i] = log(sum_j exp(scale * q[b, h, i] . k[b, h_kv, j]))`` over the keys row
``i`` attends to: natural log, per query row, ``[b, hq, sq]``, float32. Two partial results over disjoint key
sets merge exactly as ring attention does: ``lse = logaddexp(lse1, lse2)``,
``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)``.

Example:
    >>> import torch
    >>> from funcshard.ops.triton import flash_attention
    >>> q = k = v = torch.randn(1, 2, 8, 16)
    >>> out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape, lse.dtype
    (torch.Size([1, 2, 8, 16]), torch.Size([1, 2, 8]), torch.float32)
"""

from .attention.triton import MAX_HEAD_DIM as MAX_HEAD_DIM
from .attention.triton import flash_attention as flash_attention
from .attention.triton import kernels_take as kernels_take
from .attention.triton import uses_triton as uses_triton

__all__ = ["MAX_HEAD_DIM", "flash_attention", "kernels_take", "uses_triton"]
