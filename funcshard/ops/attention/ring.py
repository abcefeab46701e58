"""Ring attention (context parallelism): the sequence is split over a mesh axis, k/v blocks travel the ring.

Each device holds a block of queries and a block of keys/values. In ``n - 1`` steps the k/v blocks rotate
around the ring with :func:`funcshard.ppermute` (k and v packed into one message per step); at every step
each device attends its queries to the block it holds and merges the partial result into its running
output with the log-sum-exp rule, in float32. The result equals softmax attention over the whole sequence.

Layouts of the sequence over the axis (``n`` devices):

- ``"contiguous"``: device ``i`` holds chunk ``i`` of ``n``. Simple, but under a causal mask device ``n-1``
  does ``n`` times the work of device ``0``.
- ``"zigzag"`` (load-balanced, the default): the sequence is cut into ``2n`` chunks and device ``i`` holds
  chunks ``i`` and ``2n-1-i``, concatenated. Every off-diagonal step then costs exactly half a block on every
  device. Lay data out with :func:`zigzag_split` inside ``shard_map`` (from a replicated value), or outside
  with :func:`zigzag_indices` and an ordinary ``P(None, None, "cp")`` spec; undo it with
  :func:`zigzag_merge` / :func:`zigzag_inverse_indices`. Give RoPE the positions of
  :func:`zigzag_positions`.

The backward is hand-written (FlashAttention-2's, blockwise, as ring attention implementations do), so
memory per device stays O(s/n): between the forward and the backward only this device's q, k, v, the output
and the log-sum-exp of its rows are kept, nothing per ring step. The backward sends the k/v blocks around the
ring once more, recomputes each block's probabilities from q and the saved log-sum-exp, keeps dq here and
passes each block's dk/dv accumulator along with the block, so that after ``n - 1`` steps and one last hop
every device holds the dk/dv of its own block. It works under ``torch.autograd``, ``fs.value_and_grad`` and
``torch.func.grad`` (grad of grad too); under ``torch.vmap``, ``jvp`` and forward-mode AD, for which it has no
rule, autograd differentiates through the ring instead (at the memory of every received block).

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.ops import attention, ring_attention, zigzag_indices, zigzag_inverse_indices
    >>> mesh = fs.make_mesh({"cp": 2}, backend="sim")
    >>> q = k = v = torch.randn(1, 2, 8, 4)  # [b, h, s, d]
    >>> idx = zigzag_indices(8, 2)  # zigzag order of the 8 positions
    >>> f = fs.shard_map(ring_attention, mesh=mesh, in_specs=(P(None, None, "cp"),) * 3,
    ...                  out_specs=P(None, None, "cp"))
    >>> out = fs.device_get(f(q[:, :, idx], k[:, :, idx], v[:, :, idx]))[:, :, zigzag_inverse_indices(8, 2)]
    >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5)
    True
"""

from __future__ import annotations

import math

import torch

from ... import lax
from ...extend import ShardingError, bind, split_invariant
from ._ring_kernel import RingAttention, needs_autograd_ring, ring_through_autograd
from .local import attention

__all__ = [
    "ring_attention",
    "zigzag_indices",
    "zigzag_inverse_indices",
    "zigzag_merge",
    "zigzag_positions",
    "zigzag_split",
]

LAYOUTS = ("zigzag", "contiguous")


# --- the zigzag layout ----------------------------------------------------------------------------------------


def _check_zigzag(seq_len: int, n: int, fn: str, where: str = "") -> int:
    """The chunk length ``seq_len / 2n``, or a ShardingError saying how to fix the length."""
    if n < 1 or seq_len % (2 * n):
        raise ShardingError(
            f"{fn}: the zigzag layout cuts the sequence into 2n = {2 * n} chunks (n = {n}), but the sequence"
            f"{where} has length {seq_len}, not divisible by {2 * n}; pad it to a multiple of {2 * n} or use the "
            f"contiguous layout."
        )
    return seq_len // (2 * n)


def zigzag_indices(seq_len: int, n: int) -> torch.Tensor:
    """Positions in zigzag order: ``x.index_select(dim, zigzag_indices(s, n))`` lays a full sequence out so
    that an ordinary ``n``-way split of ``dim`` gives device ``i`` chunks ``i`` and ``2n-1-i`` (of ``2n``).

    Args:
        seq_len: the full sequence length, a multiple of ``2n``.
        n: the number of devices on the context-parallel axis.

    Returns:
        ``[seq_len]`` int64 positions.

    Raises:
        ShardingError: ``seq_len`` not divisible by ``2n``.

    Example:
        >>> zigzag_indices(8, 2)  # chunks of 2: device 0 gets chunks 0, 3; device 1 gets chunks 1, 2
        tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    c = _check_zigzag(seq_len, n, "zigzag_indices")
    chunks = torch.arange(seq_len).view(2 * n, c)  # [2n, c]
    order = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return chunks[order].reshape(-1)  # [2n, c] -> [s]


def zigzag_inverse_indices(seq_len: int, n: int) -> torch.Tensor:
    """The inverse permutation of :func:`zigzag_indices`: ``y.index_select(dim, zigzag_inverse_indices(s, n))``
    puts a zigzag-ordered sequence back in order.

    Example:
        >>> zigzag_inverse_indices(8, 2)
        tensor([0, 1, 4, 5, 6, 7, 2, 3])
    """
    return torch.argsort(zigzag_indices(seq_len, n))


def zigzag_positions(seq_len: int, n: int, index: int | torch.Tensor) -> torch.Tensor:
    """The global positions device ``index`` holds under the zigzag layout (e.g. for rotary embeddings).

    Args:
        seq_len: the full sequence length, a multiple of ``2n``.
        n: the number of devices on the context-parallel axis.
        index: the device's index on the axis, in ``[0, n)``: an int, or the 0-dim tensor of
            :func:`funcshard.axis_index` (the positions then vary over its axis, as check_vma tracks).

    Returns:
        ``[seq_len / n]`` int64 positions.

    Raises:
        ShardingError: ``seq_len`` not divisible by ``2n``, or ``index`` outside ``[0, n)``.

    Example:
        >>> zigzag_positions(8, 2, 1)
        tensor([2, 3, 4, 5])
        >>> # inside shard_map: pos = zigzag_positions(s, fs.axis_size("cp"), fs.axis_index("cp"))
    """
    table = zigzag_indices(seq_len, n).view(n, seq_len // n)  # [s] -> [n, s/n]: row i, device i's positions
    i = int(index)
    if not 0 <= i < n:
        raise ShardingError(
            f"zigzag_positions: device index {i} is outside [0, {n}) for n = {n} devices; pass "
            f"fs.axis_index(axis) of the context-parallel axis, and its size as n."
        )
    if isinstance(index, torch.Tensor):  # indexed by the tensor itself: its varying axes pass to the result
        return table[index.to(table.device)]  # [n, s/n] -> [s/n]
    return table[i]  # [n, s/n] -> [s/n]


def zigzag_split(x: torch.Tensor, axis: str | None, dim: int) -> torch.Tensor:
    """This device's zigzag chunks (``i`` and ``2n-1-i`` of ``2n``, concatenated) of a value replicated over
    ``axis``: a local slice (forward, no communication); all-gather of the cotangent chunks back into place
    (backward).

    Args:
        x: the full sequence along ``dim``, invariant over ``axis``.
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, ``x`` itself.
        dim: the sequence dim.

    Returns:
        ``x`` with ``dim`` of length ``s / n``, varying over ``axis``.

    Raises:
        ShardingError: ``x.shape[dim]`` not divisible by ``2n``.

    Example:
        >>> # q = zigzag_split(q_full, "cp", dim=2)  # [b, h, s, d] -> [b, h, s/n, d]
        >>> x = torch.randn(1, 2, 8, 4)
        >>> zigzag_split(x, None, dim=2) is x
        True
    """
    if axis is None:
        return x
    n = lax.axis_size(axis)
    d = dim % x.dim()
    _check_zigzag(x.shape[d], n, "zigzag_split", f" (dim {d} of shape {tuple(x.shape)})")
    idx = zigzag_indices(x.shape[d], n).to(x.device)
    x = x.index_select(d, idx)  # [.., s, ..] -> [.., s, ..] in zigzag order (local, no communication)
    return split_invariant(x, axis, dim=d)  # [.., s, ..] -> [.., s/n, ..]; backward all-gathers


def zigzag_merge(x: torch.Tensor, axis: str | None, dim: int) -> torch.Tensor:
    """The inverse of :func:`zigzag_split`: all-gather the zigzag chunks and put them in order (forward, the
    result invariant over ``axis``); this device's chunks of the cotangent (backward, no communication).

    Args:
        x: this device's zigzag chunks along ``dim``, ``s / n`` long.
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, ``x`` itself.
        dim: the sequence dim.

    Returns:
        The full sequence along ``dim``, invariant over ``axis``.

    Example:
        >>> # out_full = zigzag_merge(out, "cp", dim=2)  # [b, h, s/n, d] -> [b, h, s, d]
        >>> x = torch.randn(1, 2, 8, 4)
        >>> zigzag_merge(x, None, dim=2) is x
        True
    """
    if axis is None:
        return x
    n = lax.axis_size(axis)
    d = dim % x.dim()
    seq = x.shape[d] * n
    _check_zigzag(seq, n, "zigzag_merge", f" (dim {d}: {x.shape[d]} per device x {n})")
    y = lax.all_gather_invariant(x, axis, dim=d, tiled=True)  # [.., s/n, ..] -> [.., s, ..] in zigzag order
    return y.index_select(d, zigzag_inverse_indices(seq, n).to(y.device))  # [.., s, ..] -> [.., s, ..] in order


# --- ring attention -------------------------------------------------------------------------------------------


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, fn: str, split: bool = True
) -> None:
    """ShardingError naming the shapes and the fix; ``split=False``: the sequence is not split (no parity rule)."""
    with torch._C.DisableTorchFunction():  # shape reads only: none through the vma mode (~20 dispatches a call)
        _check_shapes(q, k, v, causal, layout, fn, split)


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, fn: str, split: bool
) -> None:
    """:func:`_check`'s body (with torch functions off)."""
    if layout not in LAYOUTS:
        raise ShardingError(f"{fn}: unknown layout {layout!r}; use one of {LAYOUTS}.")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ShardingError(
            f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: need local sequence "
            f"shards [b, h, s/n, d] for q and [b, hkv, s/n, d] for k and v."
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ShardingError(
            f"{fn}: q has {q.shape[1]} heads and k/v {k.shape[1]}; q heads must be a multiple of k/v heads (GQA)."
        )
    if causal and k.shape[2] != q.shape[2]:
        raise ShardingError(
            f"{fn}(causal=True): q holds {q.shape[2]} positions per device but k/v {k.shape[2]}; shard q, k and v "
            f"the same way along the sequence."
        )
    if split and causal and layout == "zigzag" and q.shape[2] % 2:
        raise ShardingError(
            f"{fn}(layout='zigzag'): each device must hold two equal chunks, but it holds {q.shape[2]} positions "
            f"(odd); make the sequence a multiple of 2 x the axis size, or use layout='contiguous'."
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    axis: str | None = "cp",
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention over a sequence sharded on ``axis``: k/v blocks rotate around the ring.

    Forward: ``n - 1`` ppermutes of the packed ``[2, b, hkv, s/n, d]`` k/v block, each device sending to
    its successor; per step one local attention with log-sum-exp, merged in float32. Saved for the
    backward: q, k, v, the output and the ``[b, h, s/n]`` log-sum-exp, O(s/n) whatever ``n``. Backward:
    ``n - 1`` ring steps of the k/v block with its dk/dv accumulator (one ``[4, b, hkv, s/n, d]`` message
    for float32 / float64 inputs, two otherwise), the probabilities recomputed, then one hop of dk/dv home.

    With ``causal=True`` the mask follows the global positions of ``layout``. Device ``i`` holding the block
    of device ``j`` computes: ``j == i``: causal attention on its own block; ``"contiguous"``: ``j < i`` full,
    ``j > i`` nothing; ``"zigzag"``: ``j < i`` all queries against the first chunk of the block (its second
    chunk lies in the future of both query chunks), ``j > i`` the second query chunk against the whole block
    (the first query chunk precedes it all). The layout is irrelevant when ``causal=False``.

    Args:
        q: ``[b, h, s/n, d]`` this device's queries.
        k: ``[b, hkv, s/n, d]`` this device's keys (``h`` a multiple of ``hkv``: grouped-query attention).
        v: ``[b, hkv, s/n, d]`` this device's values.
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, plain :func:`attention`
            (on one device both layouts are the sequence in order).
        causal: mask each query's future positions (global positions, per ``layout``).
        layout: ``"zigzag"`` (device ``i`` holds chunks ``i`` and ``2n-1-i`` of ``2n``) or ``"contiguous"``
            (chunk ``i`` of ``n``).
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``[b, h, s/n, d]`` this device's rows of the attention output, in ``q``'s dtype, varying over ``axis``.

    Raises:
        ShardingError: an unknown layout, shapes that do not fit, or an odd local length under zigzag.

    Example:
        >>> # inside shard_map over {"cp": 4}, q/k/v with spec P(None, None, "cp") in zigzag order:
        >>> # out = ring_attention(q, k, v, axis="cp")  # [b, h, s/4, d] -> [b, h, s/4, d]
        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> torch.equal(ring_attention(q, k, v, axis=None), attention(q, k, v, causal=True))  # no axis: local
        True
    """
    _check(q, k, v, causal, layout, "ring_attention", split=axis is not None)
    if axis is None:
        return attention(q, k, v, causal=causal, scale=scale)  # [b, h, s, d] x [b, hkv, s, d] -> [b, h, s, d]
    if needs_autograd_ring(q, k, v):  # vmap / jvp / forward-mode AD: the Function has no rule for them
        return ring_through_autograd(q, k, v, axis, causal, layout, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # the ring: [b, h, s/n, d] x 2 x [b, hkv, s/n, d] -> out [b, h, s/n, d], lse [b, h, s/n] (unused); bind makes
    # k/v vary over axis first (they enter the ppermutes), q/k/v agree under check_vma, and it tags the results
    ys = bind(RingAttention, q, k, v, axis=axis, name="ring_attention", params=(causal, layout, scale))
    assert ys is not None  # (its rule never declines)
    return ys[0]
