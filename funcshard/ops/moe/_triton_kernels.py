"""The Triton kernels of :func:`funcshard.ops.moe.grouped_mm` (grouped GEMM over expert segments), built on first use.

Triton is optional: this module imports it only inside :func:`build`, which defines the kernels then (so
``TRITON_INTERPRET=1``, read when a kernel is decorated, may be set at any time before the first call). The rows
of ``x`` are sorted by group: group ``e`` owns rows ``[OFFS[e], OFFS[e + 1])`` (``OFFS``: ``[E + 1]`` int32,
``OFFS[0] = 0``); rows past ``OFFS[E]`` get zeros. Accumulation is in float32, rounded once on the store.

- ``gmm``: ``y[rows of e] = x[rows of e] @ w[e]^T`` for ``w [E, N, K]`` (``F.linear`` layout, any strides: the
  backward's ``dx = dy @ w[e]`` is the same kernel on ``w``'s transposed strides). One program per block of rows
  and block of output columns; it loops over the groups whose rows meet its block (most blocks: one), masking
  the rows of the others, so an empty group costs nothing and no host-side tile table is needed.
- ``gmm_wgrad``: ``dw[e] = dy[rows of e]^T @ x[rows of e]`` (``[N, K]`` per group): one program per group and
  block of ``dw[e]``, looping over the group's rows; an empty group stores zeros.

Example:
    >>> callable(build)  # kernels = build(); kernels.gmm[grid](...)   (needs triton)
    True
"""

# ruff: noqa: ANN001, ANN202  (Triton kernel signatures: pointers and sizes, typed by Triton at launch)

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from ..attention._triton_kernels import interpreting as interpreting

__all__ = ["build", "interpreting"]


def build() -> SimpleNamespace:
    """The kernels (``gmm``, ``gmm_wgrad``) as Triton compiles or interprets them now (per ``TRITON_INTERPRET``);
    imports Triton. Cached per mode.

    Example:
        >>> callable(build)
        True
    """
    return _build(interpreting())


@functools.cache
def _build(interpret: bool) -> SimpleNamespace:  # interpret: the cache key (triton.jit reads the mode itself)
    import triton

    return SimpleNamespace(gmm=_gmm_kernel(), gmm_wgrad=_gmm_wgrad_kernel(), triton=triton)


def _gmm_kernel() -> Any:
    """``y [T, N]``: each row block times the ``[N, K]`` weight of the group(s) its rows belong to."""
    import triton
    import triton.language as tl

    @triton.jit
    def gmm(
        X, W, Y, OFFS,
        T, N, K, E,
        sxm, sxk, swe, swn, swk, sym, syn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        m0 = pid_m * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for e in range(0, E):
            start = tl.load(OFFS + e)
            end = tl.load(OFFS + e + 1)
            if (end > m0) & (start < m0 + BLOCK_M) & (end > start):  # the group's rows meet this block
                in_group = (rows >= start) & (rows < end)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    mask_k = kk < K
                    x = tl.load(
                        X + rows[:, None] * sxm + kk[None, :] * sxk, mask=in_group[:, None] & mask_k[None, :], other=0.0
                    )  # [BLOCK_M, BLOCK_K], the other groups' rows 0
                    w = tl.load(
                        W + e * swe + cols[None, :] * swn + kk[:, None] * swk,
                        mask=mask_k[:, None] & mask_n[None, :],
                        other=0.0,
                    )  # [BLOCK_K, BLOCK_N] = w[e]^T block
                    acc += tl.dot(x, w, input_precision=PRECISION)  # [M, K] @ [K, N] -> [M, N]
        mask = (rows < T)[:, None] & mask_n[None, :]
        tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty), mask=mask)

    return gmm


def _gmm_wgrad_kernel() -> Any:
    """``dw [E, N, K]``: per group, the sum over its rows of ``dy[row]^T x[row]``."""
    import triton
    import triton.language as tl

    @triton.jit
    def gmm_wgrad(
        X, DY, DW, OFFS,
        N, K,
        sxm, sxk, sdm, sdn, swe, swn, swk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        e = tl.program_id(2)
        start = tl.load(OFFS + e)
        end = tl.load(OFFS + e + 1)
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, BLOCK_M)
        mask_n = cols_n < N
        mask_k = cols_k < K
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + offs_m
            mask_m = rows < end
            dy = tl.load(
                DY + rows[:, None] * sdm + cols_n[None, :] * sdn, mask=mask_m[:, None] & mask_n[None, :], other=0.0
            )  # [BLOCK_M, BLOCK_N]
            x = tl.load(
                X + rows[:, None] * sxm + cols_k[None, :] * sxk, mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )  # [BLOCK_M, BLOCK_K]
            acc += tl.dot(tl.trans(dy), x, input_precision=PRECISION)  # [N, M] @ [M, K] -> [N, K]
        ptrs = DW + e * swe + cols_n[:, None] * swn + cols_k[None, :] * swk
        tl.store(ptrs, acc.to(DW.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])

    return gmm_wgrad
