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

from __future__ import annotations

import contextlib
import importlib.util
import math
import threading
from typing import Any

import torch

from ...extend import ConfigError, ShardingError
from . import _triton_kernels as _kernels
from ._torch_kernel import attention_torch as attention
from ._torch_kernel import needs_autograd_ring

__all__ = ["MAX_HEAD_DIM", "flash_attention", "kernels_take", "uses_triton"]

MAX_HEAD_DIM = 256
"""The largest head_dim the kernels take (any size up to it: padded inside to a power of two, at least 16)."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def uses_triton(q: torch.Tensor) -> bool:
    """Whether :func:`flash_attention` runs the Triton kernels for ``q``: Triton is installed and ``q`` is on
    CUDA, or on CPU with ``TRITON_INTERPRET=1`` set (the interpreter). Otherwise it runs the torch path.

    Args:
        q: the query tensor (its device decides).

    Returns:
        True for the Triton kernels, False for :func:`funcshard.ops.attention`.

    Example:
        >>> import torch
        >>> uses_triton(torch.zeros(1, device="meta"))  # neither CUDA nor CPU: the torch path
        False
    """
    if q.device.type == "cuda":
        return _has_triton()
    return q.device.type == "cpu" and _kernels.interpreting() and _has_triton()


def kernels_take(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`flash_attention` runs the kernels for these inputs rather than the torch path: Triton for
    ``q``'s device (:func:`uses_triton`), no empty input, no forward-mode AD or batching over them, one dtype the
    kernels take, ``head_dim <= MAX_HEAD_DIM``, one device. Shapes are checked by the callers.

    Example:
        >>> import torch
        >>> x = torch.zeros(1, 2, 4, 8, device="meta")
        >>> kernels_take(x, x, x)
        False
    """
    return (
        uses_triton(q)
        and q.numel() > 0
        and k.numel() > 0
        and q.dtype in _DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.device == k.device == v.device
        and not needs_autograd_ring(q, k, v)
    )


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    return_lse: bool = False,
    scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention by the FlashAttention-2 kernels (see the module): the results of
    :func:`funcshard.ops.attention`, at O(s) memory. ``k`` / ``v`` may have fewer heads than ``q`` (GQA).

    Args:
        q: ``[b, hq, sq, d]``, float16, bfloat16 or float32; ``d`` at most :data:`MAX_HEAD_DIM`.
        k: ``[b, hkv, sk, d]``, the dtype of ``q``.
        v: ``[b, hkv, sk, d]``, the dtype of ``q``.
        causal: mask the keys after each query (needs as many keys as queries).
        return_lse: also return the log-sum-exp of the scores, ``[b, hq, sq]`` (float32, natural log).
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``[b, hq, sq, d]`` in the dtype of ``q`` (and the log-sum-exp).

    Raises:
        ShardingError: heads or shapes that do not fit.
        ConfigError: a dtype or head_dim the kernels do not take (use :func:`funcshard.ops.attention`).

    Example:
        >>> import torch
        >>> q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)  # 4 query heads share 2 kv heads
        >>> from funcshard.ops import attention
        >>> torch.allclose(flash_attention(q, kv, kv, causal=True), attention(q, kv, kv, causal=True), atol=1e-5)
        True
    """
    _check(q, k, v, causal)
    if not uses_triton(q) or q.numel() == 0 or k.numel() == 0 or needs_autograd_ring(q, k, v):
        return attention(q, k, v, causal=causal, return_lse=return_lse, scale=scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = _FlashAttention.apply(q, k, v, causal, scale)
    return (out, lse) if return_lse else out


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShardingError(
            f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need 4-d "
            f"[batch, heads, seq, head_dim] tensors."
        )
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv or k.shape != v.shape or k.shape[0] != b or k.shape[-1] != d:
        raise ShardingError(
            f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: need "
            f"[b, hq, s, d] and [b, hkv, s, d] with hq divisible by hkv."
        )
    if causal and k.shape[2] != sq:
        raise ShardingError(
            f"flash_attention(causal=True): q has {sq} positions but k has {k.shape[2]}; they must match."
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ConfigError(
            f"flash_attention: q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; the kernels take float16, bfloat16 "
            f"or float32, the same for all three: cast them (.to(torch.bfloat16)), or use funcshard.ops.attention."
        )
    if d > MAX_HEAD_DIM:
        raise ConfigError(
            f"flash_attention: head_dim {d} is more than the kernels take ({MAX_HEAD_DIM}); use more heads of "
            f"head_dim <= {MAX_HEAD_DIM}, or funcshard.ops.attention."
        )
    if not (q.device == k.device == v.device):
        raise ShardingError(f"flash_attention: q, k, v are on {q.device}, {k.device}, {v.device}; put them on one.")


# --- launching the kernels -------------------------------------------------------------------------------------


def _configs(kernel: str, d_pad: int, dtype: torch.dtype) -> list[dict[str, int]]:
    """Block sizes to try in order (the next after an out-of-resources error): small blocks of unequal sizes
    under the interpreter (fewer programs to interpret, and the masks of partial blocks tested), and on GPU
    FlashAttention-2's usual tiles, halved for float32 or a head_dim over 128."""
    if _kernels.interpreting():
        m, n = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "pre": (32, 0)}[kernel]
        return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4, "num_stages": 1}]
    big = {"fwd": (128, 64), "dkdv": (32, 128), "dq": (128, 32), "pre": (128, 0)}[kernel]
    shrink = (2 if dtype == torch.float32 else 1) * (2 if d_pad > 128 else 1)
    warps = 8 if d_pad >= 128 and kernel == "fwd" else 4
    m, n = max(16, big[0] // shrink), max(16, big[1] // shrink) if big[1] else 0
    out = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": 3 if shrink == 1 else 2}]
    out.append({"BLOCK_M": max(16, m // 2), "BLOCK_N": max(16, n // 2) if n else 0, "num_warps": 4, "num_stages": 1})
    return out


def _launch(
    kernel: Any, name: str, rows: int, bh: int, d_pad: int, dtype: torch.dtype, *args: Any, **consts: Any
) -> None:
    """Run ``kernel`` over ``(ceil(rows / block), bh)`` programs, the block ``BLOCK_M`` (``BLOCK_N`` for the
    dk/dv kernel, whose programs are key blocks), with the first config that fits the GPU."""
    import triton
    from triton.runtime.errors import OutOfResources

    configs = _configs(name, d_pad, dtype)
    for i, cfg in enumerate(configs):
        block = cfg["BLOCK_N"] if name == "dkdv" else cfg["BLOCK_M"]
        grid = (triton.cdiv(rows, block), bh)
        meta = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_D": d_pad} | ({"BLOCK_N": cfg["BLOCK_N"]} if name != "pre" else {})
        try:
            with _INTERPRETER_LOCK if _kernels.interpreting() else contextlib.nullcontext():
                kernel[grid](*args, **consts, **meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            return
        except OutOfResources:
            if i == len(configs) - 1:
                raise


# Triton's interpreter patches triton.language while a kernel runs: one interpreted kernel at a time (the "sim"
# backend runs each simulated device in a thread)
_INTERPRETER_LOCK = threading.Lock()


def _pad(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 inputs: full-precision dots (no tf32)


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, sq, d], lse [b, hq, sq] float32)`` by the forward kernel; ``out`` in ``out_dtype`` (the
    kernel accumulates in float32 and rounds once, on its store: float32 for the ring's merge), else ``q``'s."""
    kernels = _kernels.build()
    dtype = q.dtype if out_dtype is None else out_dtype
    q, k, v = (_interpretable(t) for t in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype if out_dtype is None else out_dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride())
    sizes = (hq, hq // hkv, sq, sk, d, scale * _kernels.LOG2E)
    consts = {"CAUSAL": causal, "PRECISION": _precision(q.dtype)}
    _launch(kernels.fwd, "fwd", sq, b * hq, _pad(d), q.dtype, q, k, v, out, lse, *strides, *sizes, **consts)
    return out.to(dtype), lse


def _interpretable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or in float32 where it is bfloat16 on CPU: Triton's interpreter (3.9) multiplies bfloat16 blocks as
    their raw 16-bit integers in ``tl.dot``, so there the kernels run bfloat16 inputs in float32."""
    return t.float() if t.dtype == torch.bfloat16 and t.device.type == "cpu" else t


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    delta: torch.Tensor | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` by the backward kernels; a cotangent ``dlse`` of the log-sum-exp (``d lse / d s = p``)
    enters as ``ds = p (dp - delta + dlse)``.

    The ring's blocks give ``delta`` (``rowsum(dout * out)`` of the whole output, contiguous ``[b, hq, sq]``
    float32, ``dlse`` in it; ``out`` is then not read) and ``lse`` (of the whole row), and take the gradients in
    ``grad_dtype`` (float32: they accumulate over the ring); else the inputs' dtype."""
    kernels = _kernels.build()
    dtype = q.dtype if grad_dtype is None else grad_dtype
    q, k, v, dout = (_interpretable(t) for t in (q, k, v, dout))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    d_pad = _pad(d)
    if delta is None:
        out = _interpretable(out)
        delta = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
        _launch(kernels.bwd_preprocess, "pre", sq, b * hq, d_pad, q.dtype, out, dout, delta, *out.stride(),
                *dout.stride(), hq, sq, d)  # fmt: skip
        if dlse is not None:
            delta = delta - dlse.float()  # [b, hq, sq]
    store = q.dtype if grad_dtype is None else grad_dtype  # the kernels round to their outputs' dtype on the store
    dq = torch.empty(b, hq, sq, d, dtype=store, device=q.device)
    dk = torch.empty(b, hkv, sk, d, dtype=store if grad_dtype is not None else k.dtype, device=k.device)
    dv = torch.empty(b, hkv, sk, d, dtype=store if grad_dtype is not None else v.dtype, device=v.device)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    consts = {"CAUSAL": causal, "PRECISION": _precision(q.dtype)}
    g = hq // hkv
    _launch(kernels.bwd_dkdv, "dkdv", sk, b * hkv, d_pad, q.dtype, q, k, v, dout, lse, delta, dk, dv, *strides,
            hq, hkv, g, sq, sk, d, scale, scale * _kernels.LOG2E, **consts)  # fmt: skip
    _launch(kernels.bwd_dq, "dq", sq, b * hq, d_pad, q.dtype, q, k, v, dout, lse, delta, dq, *strides,
            hq, g, sq, sk, d, scale, scale * _kernels.LOG2E, **consts)  # fmt: skip
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class _FlashAttention(torch.autograd.Function):
    """``(out, lse)`` of q, k, v by the kernels; saves q, k, v, out, lse; backward by the kernels."""

    @staticmethod
    def forward(  # type: ignore[override]
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            return _forward(q, k, v, causal, scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        q, k, v, causal, scale = inputs
        out, lse = output
        ctx.set_materialize_grads(False)  # no zeros made for an unused lse
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, out, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        # under torch.func.grad the saved tensors and cotangents are functorch wrappers, and new tensors would be:
        # the kernels take the plain tensors beneath, with functorch off (once differentiable: no graph is lost)
        q, k, v, out, lse = (_plain(t) for t in ctx.saved_tensors)
        dout = torch.zeros_like(out) if dout is None else _plain(dout)
        dlse = None if dlse is None else _plain(dlse)
        with torch._C._DisableFuncTorch(), torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its functorch wrappers (``torch.func`` levels), the tensor whose storage a kernel reads."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t
