"""The Triton kernels of :func:`funcshard.ops.triton.flash_attention` (FlashAttention-2), built on first use.

Triton is optional: this module imports it only inside :func:`build`, which defines the kernels then, so
``import funcshard`` never imports Triton, and ``TRITON_INTERPRET=1`` (the CPU interpreter, read when a kernel
is decorated) may be set at any time before the first call. One program handles one block of rows of one
``(batch, head)``; ``q``, ``k``, ``v`` are ``[b, h, s, d]`` with any strides; head_dim ``d`` is padded to
``BLOCK_D`` (a power of two, at least 16) by masked loads. Scores are kept in base 2:
``qk_scale = scale * log2(e)``, and the stored log-sum-exp is natural, ``(m + log2(l)) * ln(2)``.

- ``fwd``: tiled online softmax over key blocks in float32 accumulators; writes ``out`` and ``lse``
  (``[b, h, sq]``, float32). Causal programs stop at the diagonal block.
- ``bwd_preprocess``: ``delta = rowsum(dout * out)`` (``[b, h, sq]``, float32).
- ``bwd_dkdv``: one program per key block of one kv head: loops over the ``g`` query heads of its group and
  their query blocks, recomputes ``p = exp(q k^T scale - lse)`` and accumulates ``dv += p^T dout``,
  ``dk += ds^T q scale`` with ``ds = p (dout v^T - delta)``: the GQA sum over a group, without atomics.
- ``bwd_dq``: one program per query block: ``dq += ds k scale`` over the key blocks.

Example:
    >>> LOG2E * LN2  # scores in base 2, the log-sum-exp back in base e
    1.0
"""

# ruff: noqa: ANN001, ANN202  (Triton kernel signatures: pointers and sizes, typed by Triton at launch)

from __future__ import annotations

import functools
import math
import os
from types import SimpleNamespace
from typing import Any

__all__ = ["LN2", "LOG2E", "build", "interpreting"]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter (Triton's own reading of the variable).

    Example:
        >>> isinstance(interpreting(), bool)
        True
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on"}


def build() -> SimpleNamespace:
    """The kernels (``fwd``, ``bwd_preprocess``, ``bwd_dkdv``, ``bwd_dq``) as Triton compiles or interprets
    them now (per ``TRITON_INTERPRET``); imports Triton. Cached per mode.

    Example:
        >>> # kernels = build(); kernels.fwd[grid](...)   (needs triton)
        >>> callable(build)
        True
    """
    return _build(interpreting())


@functools.cache
def _build(interpret: bool) -> SimpleNamespace:  # interpret: the cache key (triton.jit reads the mode itself)
    """The four kernels, each defined now by its builder (``triton.jit`` reads ``TRITON_INTERPRET`` then)."""
    import triton

    return SimpleNamespace(
        fwd=_fwd_kernel(),
        bwd_preprocess=_bwd_preprocess_kernel(),
        bwd_dkdv=_bwd_dkdv_kernel(),
        bwd_dq=_bwd_dq_kernel(),
        triton=triton,
    )


def _fwd_kernel() -> Any:
    """The forward kernel: ``out`` and the natural ``lse`` of one block of query rows of one ``(batch, head)``,
    by an online softmax over the key blocks (causal: up to the diagonal block)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(
        Q, K, V, Out, LSE,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        H, G, SQ, SK, D, qk_scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        start_m = tl.program_id(0)
        bh = tl.program_id(1)  # b * H + h
        b = bh // H
        h = bh % H
        hk = h // G  # the kv head of this query head
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = rows < SQ
        mask_d = offs_d < D
        q_ptrs = Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (base 2)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        hi = SK
        if CAUSAL:
            hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)  # no key after the block's last row
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            mask_n = cols < SK
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)  # [N, D]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, D] @ [D, N] -> [M, N]
            valid = mask_n[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None])
            s = tl.where(valid, s, float("-inf"))  # every row keeps key 0 in the first block: m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)  # [M]: rescales what was accumulated
            p = tl.exp2(s - m_new[:, None])  # [M, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)  # [N, D]
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [M, N] @ [N, D] -> [M, D]
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        o_ptrs = Out + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
        tl.store(LSE + bh * SQ + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mask_m)  # natural log

    return fwd


def _bwd_preprocess_kernel() -> Any:
    """The backward's first kernel: ``delta = rowsum(dout * out)`` for one block of rows of one ``(batch, head)``."""
    import triton
    import triton.language as tl

    @triton.jit
    def bwd_preprocess(
        Out, DO, DELTA,
        sob, soh, som, sod, sdb, sdh, sdm, sdd,
        H, SQ, D,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = rows < SQ
        mask = mask_m[:, None] & (offs_d[None, :] < D)
        o = tl.load(Out + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod, mask=mask, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + offs_d[None, :] * sdd, mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [M]: rowsum(dout * out)
        tl.store(DELTA + bh * SQ + rows, delta, mask=mask_m)

    return bwd_preprocess


def _bwd_dkdv_kernel() -> Any:
    """The backward's ``dk`` / ``dv`` kernel: one key block of one kv head, summed over the query heads of its
    group and their query blocks (the GQA sum, without atomics)."""
    import triton
    import triton.language as tl

    @triton.jit
    def bwd_dkdv(
        Q, K, V, DO, LSE, DELTA, DK, DV,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
        H, HKV, G, SQ, SK, D, scale, qk_scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        start_n = tl.program_id(0)
        bhk = tl.program_id(1)  # b * HKV + hk
        b = bhk // HKV
        hk = bhk % HKV
        cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_n = cols < SK
        mask_d = offs_d < D
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo = 0
        if CAUSAL:
            lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M  # the first query block that sees this key block
        for gi in range(0, G):  # the query heads of this kv head: their dk / dv sum here
            h = hk * G + gi
            q_base = Q + b * sqb + h * sqh
            do_base = DO + b * sdb + h * sdh
            row_base = (b * H + h) * SQ
            for start_m in range(lo, SQ, BLOCK_M):
                rows = start_m + offs_m
                mask_m = rows < SQ
                q_mask = mask_m[:, None] & mask_d[None, :]
                q = tl.load(q_base + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)  # [M, D]
                do = tl.load(do_base + rows[:, None] * sdm + offs_d[None, :] * sdd, mask=q_mask, other=0.0)  # [M, D]
                lse = tl.load(LSE + row_base + rows, mask=mask_m, other=0.0) * 1.4426950408889634  # [M], base 2
                delta = tl.load(DELTA + row_base + rows, mask=mask_m, other=0.0)  # [M]
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, D] @ [D, N] -> [M, N]
                valid = mask_m[:, None] & mask_n[None, :]
                if CAUSAL:
                    valid = valid & (cols[None, :] <= rows[:, None])
                p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)  # [M, N], the forward's probabilities
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)  # [N, M] @ [M, D] -> [N, D]
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [M, D] @ [D, N] -> [M, N]
                ds = p * (dp - delta[:, None])  # [M, N]
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)  # [N, M] @ [M, D] -> [N, D]
        # dk, dv are contiguous [b, hkv, sk, d]
        out_ptrs = (bhk * SK + cols[:, None]) * D + offs_d[None, :]
        tl.store(DK + out_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    return bwd_dkdv


def _bwd_dq_kernel() -> Any:
    """The backward's ``dq`` kernel: one block of query rows of one ``(batch, head)``, over the key blocks."""
    import triton
    import triton.language as tl

    @triton.jit
    def bwd_dq(
        Q, K, V, DO, LSE, DELTA, DQ,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
        H, G, SQ, SK, D, scale, qk_scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        start_m = tl.program_id(0)
        bh = tl.program_id(1)  # b * H + h
        b = bh // H
        h = bh % H
        hk = h // G
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = rows < SQ
        mask_d = offs_d < D
        q_mask = mask_m[:, None] & mask_d[None, :]
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + offs_d[None, :] * sdd, mask=q_mask, other=0.0)
        lse = tl.load(LSE + bh * SQ + rows, mask=mask_m, other=0.0) * 1.4426950408889634  # [M], base 2
        delta = tl.load(DELTA + bh * SQ + rows, mask=mask_m, other=0.0)  # [M]
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        hi = SK
        if CAUSAL:
            hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            mask_n = cols < SK
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)  # [N, D]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, D] @ [D, N] -> [M, N]
            valid = mask_m[:, None] & mask_n[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None])
            p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)  # [M, N]
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [M, D] @ [D, N] -> [M, N]
            ds = p * (dp - delta[:, None])  # [M, N]
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)  # [M, N] @ [N, D] -> [M, D]
        # dq is contiguous [b, h, sq, d]
        tl.store(
            DQ + (bh * SQ + rows[:, None]) * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=q_mask
        )

    return bwd_dq
