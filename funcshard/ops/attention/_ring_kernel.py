"""The ring of :func:`funcshard.ops.ring_attention`: a forward that keeps only what the backward needs, and a
hand-written backward that goes around the ring again (FlashAttention-2's backward, blockwise, as ring
attention implementations do).

Per device, between the forward and the backward, :class:`RingAttention` keeps this device's q, k and v, the
output and the log-sum-exp of its rows (``[b, h, s/n]``, float32): O(s/n) memory, whatever the ring size.

- forward: k/v (packed ``[2, b, hkv, s/n, d]``) make ``n - 1`` ring steps (``ppermute`` to the successor);
  each step's partial attention is merged into the running output by the log-sum-exp rule, in float32.
- backward: ``delta = rowsum(dout * out)``; the k/v blocks go around the ring once more and each device
  recomputes its probabilities against the block it holds from q and the saved log-sum-exp,
  ``p = exp(q k^T scale - lse)``, then ``dv += p^T dout``, ``ds = p (dout v^T - delta)``, ``dq += ds k scale``
  (kept here), ``dk += ds^T q scale``, in float32 (float64 for float64 inputs). A block's dk/dv accumulator
  travels with the block (one ``[4, b, hkv, s/n, d]`` message per step when k/v are float32 or float64, else
  k/v and the float32 dk/dv as two), and one last hop after the ``n``-th step brings every block's complete
  dk/dv home: ``n - 1`` ring steps plus that hop.

On CUDA (``ops.attention.local.FLASH_DEVICES``), where the kernels of :mod:`funcshard.ops.triton` take the
inputs, each block's forward and backward are those kernels (the output stored in float32 for the merge; the
backward's blocks given the whole rows' lse and delta); a backward that is itself differentiated keeps the
torch path.

The causal mask and the layouts skip or halve blocks as the forward does (:func:`block_plan`). All
communication goes through the backend's ``Ppermute`` (counted by ``fs.comm_stats``), with the device handle
of the forward, so the backward needs no running ``shard_map`` context.

:func:`ring_through_autograd` is the same forward written with differentiable collectives: autograd then
differentiates through the ring (keeping every received block and the per-step scores). It serves where the
Function has no rule: under ``torch.vmap`` / ``jvp`` / forward-mode AD.

Uneven sequences (devices of different local lengths): the k/v block travels padded to the longest (zeros
at its end) and each step reads only the held block's own columns (:func:`_cols`); where all lengths agree
nothing is padded, the even path's messages unchanged.

Example:
    >>> block_plan(i=1, j=0, causal=True, layout="zigzag", sizes=(4, 4))  # all queries, the block's first chunk
    (slice(None, None, None), slice(0, 2, None), False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from ... import lax
from ...extend import Audited, Op, Ppermute, axis_index_int, call
from ._torch_kernel import attention_torch as attention
from ._torch_kernel import needs_autograd_ring

__all__ = ["RingAttention", "block_plan", "needs_autograd_ring", "ring_through_autograd"]

_ALL = slice(None)
Plan = tuple[slice, slice, bool]
Pair = tuple[torch.Tensor, torch.Tensor]
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def block_plan(i: int, j: int, causal: bool, layout: str, sizes: Sequence[int]) -> Plan | None:
    """What device ``i`` computes against the k/v block of device ``j``: ``(query rows, key columns, causal
    within)``, or None for nothing (the block lies in the future of all its queries). ``sizes``: every device's
    local k/v length (q's too under ``causal``), in axis order.

    ``j == i``: causal attention on its own block (its positions increase, in either layout);
    ``"contiguous"``: ``j < i`` full, ``j > i`` nothing; ``"zigzag"`` (device ``j``'s first chunk
    ``ceil(sizes[j] / 2)`` long, its second the rest): ``j < i`` all queries against the block's first chunk,
    ``j > i`` the second query chunk against the whole block. By chunk order alone, so any chunk lengths.

    Example:
        >>> block_plan(i=0, j=1, causal=True, layout="contiguous", sizes=(4, 4)) is None
        True
    """
    if j == i:
        return _ALL, _ALL, causal
    if not causal:
        return _ALL, _ALL, False
    if layout == "contiguous":
        return (_ALL, _ALL, False) if j < i else None
    if j < i:
        return _ALL, slice(0, (sizes[j] + 1) // 2), False
    return slice((sizes[i] + 1) // 2, None), _ALL, False


# --- one block, in the accumulation dtype, heads grouped ``[b, hkv, g, s, d]`` (g query heads per kv head) -------


def _scores(q5: torch.Tensor, kb: torch.Tensor, scale: float, diag: bool) -> torch.Tensor:
    g, sq = q5.shape[2], q5.shape[3]
    s = (q5.flatten(2, 3) @ kb.transpose(-1, -2)) * scale  # [b,hkv,g*sq,d] @ [b,hkv,d,sk] -> [b,hkv,g*sq,sk]
    s = s.unflatten(2, (g, sq))  # [b, hkv, g, sq, sk]
    if diag:
        s = s.masked_fill(torch.ones(sq, s.shape[-1], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(
    q5: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, scale: float, diag: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q5`` ``[b, hkv, g, sq, d]`` against one block ``[b, hkv, sk, d]``."""
    s = _scores(q5, kb, scale, diag)
    lse = torch.logsumexp(s, dim=-1)  # [b, hkv, g, sq]
    p = torch.exp(s - lse.unsqueeze(-1)).flatten(2, 3)  # [b, hkv, g*sq, sk]
    out = p @ vb  # [b, hkv, g*sq, sk] @ [b, hkv, sk, d] -> [b, hkv, g*sq, d]
    return out.unflatten(2, q5.shape[2:4]), lse


def _block_backward(
    q5: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    do5: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    diag: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block: the probabilities recomputed from ``q5`` and the final ``lse``. The
    ``g`` query heads of a kv head are rows of one matrix, so dk / dv sum over them in the matmul."""
    p = torch.exp(_scores(q5, kb, scale, diag) - lse.unsqueeze(-1)).flatten(2, 3)  # [b, hkv, g*sq, sk]
    qf, dof = q5.flatten(2, 3), do5.flatten(2, 3)  # [b, hkv, g*sq, d] each
    dv = p.transpose(-1, -2) @ dof  # [b, hkv, sk, g*sq] @ [b, hkv, g*sq, d] -> [b, hkv, sk, d]
    dp = dof @ vb.transpose(-1, -2)  # [b, hkv, g*sq, d] @ [b, hkv, d, sk] -> [b, hkv, g*sq, sk]
    ds = p * (dp - delta.flatten(2, 3).unsqueeze(-1))  # [b, hkv, g*sq, sk]
    dq = (ds @ kb) * scale  # [b, hkv, g*sq, sk] @ [b, hkv, sk, d] -> [b, hkv, g*sq, d]
    dk = (ds.transpose(-1, -2) @ qf) * scale  # [b, hkv, sk, g*sq] @ [b, hkv, g*sq, d] -> [b, hkv, sk, d]
    return dq.unflatten(2, q5.shape[2:4]), dk, dv


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor) -> None:
    """Merge a partial result ``(o, lo)`` into the running ``(out, lse)`` (views of the rows it covers), in
    place, by the log-sum-exp rule: ``lse' = log(e^lse + e^lo)``, ``out' = out e^(lse - lse') + o e^(lo - lse')``;
    finite because every query sees at least itself on the diagonal step."""
    new = torch.logaddexp(lse, lo)  # [b, hkv, g, sq]
    out.mul_((lse - new).exp().unsqueeze(-1)).add_(o * (lo - new).exp().unsqueeze(-1))  # [b, hkv, g, sq, d]
    lse.copy_(new)


def _place(dev: Any, axes: tuple[str, ...]) -> tuple[int, int]:
    """``(n, i)``: how many devices the ring over ``axes`` has, and this device's place on it (row-major over
    ``axes``, as :func:`funcshard.axis_index`)."""
    shape, coords = dev.mesh.shape, dev.coords
    n, i = 1, 0
    for a in axes:
        n *= shape[a]
        i = i * shape[a] + coords[a]
    return n, i


def _cols(cols: slice, size: int, padded: bool) -> slice:
    """A plan's key columns of a held block ``size`` long: all of them means its first ``size`` where the
    block travels padded."""
    return slice(0, size) if padded and cols == _ALL else cols


def _padded(kv: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``kv [.., b, hkv, L_i, d]`` padded with zeros to the longest local length along the sequence dim."""
    extra = max(sizes) - kv.shape[-2]
    if extra <= 0:
        return kv
    return torch.cat((kv, kv.new_zeros((*kv.shape[:-2], extra, kv.shape[-1]))), dim=-2)  # -> [.., max L, d]


def _shift(n: int) -> tuple[tuple[int, int], ...]:
    return tuple((src, (src + 1) % n) for src in range(n))  # device src sends to src + 1


class RingAttention(Op):
    """Ring attention of this device's ``q`` ``[b, h, s/n, d]`` against every device's ``k``, ``v``
    ``[b, hkv, s/n, d]`` over ``axes`` (``n`` devices, this one ``i``); outputs ``(out [b, h, s/n, d],
    lse [b, h, s/n])`` (float32, or float64 for float64 inputs). Bound with ``bind(RingAttention, q, k, v,
    axis=..., name=..., params=(causal, layout, scale))``.

    - forward: ``n - 1`` ppermutes of the packed k/v block; saves q, k, v, out, lse (nothing per step).
    - backward: ``n - 1`` ring steps of k/v with their dk/dv accumulators, then one hop of dk/dv home; dq local.
      A cotangent of ``lse`` (``d lse / d scores = p``) enters ``ds``, and the backward is made of
      differentiable ops and collectives, so it can itself be differentiated (grad of grad).
    - jvp / vmap: none (:func:`needs_autograd_ring` sends those transforms to :func:`ring_through_autograd`).
    - vma: ``bind`` makes k and v vary over ``axes`` first (they enter the ppermutes, as JAX requires), and under
      ``check_vma=True`` q, k and v agree (each over the union of their axes); the results vary over the union.
    """

    varying_operands = (1, 2)  # k, v
    agree = True

    @staticmethod
    def vma(axes: frozenset[str], *have: frozenset[str]) -> frozenset[str]:
        """vma rule: each device's rows of the results: they vary over ``axes`` and every operand's axes
        (:class:`Audited` where one operand's are known only to the audit)."""
        tag = axes.union(*have)
        for h in have:
            if isinstance(h, Audited):
                return Audited(tag)
        return tag

    @staticmethod
    def forward(  # type: ignore[override]
        dev: Any,
        axes: tuple[str, ...],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        layout: str,
        scale: float,
        sizes: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, i = _place(dev, axes)
        h, hkv = q.shape[1], k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)  # merge in float32 (float64 stays float64)
        padded = min(sizes) != max(sizes)  # uneven: blocks travel padded to the longest
        with torch._C.DisableTorchFunction():
            flash = _flash(q, k, v)
            if flash is None:  # the torch path: heads grouped [b, hkv, g, sq, d], blocks in the accumulation dtype
                qb = q.unflatten(1, (hkv, h // hkv)).to(acc)  # [b, h, sq, d] -> [b, hkv, g, sq, d]

                def block(qr: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, diag: bool) -> Pair:
                    return _block_forward(qr, kb.to(acc), vb.to(acc), scale, diag)  # [b,hkv,g,r,d], [b,hkv,g,r]

            else:  # the Triton kernels: [b, h, sq, d] as it is (GQA in the kernel), the output stored in acc
                qb = q

                def block(qr: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, diag: bool) -> Pair:
                    with _on_device(qr):
                        return flash._forward(qr, kb, vb, diag, scale, out_dtype=acc)  # [b, h, r, d], [b, h, r]

            kv = _padded(torch.stack((k, v)), sizes)  # 2 x [b, hkv, sk, d] -> [2, b, hkv, sk(max), d]: one message
            out, lse = block(qb, k, v, causal)  # step 0, this device's own block (the diagonal: causal within it)
            for step in range(1, n):
                kv = call(Ppermute, kv, dev, axes, _shift(n))  # [2,b,hkv,sk,d], from device i-1
                j = (i - step) % n
                plan = block_plan(i, j, causal, layout, sizes)
                if plan is None:  # contiguous, a block in the future: nothing to compute
                    continue
                rows, cols, diag = plan
                cols = _cols(cols, sizes[j], padded)
                o, lo = block(qb[..., rows, :], kv[0, :, :, cols], kv[1, :, :, cols], diag)
                _merge_into(out[..., rows, :], lse[..., rows], o, lo)
            if flash is None:
                out, lse = out.flatten(1, 2), lse.flatten(1, 2)  # [b, hkv, g, sq, ...] -> [b, h, sq, ...]
            return out.to(q.dtype), lse  # [b, h, sq, d], [b, h, sq]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        dev, axes, q, k, v, causal, layout, scale, sizes = inputs
        out, lse = output
        ctx.set_materialize_grads(False)  # no zeros made for an unused lse (or out)
        ctx.dev, ctx.axes = dev, axes
        ctx.n, ctx.i = _place(dev, axes)
        ctx.causal, ctx.layout, ctx.scale, ctx.sizes = causal, layout, scale, sizes
        ctx.save_for_backward(q, k, v, out, lse)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dev, axes, n, i, causal, scale, sizes = ctx.dev, ctx.axes, ctx.n, ctx.i, ctx.causal, ctx.scale, ctx.sizes
        h, sk, hkv = q.shape[1], k.shape[2], k.shape[1]
        g = h // hkv
        acc = torch.promote_types(q.dtype, torch.float32)
        padded = min(sizes) != max(sizes)
        with torch._C.DisableTorchFunction():
            # the kernels record no graph: a backward that is itself differentiated (create_graph, torch.func)
            # takes the torch path, made of differentiable ops and collectives
            flash = None if torch.is_grad_enabled() else _flash(q, k, v)
            if flash is None:  # heads grouped [b, hkv, g, sq, ...], in the accumulation dtype
                qb, dob = q.unflatten(1, (hkv, g)).to(acc), dout.unflatten(1, (hkv, g)).to(acc)  # [b,hkv,g,sq,d]
                ob, lseb = out.unflatten(1, (hkv, g)).to(acc), lse.unflatten(1, (hkv, g))  # [b,hkv,g,sq(,d)]
                dlseb = None if dlse is None else dlse.unflatten(1, (hkv, g))  # [b, hkv, g, sq]

                def block(qr: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, dor: torch.Tensor, lr: torch.Tensor,
                          dr: torch.Tensor, diag: bool) -> Triple:  # fmt: skip
                    return _block_backward(qr, kb.to(acc), vb.to(acc), dor, lr, dr, scale, diag)

            else:  # the Triton kernels: [b, h, sq, ...] as they are; lse and delta contiguous rows, grads in acc
                qb, dob, ob, lseb, dlseb = q, dout, out.to(acc), lse, dlse

                def block(qr: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, dor: torch.Tensor, lr: torch.Tensor,
                          dr: torch.Tensor, diag: bool) -> Triple:  # fmt: skip
                    with _on_device(qr):
                        return flash._backward(qr, kb, vb, None, lr.contiguous(), dor, None, diag, scale,
                                               delta=dr.contiguous(), grad_dtype=acc)  # fmt: skip

            delta = (dob.to(acc) * ob).sum(-1)  # [b, h(kv, g), sq]: rowsum(dout * out)
            if dlseb is not None:  # d lse / d scores = p: ds = p (dp - delta + dlse)
                delta = delta - dlseb.to(acc)
            dq = torch.zeros(qb.shape, dtype=acc, device=qb.device)  # [b, h(kv, g), sq, d]
            kv = _padded(torch.stack((k, v)), sizes)  # [2, b, hkv, sk(max), d]
            dkv = kv.new_zeros(kv.shape, dtype=acc)  # [2, b, hkv, sk, d]: the dk/dv of the block held, travelling
            for step in range(n):
                if step:
                    kv, dkv = _rotate(kv, dkv, dev, axes, n)  # both from device i-1
                j = (i - step) % n
                plan = block_plan(i, j, causal, ctx.layout, sizes)
                if plan is None:
                    continue
                rows, cols, diag = plan
                cols = _cols(cols, sizes[j], padded)
                dq_b, dk_b, dv_b = block(qb[..., rows, :], kv[0, :, :, cols], kv[1, :, :, cols],
                                         dob[..., rows, :], lseb[..., rows], delta[..., rows], diag)  # fmt: skip
                dq[..., rows, :] += dq_b
                # out of place: dkv may share its storage with the k/v received with it (one message), which the
                # graph of this backward keeps, when it is differentiated (grad of grad)
                upd = torch.stack((dk_b, dv_b))  # 2 x [b, hkv, sk or c, d] -> [2, b, hkv, sk or c, d]
                if cols == _ALL:
                    dkv = dkv + upd
                else:  # zigzag, j < i: the block's first chunk (or an uneven block's own columns)
                    dkv = torch.cat((dkv[:, :, :, cols] + upd, dkv[:, :, :, cols.stop :]), dim=3)  # -> [2,b,hkv,sk,d]
            if n > 1:  # the block held now is device i+1's, complete: one more hop takes it home
                dkv = call(Ppermute, dkv, dev, axes, _shift(n))  # [2,b,hkv,sk,d] -> [2,b,hkv,sk,d]
            if padded:
                dkv = dkv[:, :, :, :sk]  # [2, b, hkv, max L, d] -> [2, b, hkv, L_i, d]: this block's own rows
            dq_out = (dq if flash is not None else dq.flatten(1, 2)).to(q.dtype)  # -> [b, h, sq, d]
            return None, None, dq_out, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> ModuleType | None:
    """:mod:`funcshard.ops.triton` where its kernels compute the ring's blocks (CUDA, inputs they take), else None."""
    from .local import flash_kernels  # (here: the attention module imports the kernels', which imports this)

    return flash_kernels(q, k, v)


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The kernels launch on the current CUDA device: make it ``t``'s (a process may drive several GPUs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _rotate(
    kv: torch.Tensor, dkv: torch.Tensor, dev: Any, axes: tuple[str, ...], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring step of a k/v block and its dk/dv accumulator: one message when their dtypes agree."""
    if kv.dtype == dkv.dtype:
        both = call(Ppermute, torch.cat((kv, dkv)), dev, axes, _shift(n))  # [4,b,hkv,sk,d] -> same
        return both[:2], both[2:]
    kv = call(Ppermute, kv, dev, axes, _shift(n))  # [2, b, hkv, sk, d] -> [2, b, hkv, sk, d]
    dkv = call(Ppermute, dkv, dev, axes, _shift(n))  # [2, b, hkv, sk, d] (float32) -> same
    return kv, dkv


# --- the ring differentiated by autograd (for the transforms the Function has no rule for) --------------------


def ring_through_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str | tuple[str, ...],
    causal: bool,
    layout: str,
    scale: float | None,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The forward of :class:`RingAttention` with differentiable collectives (:func:`funcshard.ppermute`):
    autograd differentiates through the ring, each ppermute's transpose carrying the k/v cotangent back
    (``n - 1`` more ppermutes), at the memory of every received block and the per-step scores.

    Example:
        >>> # inside shard_map: out = ring_through_autograd(q, k, v, "cp", True, "zigzag", None, (4, 4))
        >>> block_plan(i=0, j=1, causal=True, layout="zigzag", sizes=(4, 4))  # the second query chunk, the whole block
        (slice(2, None, None), slice(None, None, None), False)
    """
    n = lax.axis_size(axis)
    i = axis_index_int(axis)
    shift = list(_shift(n))
    sizes = [k.shape[2]] * n if sizes is None else sizes  # (None: every device holds this one's length)
    kv = torch.stack((k, v))  # 2 x [b, hkv, s/n, d] -> [2, b, hkv, s/n, d]: one message per step
    o, lse = attention(q, k, v, causal=causal, return_lse=True, scale=scale)  # [b, h, s/n, d], [b, h, s/n]
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = o.to(acc), lse.to(acc)
    for step in range(1, n):
        kv = lax.ppermute(kv, axis, shift)  # [2, b, hkv, L_i, d] -> [2, b, hkv, L_j, d], from device i-1 (j)
        plan = block_plan(i, (i - step) % n, causal, layout, sizes)
        if plan is None:
            # ...but keep the block in the graph (a zero-size slice, no work): every device must run the
            # backward ppermute of every step, or the ring's backward deadlocks on the devices that used it
            out = out + kv.narrow(-1, 0, 0).sum()  # [2, b, hkv, s/n, 0] -> [], exactly 0
            continue
        rows, cols, _ = plan
        o, lo = attention(q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], return_lse=True, scale=scale)
        o, lo = o.to(acc), lo.to(acc)  # [b, h, rows, d], [b, h, rows]
        new = torch.logaddexp(lse[:, :, rows], lo)  # [b, h, rows]
        part = out[:, :, rows] * (lse[:, :, rows] - new).exp().unsqueeze(-1) + o * (lo - new).exp().unsqueeze(-1)
        if rows == _ALL:
            out, lse = part, new
        else:  # zigzag, j > i: rows c: of [b, h, s/n, d]
            out = torch.cat((out[:, :, : rows.start], part), dim=2)  # [b, h, c, d] + [b, h, c, d] -> [b, h, s/n, d]
            lse = torch.cat((lse[:, :, : rows.start], new), dim=2)  # [b, h, c] + [b, h, c] -> [b, h, s/n]
    return out.to(q.dtype)
