"""Grouped matmul of expert segments: ``y[rows of e] = x[rows of e] @ w[e]^T``, the experts' matmuls in one call.

:func:`grouped_mm` takes rows already sorted by expert (``counts[e]`` rows for expert ``e``, in expert order) and
the experts' weights stacked in ``F.linear`` layout ``[E, out, in]``. Implementations (``impl=``):

- ``"torch"``: ``torch._grouped_mm`` (one call per projection; CPU float32 / bfloat16 / float16, and CUDA where
  torch has it), where torch has it and the row strides are multiples of 16 bytes (``in`` and ``out`` times the
  element size); its backward is two more grouped matmuls (``dx = dy @ w[e]``, ``dw[e] = dy_e^T x_e``).
- ``"triton"``: the Triton grouped GEMM (:mod:`funcshard.ops.moe._triton_kernels`), forward and backward; on CUDA,
  or on CPU under ``TRITON_INTERPRET=1`` (the interpreter: slow, for tests).
- ``"segments"``: one ``torch.mm`` per expert on the rows of ``x.split(counts)`` (split's backward is one
  concatenation, where slicing would make one zero ``[T, in]`` gradient per expert); needs ``counts`` on the host.
- ``"auto"`` (default): on CUDA Triton where installed, else ``torch`` where it takes the inputs, else
  ``segments``; on CPU ``torch`` where it takes them, else ``segments`` (never the interpreter).

:func:`grouped_swiglu` runs the three projections of SwiGLU experts and their gating in one autograd Function, and
:func:`swiglu_combine` (the local MoE layer's path) adds the gather of each row from its token and the weighted
combine into the tokens' rows. On CPU both run block by block, each block whole experts of about 4 MiB of
``[rows, f]``, so that no temporary is a fresh allocation of tens of MiB (page faults, cache misses: what cost the
grouped layer 10-25% of its forward against Hugging Face's per-expert loop at 4096 tokens x top-2, d=512, f=1024).

Example:
    >>> import torch
    >>> x, w = torch.randn(5, 16), torch.randn(3, 8, 16)  # 5 rows, 3 experts [out=8, in=16]
    >>> counts = torch.tensor([2, 0, 3])  # expert 0 takes rows 0-1, expert 1 none, expert 2 rows 2-4
    >>> y = grouped_mm(x, w, counts)
    >>> torch.allclose(y, torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T]), atol=1e-5)
    True
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from typing import Any

import torch
import torch.nn.functional as F

from ...extend import ConfigError, ShardingError, one_op
from . import _triton_kernels as _kernels

__all__ = ["IMPLS", "grouped_mm", "grouped_swiglu", "pick_impl", "swiglu_combine"]

IMPLS = ("auto", "torch", "triton", "segments")
"""The values of ``grouped_mm(..., impl=)``."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Per-expert ``F.linear`` of rows sorted by expert: ``y[rows of e] = x[rows of e] @ w[e]^T``.

    Differentiable in ``x`` and ``w`` (the backward is itself grouped: ``dx = dy @ w[e]`` per segment and
    ``dw[e] = dy_e^T @ x_e``; an expert with no rows gets a zero gradient). Rows past ``counts.sum()`` (none in
    :func:`funcshard.ops.moe.moe_ffn`) give zeros.

    Args:
        x: ``[T, in]`` rows, sorted by expert.
        w: ``[E, out, in]`` the experts' weights (``F.linear`` layout), ``x``'s dtype and device.
        counts: ``[E]`` integer rows per expert, in expert order; ``counts.sum() <= T``.
        impl: ``"auto"``, ``"torch"``, ``"triton"`` or ``"segments"`` (see the module).

    Returns:
        ``[T, out]`` in ``x``'s dtype.

    Raises:
        ShardingError: shapes, dtypes or devices that do not fit.
        ConfigError: an unknown ``impl``, or one that cannot run here (``"triton"`` without Triton, or on CPU
            without ``TRITON_INTERPRET=1``; ``"torch"`` where ``torch._grouped_mm`` does not take the inputs).

    Example:
        >>> import torch
        >>> x, w, counts = torch.randn(4, 16), torch.randn(2, 8, 16), torch.tensor([1, 3])
        >>> ys = [grouped_mm(x, w, counts, impl=i) for i in ("torch", "segments")]
        >>> torch.allclose(ys[0], ys[1], atol=1e-5), ys[0].shape
        (True, torch.Size([4, 8]))
    """
    _check(x, w, counts)
    if x.is_meta:  # eval_shape, an abstract mesh: the shape, and the FLOPs (T x in x out, backward too) of one matmul
        return x @ w[0].T  # [T, in] @ [in, out] -> [T, out]
    impl = pick_impl(x, w, impl)
    if impl == "segments":
        return _segments(x, w, counts)
    offs = torch.zeros(w.shape[0] + 1, dtype=torch.int32, device=x.device)
    offs[1:] = counts.cumsum(0)  # [E + 1]: group e owns rows [offs[e], offs[e + 1])
    return _grouped(x, w, offs, impl)


def pick_impl(x: torch.Tensor, w: torch.Tensor, impl: str = "auto") -> str:
    """The implementation :func:`grouped_mm` runs for these inputs: ``impl`` itself where it can run, the choice of
    ``"auto"`` (see the module), or a ConfigError saying why it cannot.

    Example:
        >>> import torch
        >>> pick_impl(torch.zeros(4, 16), torch.zeros(2, 8, 16))  # CPU float32, 16-byte aligned rows
        'torch'
        >>> pick_impl(torch.zeros(4, 6), torch.zeros(2, 8, 6))  # 24-byte rows: not for torch._grouped_mm
        'segments'
    """
    if impl not in IMPLS:
        raise ConfigError(f"grouped_mm: impl must be one of {IMPLS}, not {impl!r}.")
    torch_ok = _torch_takes(x, w)
    if impl == "auto":
        if x.device.type == "cuda" and _has_triton() and x.dtype in _DTYPES:
            return "triton"
        return "torch" if torch_ok else "segments"
    if impl == "torch" and not torch_ok:
        raise ConfigError(
            f"grouped_mm(impl='torch'): torch._grouped_mm does not take x {tuple(x.shape)} {x.dtype} on "
            f"{x.device.type} with w {tuple(w.shape)}: it needs torch >= 2.8, float32 / bfloat16 / float16 and rows "
            f"of a multiple of 16 bytes (in and out times {x.element_size()} bytes; on CUDA bfloat16 on sm90+). "
            f"Use impl='auto' or 'segments'."
        )
    if impl == "triton" and not _triton_runs(x):
        raise ConfigError(
            f"grouped_mm(impl='triton'): the Triton kernels run on CUDA, or on CPU with TRITON_INTERPRET=1, with "
            f"triton installed (pip install 'funcshard[triton]'); here x is on {x.device.type}"
            + ("" if _has_triton() else " and triton is not installed")
            + ". Use impl='auto'."
        )
    return impl


def _check(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    ok = x.dim() == 2 and w.dim() == 3 and w.shape[2] == x.shape[1] and tuple(counts.shape) == (w.shape[0],)
    if not ok or counts.is_floating_point() or counts.is_complex():
        raise ShardingError(
            f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, counts {tuple(counts.shape)} {counts.dtype} do not "
            f"fit: need x [T, in], w [E, out, in] (F.linear layout per expert) and integer counts [E]."
        )
    if w.dtype != x.dtype or w.device != x.device or counts.device != x.device:
        raise ShardingError(
            f"grouped_mm: x is {x.dtype} on {x.device}, w {w.dtype} on {w.device}, counts on {counts.device}: give "
            f"w x's dtype and device, and counts x's device."
        )


def _torch_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (and their gradients): rows of 16-byte multiples."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in _DTYPES or x.device.type not in ("cpu", "cuda"):
        return False
    if (x.shape[1] * x.element_size()) % 16 or (w.shape[1] * x.element_size()) % 16:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return True


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_runs(x: torch.Tensor) -> bool:
    on_device = x.device.type == "cuda" or (x.device.type == "cpu" and _kernels.interpreting())
    return on_device and _has_triton() and x.dtype in _DTYPES


def _segments(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One ``torch.mm`` per expert over ``x.split(counts)``; rows past the counts' sum give zeros."""
    sizes = [int(c) for c in counts.tolist()]
    rest = x.shape[0] - sum(sizes)
    if rest < 0:
        raise ShardingError(f"grouped_mm: counts sum to {sum(sizes)} rows, more than x's {x.shape[0]}.")
    parts = x.split([*sizes, rest])  # (E + 1) x [c_e, in]
    ys = [p @ we.T for p, we in zip(parts, w.unbind(0))]  # [c_e, in] @ [in, out] -> [c_e, out]
    if rest:
        ys.append(x.new_zeros(rest, w.shape[1]))
    return torch.cat(ys) if ys else x.new_zeros(0, w.shape[1])  # [T, out]


# --- the torch._grouped_mm and Triton implementations, one autograd Function -----------------------------------


@one_op  # inside shard_map(check_vma=True): an operand that lacks some of the others' axes (a weight replicated
# over a data axis) is made varying first (its gradient summed over them), which funcshard's own Functions skip
def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
    return _GroupedMM.apply(x, w, offs, impl)  # [T, in] @ [E, in, out] -> [T, out]


def _forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
    """``[T, out]``: rows of group ``e`` times ``w[e]^T`` (``w`` any ``[E, out, in]`` strides)."""
    if impl == "torch":
        y = torch._grouped_mm(x.contiguous(), w.transpose(1, 2), offs=offs[1:])  # [T, in] @ [E, in, out] -> [T, out]
        return _zero_tail(y, offs)
    return _triton_gmm(x, w, offs)


def _wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
    """``[E, out, in]``: per group, ``dy_e^T @ x_e``."""
    if impl == "torch":
        return torch._grouped_mm(dy.t(), x.contiguous(), offs=offs[1:])  # [out, T] @ [T, in] -> [E, out, in]
    return _triton_wgrad(x, dy, offs)


def _zero_tail(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``y`` with zeros in the rows past the last group (``torch._grouped_mm`` leaves them unwritten)."""
    end = int(offs[-1]) if y.shape[0] and y.device.type == "cpu" else None
    if end is None:  # (CUDA: no host sync; a mask)
        keep = torch.arange(y.shape[0], device=y.device) < offs[-1]
        return torch.where(keep.unsqueeze(1), y, y.new_zeros(()))
    if end < y.shape[0]:
        y[end:] = 0
    return y


class _GroupedMM(torch.autograd.Function):
    """``grouped_mm`` by ``torch._grouped_mm`` or the Triton kernels; the backward by the same implementation."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:  # type: ignore[override]
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            return _forward(x, w, offs, impl)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, w, offs, impl = inputs
        ctx.impl = impl
        ctx.save_for_backward(x, w, offs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # under torch.func the saved tensors and the cotangent are functorch wrappers: the kernels take the plain
        # tensors beneath, with functorch off (once differentiable: no graph is lost)
        x, w, offs = (_plain(t) for t in ctx.saved_tensors)
        dy = _plain(dy).contiguous()  # (a sum's cotangent is an expanded view; torch._grouped_mm needs strides)
        dx = dw = None
        with torch._C._DisableFuncTorch(), torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            if ctx.needs_input_grad[0]:
                dx = _forward(dy, w.transpose(1, 2), offs, ctx.impl)  # [T, out] @ w[e] [out, in] -> [T, in]
            if ctx.needs_input_grad[1]:
                dw = _wgrad(x, dy, offs, ctx.impl).to(w.dtype)  # [E, out, in]
        return dx, dw, None, None


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its functorch wrappers (``torch.func`` levels), the tensor whose storage a kernel reads."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


# --- the SwiGLU experts in one autograd Function ---------------------------------------------------------------


def grouped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, *, impl: str = "auto"
) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert: ``y[rows of e] = (silu(x_e w1[e]^T) * (x_e w3[e]^T)) w2[e]^T``.

    The three projections of :func:`grouped_mm` and the gating in one autograd Function: the forward keeps the gate,
    the up projection and their product for the backward (nothing else), the backward runs the elementwise part in
    place on the buffers of its own matmuls (``silu_backward`` into ``dact * up``) and sums ``dx`` from the two
    input projections in one buffer. Equal to the composition of three :func:`grouped_mm` with ``F.silu`` and a
    product (the same ops in the same order: bitwise in float32); ``impl="segments"`` (or where
    ``torch._grouped_mm`` does not take the shapes) is that composition.

    Args:
        x: ``[T, d]`` rows, sorted by expert.
        w1: ``[E, f, d]`` the gate projection (``F.linear`` layout per expert), ``x``'s dtype and device.
        w3: ``[E, f, d]`` the up projection.
        w2: ``[E, d, f]`` the down projection.
        counts: ``[E]`` integer rows per expert, in expert order; ``counts.sum() <= T``.
        impl: ``"auto"``, ``"torch"``, ``"triton"`` or ``"segments"`` (see the module).

    Returns:
        ``[T, d]`` in ``x``'s dtype (zeros past ``counts.sum()``).

    Raises:
        ShardingError: shapes, dtypes or devices that do not fit.
        ConfigError: an unknown ``impl``, or one that cannot run here (as :func:`grouped_mm`).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> x, counts = torch.randn(5, 16), torch.tensor([2, 3])
        >>> w1, w3, w2 = torch.randn(2, 32, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 32)
        >>> y = grouped_swiglu(x, w1, w3, w2, counts)
        >>> ref = torch.cat([(F.silu(x[s] @ w1[e].T) * (x[s] @ w3[e].T)) @ w2[e].T
        ...                  for e, s in enumerate((slice(0, 2), slice(2, 5)))])
        >>> torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
        True
    """
    _check_swiglu(x, w1, w3, w2, counts, "grouped_swiglu")
    if x.is_meta:  # (eval_shape: the three matmuls' shapes and FLOPs)
        return _composed(x, w1, w3, w2, counts, "segments")
    impl = pick_impl(x, w1, impl)
    if impl == "segments" or (impl == "torch" and not _torch_takes(x.new_empty(0, w2.shape[2]), w2)):
        return _composed(x, w1, w3, w2, counts, impl)
    offs = torch.zeros(w1.shape[0] + 1, dtype=torch.int32, device=x.device)
    offs[1:] = counts.cumsum(0)  # [E + 1]: group e owns rows [offs[e], offs[e + 1])
    return _swiglu(x, w1, w3, w2, offs, impl, _row_blocks(offs, x.shape[0], w1.shape[1] * x.element_size()))


def _check_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, name: str
) -> None:
    """ShardingError unless ``x [T, d]``, ``w1`` / ``w3`` ``[E, f, d]``, ``w2 [E, d, f]`` and integer ``counts [E]``
    on ``x``'s device and dtype (``name``: the caller, for the message)."""
    _check(x, w1, counts)
    _check(x, w3, counts)
    if w3.shape != w1.shape or w2.shape != (w1.shape[0], x.shape[1], w1.shape[1]) or w2.dtype != x.dtype:
        raise ShardingError(
            f"{name}: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} {w2.dtype} for rows of width "
            f"{x.shape[1]} ({x.dtype}): need w1 / w3 [E, f, d] and w2 [E, d, f] in x's dtype."
        )


def _composed(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, impl: str
) -> torch.Tensor:
    """The SwiGLU experts as three :func:`grouped_mm` calls and the gating between them."""
    gate = grouped_mm(x, w1, counts, impl=impl)  # [T, d] @ [E, d, f] -> [T, f]
    up = grouped_mm(x, w3, counts, impl=impl)  # [T, d] @ [E, d, f] -> [T, f]
    return grouped_mm(F.silu(gate) * up, w2, counts, impl=impl)  # [T, f] @ [E, f, d] -> [T, d]


_BLOCK_BYTES = 4 << 20
"""On CPU the SwiGLU experts run in blocks of whole experts of about this many bytes of ``[rows, f]`` (one expert
with more rows is a block alone): intermediates that stay in cache and are recycled by the allocator (a fresh
tensor of 32 MiB or more is a fresh ``mmap``, page faults on first touch: ~5x the time of the op itself)."""

Block = tuple[int, int, int, tuple[int, ...]]
"""``(lo, hi, start, ends)``: experts ``[lo, hi)``, their rows from ``start``, each expert's end relative to it."""


def _row_blocks(offs: torch.Tensor, rows: int, row_bytes: int) -> tuple[Block, ...] | None:
    """The experts cut into consecutive blocks of about :data:`_BLOCK_BYTES` (``row_bytes`` per row of the widest
    intermediate), every expert in one block; ``None`` (one block, no host sync) off the CPU or for a single
    block."""
    if offs.device.type != "cpu" or rows * row_bytes <= _BLOCK_BYTES:
        return None
    ends, target = offs.tolist(), max(1, _BLOCK_BYTES // max(row_bytes, 1))
    blocks, lo = [], 0
    for e in range(1, len(ends)):
        if e - 1 > lo and ends[e] - ends[lo] > target:  # expert e - 1 would overfill [lo, e - 1): a new block
            blocks.append((lo, e - 1, ends[lo], tuple(c - ends[lo] for c in ends[lo + 1 : e])))
            lo = e - 1
    blocks.append((lo, len(ends) - 1, ends[lo], tuple(c - ends[lo] for c in ends[lo + 1 :])))
    return tuple(blocks) if len(blocks) > 1 else None


def _block_views(
    ts: tuple[torch.Tensor | None, ...], ws: tuple[torch.Tensor, ...], offs: torch.Tensor, block: Block | None
) -> tuple[tuple[Any, ...], tuple[torch.Tensor, ...], torch.Tensor]:
    """The rows ``ts`` of ``block`` (row slices; None stays None), its experts' weights ``ws`` (slices of dim 0)
    and its offsets ``[hi - lo + 1]`` from 0; all of them where ``block`` is None."""
    if block is None:
        return ts, ws, offs
    lo, hi, start, ends = block
    b_offs = torch.tensor((0, *ends), dtype=offs.dtype)
    rows = tuple(None if t is None else t[start : start + ends[-1]] for t in ts)
    return rows, tuple(w[lo:hi] for w in ws), b_offs


@one_op  # (as _grouped: one op for the vma tracking; its operands made varying first where they lack axes)
def _swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor,
    impl: str,
    blocks: tuple[Block, ...] | None,
) -> torch.Tensor:
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w3, w2))  # (autograd's own test)
    return _SwiGLU.apply(x, w1, w3, w2, offs, impl, blocks, keep)[0]  # [T, d] -> [T, d]


def _rows_buffer(like: torch.Tensor, rows: int, cols: int, end: int) -> torch.Tensor:
    """An uninitialised ``[rows, cols]`` buffer the blocks write into, its rows past ``end`` (no expert's) zero."""
    buf = like.new_empty(rows, cols)
    buf[end:] = 0
    return buf


def _swiglu_fwd(
    x: torch.Tensor,
    ws: tuple[torch.Tensor, ...],
    offs: torch.Tensor,
    impl: str,
    act_out: torch.Tensor | None,
    keep: bool = True,
) -> list[torch.Tensor]:
    """``[y, gate, up, act]`` of one block: ``x [t, d]`` through ``ws = (w1, w3, w2)`` of its experts; ``act``
    written into ``act_out`` where given; without ``keep`` (no backward) ``gate`` is overwritten by ``act``."""
    if x.shape[0] == 0:  # (an empty block: torch._grouped_mm takes no rows)
        return [x.new_zeros(0, ws[2].shape[1])] + [x.new_zeros(0, ws[0].shape[1]) for _ in range(3)]
    gate = _forward(x, ws[0], offs, impl)  # [t, d] @ [E_b, d, f] -> [t, f]
    act = F.silu(gate, inplace=not keep)  # [t, f], while gate is in cache; in place where no backward reads gate
    up = _forward(x, ws[1], offs, impl)  # [t, d] @ [E_b, d, f] -> [t, f]
    act = act.mul_(up) if act_out is None else torch.mul(act, up, out=act_out)  # [t, f]
    return [_forward(act, ws[2], offs, impl), gate, up, act]  # [t, f] @ [E_b, f, d] -> [t, d]


def _swiglu_bwd(
    dy: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    ws: tuple[torch.Tensor, ...],
    offs: torch.Tensor,
    impl: str,
    outs: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dgate, dup)`` of one block (``dx`` None for an empty block); ``dgate`` and ``dup`` written into
    ``outs`` where given, else into the buffers of its own matmul and of ``silu(gate)``."""
    x, gate, up = saved
    if x.shape[0] == 0:
        return x.new_zeros(x.shape), gate, up  # (no rows: [0, f] each)
    w1, w3, w2 = ws
    dact = _forward(dy, w2.transpose(1, 2), offs, impl)  # [t, d] @ w2[e] [d, f] -> [t, f]
    if outs is None:
        dup = F.silu(gate).mul_(dact)  # [t, f]: d act / d up = silu(gate)
        dgate = dact.mul_(up)  # [t, f], in dact's buffer: d act / d silu(gate) = up ...
    else:
        dup = torch.mul(F.silu(gate), dact, out=outs[1])
        dgate = torch.mul(dact, up, out=outs[0])
    torch.ops.aten.silu_backward.grad_input(dgate, gate, grad_input=dgate)  # ... times silu'(gate)
    dx = _forward(dgate, w1.transpose(1, 2), offs, impl)  # [t, f] @ w1[e] [f, d] -> [t, d]
    dx += _forward(dup, w3.transpose(1, 2), offs, impl)  # [t, f] @ w3[e] [f, d] -> [t, d]
    return dx, dgate, dup


def _cat_rows(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """``parts`` concatenated, and zero rows up to ``rows`` (those past the counts)."""
    rest = rows - sum(p.shape[0] for p in parts)
    return torch.cat([*parts, parts[0].new_zeros(rest, parts[0].shape[1])] if rest else parts)


class _SwiGLU(torch.autograd.Function):
    """The grouped SwiGLU experts, in ``blocks`` (whole experts each) or at once. Returns ``y``, then, where
    ``keep`` (a backward will run), ``act [T, f]`` (one buffer: the down projection's weight gradient is one grouped
    matmul) and each block's ``gate`` and ``up`` (the elementwise backward reads them per block)."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        offs: torch.Tensor,
        impl: str,
        blocks: tuple[Block, ...] | None,
        keep: bool,
    ) -> tuple[torch.Tensor, ...]:
        act = _rows_buffer(x, x.shape[0], w1.shape[1], blocks[-1][2] + blocks[-1][3][-1]) if blocks and keep else None
        outs = []
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            for block in blocks or (None,):
                (xb, ab), ws, b_offs = _block_views((x, act), (w1, w3, w2), offs, block)
                outs.append(_swiglu_fwd(xb, ws, b_offs, impl, ab, keep))
        y = _cat_rows([o[0] for o in outs], x.shape[0]) if blocks else outs[0][0]
        if not keep:
            return (y,)
        return (y, outs[0][3] if act is None else act, *(t for o in outs for t in o[1:3]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, w1, w3, w2, offs, impl, blocks, _ = inputs
        ctx.impl, ctx.blocks = impl, blocks
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(x, w1, w3, w2, offs, *output[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        x, w1, w3, w2, offs, act, *gate_up = (_plain(t) for t in ctx.saved_tensors)
        dy = _plain(dy).contiguous()  # (a sum's cotangent is an expanded view)
        need, impl, blocks = ctx.needs_input_grad, ctx.impl, ctx.blocks
        with torch._C._DisableFuncTorch(), torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            grads, full = [], None
            if blocks:  # dgate and dup in one [T, f] buffer each (one grouped weight-gradient matmul each)
                end = blocks[-1][2] + blocks[-1][3][-1]
                full = tuple(_rows_buffer(x, x.shape[0], w1.shape[1], end) for _ in range(2))
            for i, block in enumerate(blocks or (None,)):
                (xb, dyb, *outs), ws, b_offs = _block_views((x, dy, *(full or ())), (w1, w3, w2), offs, block)
                saved = (xb, gate_up[2 * i], gate_up[2 * i + 1])
                grads.append(_swiglu_bwd(dyb, saved, ws, b_offs, impl, tuple(outs) if full else None))
            dgate, dup = full or grads[0][1:]
            dx = (_cat_rows([g[0] for g in grads], x.shape[0]) if blocks else grads[0][0]) if need[0] else None
            dw1 = _wgrad(x, dgate, offs, impl).to(w1.dtype) if need[1] else None  # [E, f, d]
            dw3 = _wgrad(x, dup, offs, impl).to(w3.dtype) if need[2] else None  # [E, f, d]
            dw2 = _wgrad(act, dy, offs, impl).to(w2.dtype) if need[3] else None  # [E, d, f]
        return dx, dw1, dw3, dw2, None, None, None, None


# --- the local layer's gather, experts and combine in one autograd Function ---------------------------------
# Each block of whole experts gathers its rows from the tokens, runs the SwiGLU experts on them and adds its
# weighted outputs into the tokens' rows before the next block starts: no [T * k, d] tensor of rows or of outputs
# is ever whole in the forward (Hugging Face's per-expert loop keeps its temporaries this small too; gathering
# every row, then running every expert, then combining cost a grouped path 10-25% of the forward on CPU at 4096
# tokens x top-2, d=512, f=1024: fresh memory, page faults, cache misses).


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


# --- launching the Triton kernels ------------------------------------------------------------------------------

# Triton's interpreter patches triton.language while a kernel runs: one interpreted kernel at a time (the "sim"
# backend runs each simulated device in a thread)
_INTERPRETER_LOCK = threading.Lock()


def _blocks(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``: small unequal blocks under the interpreter (few programs, the
    masks of partial blocks tested), the usual GEMM tiles on GPU (halved along k for float32)."""
    if _kernels.interpreting():
        return 16, 32, 16, 4
    return (64, 128, 32 if dtype == torch.float32 else 64, 4)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 inputs: full-precision dots (no tf32)


def _interpretable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or in float32 where it is bfloat16 on CPU: Triton's interpreter (3.9) multiplies bfloat16 blocks as
    their raw 16-bit integers in ``tl.dot``."""
    return t.float() if t.dtype == torch.bfloat16 and t.device.type == "cpu" else t


def _triton_gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[T, out]`` by the ``gmm`` kernel."""
    dtype = x.dtype
    x, w = _interpretable(x), _interpretable(w)
    t, (e, n, k) = x.shape[0], w.shape
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return y.to(dtype)
    if k == 0 or e == 0:
        return y.zero_().to(dtype)
    kernels = _kernels.build()
    bm, bn, bk, warps = _blocks(x.dtype)
    grid = (kernels.triton.cdiv(t, bm), kernels.triton.cdiv(n, bn))
    with _INTERPRETER_LOCK if _kernels.interpreting() else contextlib.nullcontext():
        kernels.gmm[grid](
            x, w, y, offs, t, n, k, e, *x.stride(), *w.stride(), *y.stride(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype), num_warps=warps,
        )  # fmt: skip
    return y.to(dtype)


def _triton_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[E, out, in]`` by the ``gmm_wgrad`` kernel (float32 accumulators, stored in float32)."""
    x, dy = _interpretable(x), _interpretable(dy)
    e, n, k = offs.shape[0] - 1, dy.shape[1], x.shape[1]
    dw = torch.empty(e, n, k, dtype=torch.float32, device=x.device)
    if dw.numel() == 0:
        return dw
    kernels = _kernels.build()
    bm, bn, bk, warps = _blocks(x.dtype)
    grid = (kernels.triton.cdiv(n, bn), kernels.triton.cdiv(k, bk), e)
    with _INTERPRETER_LOCK if _kernels.interpreting() else contextlib.nullcontext():
        kernels.gmm_wgrad[grid](
            x, dy, dw, offs, n, k, *x.stride(), *dy.stride(), *dw.stride(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype), num_warps=warps,
        )  # fmt: skip
    return dw
