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
  device. Any length: device ``i`` keeps its ``torch.tensor_split`` length ``L_i``, its chunks ``ceil(L_i/2)``
  and ``floor(L_i/2)`` long (:func:`zigzag_chunk_sizes`); the causal work per device (:func:`ring_work`) is then
  equal up to one query row of the sequence. Lay data out with :func:`zigzag_split` inside ``shard_map``
  (from a replicated value), or outside with :func:`zigzag_indices` and an ordinary ``P(None, None, "cp")``
  spec; undo it with :func:`zigzag_merge` / :func:`zigzag_inverse_indices`. Give RoPE the positions of
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
from collections.abc import Sequence

import torch

from ... import lax
from ...extend import ShardingError, axis_index_int, bind, block_sizes, split_invariant
from ...extend import split_sizes as _split_sizes
from ._ring_kernel import Plan, RingAttention, block_plan, needs_autograd_ring, ring_through_autograd
from .local import attention

__all__ = [
    "layout_positions",
    "ring_attention",
    "ring_work",
    "split_sizes",
    "zigzag_chunk_sizes",
    "zigzag_indices",
    "zigzag_inverse_indices",
    "zigzag_merge",
    "zigzag_positions",
    "zigzag_split",
]

LAYOUTS = ("zigzag", "contiguous")


# --- the zigzag layout ----------------------------------------------------------------------------------------


def split_sizes(seq_len: int, n: int) -> list[int]:
    """Each device's local length when ``seq_len`` positions are split over ``n`` devices as
    ``torch.tensor_split`` splits them (the first ``seq_len % n`` devices hold one more).

    Example:
        >>> split_sizes(30, 4)
        [8, 8, 7, 7]
    """
    return list(_split_sizes(seq_len, n))  # (the core's tuple, as a list)


def zigzag_chunk_sizes(seq_len: int, n: int) -> list[int]:
    """The lengths of the ``2n`` zigzag chunks, in sequence order. Device ``i`` holds chunks ``i`` and ``2n-1-i``,
    whose lengths sum to its ``torch.tensor_split`` length ``L_i`` (so its local length is the contiguous
    layout's, no padding): chunk ``i`` is ``ceil(L_i / 2)`` long, chunk ``2n-1-i`` ``floor(L_i / 2)``. Where
    ``2n`` divides ``seq_len`` every chunk is ``seq_len / 2n`` long.

    Args:
        seq_len: the full sequence length (any, >= 0).
        n: the number of devices on the context-parallel axis.

    Returns:
        ``2n`` ints summing to ``seq_len``.

    Raises:
        ShardingError: ``n < 1`` or a negative ``seq_len``.

    Example:
        >>> zigzag_chunk_sizes(30, 4)  # local lengths 8, 8, 7, 7: chunks 4+4, 4+4, 4+3, 4+3
        [4, 4, 4, 4, 3, 3, 4, 4]
    """
    _check_zigzag(seq_len, n, "zigzag_chunk_sizes")
    return _chunks_of(split_sizes(seq_len, n))


def _chunks_of(sizes: Sequence[int]) -> list[int]:
    """The ``2n`` chunk lengths, in sequence order, of devices holding ``sizes`` positions (the zigzag rule)."""
    return [(s + 1) // 2 for s in sizes] + [s // 2 for s in reversed(sizes)]


def _check_zigzag(seq_len: int, n: int, fn: str) -> None:
    """ShardingError for a device count or length no layout has."""
    if n < 1 or seq_len < 0:
        raise ShardingError(
            f"{fn}: the zigzag layout needs n >= 1 devices and a length >= 0, found n = {n}, length {seq_len}; pass "
            f"the context-parallel axis' size (fs.axis_size(axis)) as n."
        )


def _table(sizes: Sequence[int], layout: str) -> torch.Tensor:
    """``[n, max(sizes)]`` int64: row ``i`` the global positions device ``i`` holds under ``layout`` (devices
    holding ``sizes`` positions), padded with -1. Made from Python lists in one op (it runs in every layer)."""
    n, m = len(sizes), max(sizes, default=0)
    if layout == "contiguous":
        starts = [sum(sizes[:i]) for i in range(n)]
        rows = [list(range(starts[i], starts[i] + sizes[i])) for i in range(n)]
    else:
        chunks = _chunks_of(sizes)
        starts = [sum(chunks[:c]) for c in range(2 * n)]
        rows = [
            list(range(starts[i], starts[i] + chunks[i]))  # chunk i
            + list(range(starts[2 * n - 1 - i], starts[2 * n - 1 - i] + chunks[2 * n - 1 - i]))  # chunk 2n-1-i
            for i in range(n)
        ]
    return torch.tensor([r + [-1] * (m - len(r)) for r in rows], dtype=torch.int64).view(n, m)  # [n, m]


def zigzag_indices(seq_len: int, n: int) -> torch.Tensor:
    """Positions in zigzag order: ``x.index_select(dim, zigzag_indices(s, n))`` lays a full sequence out so
    that an ordinary ``n``-way split of ``dim`` (``torch.tensor_split``'s where ``n`` does not divide it) gives
    device ``i`` chunks ``i`` and ``2n-1-i`` (of ``2n``; lengths :func:`zigzag_chunk_sizes`).

    Args:
        seq_len: the full sequence length (any: uneven lengths take :func:`zigzag_chunk_sizes`' chunks).
        n: the number of devices on the context-parallel axis.

    Returns:
        ``[seq_len]`` int64 positions.

    Raises:
        ShardingError: ``n < 1``.

    Example:
        >>> zigzag_indices(8, 2)  # chunks of 2: device 0 gets chunks 0, 3; device 1 gets chunks 1, 2
        tensor([0, 1, 6, 7, 2, 3, 4, 5])
        >>> zigzag_indices(7, 2)  # local lengths 4, 3: chunks 2, 2 | 1, 2
        tensor([0, 1, 5, 6, 2, 3, 4])
    """
    _check_zigzag(seq_len, n, "zigzag_indices")
    table = _table(split_sizes(seq_len, n), "zigzag")  # [n, m], -1 padded
    return table[table >= 0]  # [n, m] -> [s], row by row


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
        seq_len: the full sequence length (any; see :func:`zigzag_chunk_sizes`).
        n: the number of devices on the context-parallel axis.
        index: the device's index on the axis, in ``[0, n)``: an int, or the 0-dim tensor of
            :func:`funcshard.axis_index` (the positions then vary over its axis, as check_vma tracks).

    Returns:
        ``[L_i]`` int64 positions, ``L_i`` the device's ``torch.tensor_split`` length.

    Raises:
        ShardingError: ``n < 1``, or ``index`` outside ``[0, n)``.

    Example:
        >>> zigzag_positions(8, 2, 1)
        tensor([2, 3, 4, 5])
        >>> zigzag_positions(7, 2, 1)  # chunks 1 and 2 of lengths 2, 2, 1, 2
        tensor([2, 3, 4])
        >>> # inside shard_map: pos = zigzag_positions(s, fs.axis_size("cp"), fs.axis_index("cp"))
    """
    _check_zigzag(seq_len, n, "zigzag_positions")
    return layout_positions(split_sizes(seq_len, n), index, "zigzag")


def layout_positions(sizes: Sequence[int], index: int | torch.Tensor, layout: str = "zigzag") -> torch.Tensor:
    """The global positions device ``index`` holds when the devices hold ``sizes`` positions each (in axis
    order) laid out by ``layout`` (``"zigzag"``: :func:`zigzag_chunk_sizes`' rule on ``sizes``; ``"contiguous"``:
    in order): what RoPE needs inside a context-parallel model.

    Args:
        sizes: every device's local sequence length, in axis order (e.g. :func:`funcshard.block_sizes`').
        index: the device's index, an int or the 0-dim tensor of :func:`funcshard.axis_index`.
        layout: ``"zigzag"`` or ``"contiguous"``.

    Returns:
        ``[sizes[index]]`` int64 positions (varying over the axis of a tensor ``index``).

    Raises:
        ShardingError: an unknown layout or an index outside ``[0, len(sizes))``.

    Example:
        >>> layout_positions([8, 8, 7, 7], 2, "zigzag")
        tensor([ 8,  9, 10, 11, 19, 20, 21])
        >>> layout_positions([8, 8, 7, 7], 2, "contiguous")
        tensor([16, 17, 18, 19, 20, 21, 22])
    """
    if layout not in LAYOUTS:
        raise ShardingError(f"layout_positions: unknown layout {layout!r}; use one of {LAYOUTS}.")
    n = len(sizes)
    table = _table(sizes, layout)  # [n, m]: row i, device i's positions
    even = min(sizes, default=0) == max(sizes, default=0)
    if isinstance(index, torch.Tensor) and even:  # no value read (a meta index of the abstract backend too)
        # [n, m] -> [1, m] -> [m], selected by the tensor itself: its varying axes pass to the result
        return table.to(index.device).index_select(0, index.reshape(1)).squeeze(0)
    i = int(index)
    if not 0 <= i < n:
        raise ShardingError(
            f"zigzag_positions: device index {i} is outside [0, {n}) for n = {n} devices; pass "
            f"fs.axis_index(axis) of the context-parallel axis, and its size as n."
        )
    if isinstance(index, torch.Tensor):  # indexed by the tensor itself: its varying axes pass to the result
        return table.to(index.device)[index][: sizes[i]]  # [n, m] -> [m] -> [L_i]
    return table[i, : sizes[i]]  # [n, m] -> [L_i]


def ring_work(seq_len: int | Sequence[int], n: int, layout: str = "zigzag", *, causal: bool = True) -> list[int]:
    """The attention work of each device of a ring: the query-key pairs it computes (the area of the blocks
    :func:`ring_attention`'s plan gives it, the unmasked triangle of a diagonal block), per device in axis order.
    Under ``causal`` the ring computes exactly the visible pairs, so the numbers sum to ``s (s + 1) / 2``.

    Args:
        seq_len: the full sequence length (split as ``torch.tensor_split`` does), or every device's local length.
        n: the number of devices on the axis.
        layout: ``"zigzag"`` or ``"contiguous"``.
        causal: the causal mask (``False``: every device computes ``L_i x s``).

    Returns:
        ``n`` ints.

    Raises:
        ShardingError: an unknown layout, or ``n`` that does not match the given lengths.

    Example:
        >>> ring_work(32, 4, "contiguous")  # device 3 does 6.3x device 0's work
        [36, 100, 164, 228]
        >>> ring_work(32, 4, "zigzag")
        [132, 132, 132, 132]
    """
    sizes = split_sizes(seq_len, n) if isinstance(seq_len, int) else [int(s) for s in seq_len]
    if layout not in LAYOUTS or len(sizes) != n:
        raise ShardingError(
            f"ring_work: layout {layout!r} with {len(sizes)} lengths for n = {n} devices; use one of {LAYOUTS} and "
            f"one length per device."
        )
    return [sum(_area(block_plan(i, j, causal, layout, sizes), sizes[i], sizes[j]) for j in range(n)) for i in range(n)]


def _area(plan: Plan | None, rows: int, cols: int) -> int:
    """The query-key pairs of one planned block (``rows`` x ``cols`` before the plan's slices)."""
    if plan is None:
        return 0
    r = len(range(rows)[plan[0]])
    c = len(range(cols)[plan[1]])
    return r * (r + 1) // 2 if plan[2] else r * c


def zigzag_split(x: torch.Tensor, axis: str | None, dim: int) -> torch.Tensor:
    """This device's zigzag chunks (``i`` and ``2n-1-i`` of ``2n``, concatenated) of a value replicated over
    ``axis``: a local slice (forward, no communication); all-gather of the cotangent chunks back into place
    (backward). Any length: uneven ones take :func:`zigzag_chunk_sizes`' chunks (device ``i`` then holds its
    ``torch.tensor_split`` length).

    Args:
        x: the full sequence along ``dim``, invariant over ``axis``.
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, ``x`` itself.
        dim: the sequence dim.

    Returns:
        ``x`` with ``dim`` of length ``L_i`` (``s / n`` where ``n`` divides ``s``), varying over ``axis``.

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
    idx = zigzag_indices(x.shape[d], n).to(x.device)
    x = x.index_select(d, idx)  # [.., s, ..] -> [.., s, ..] in zigzag order (local, no communication)
    return split_invariant(x, axis, dim=d)  # [.., s, ..] -> [.., L_i, ..] (tensor_split's); backward all-gathers


def zigzag_merge(x: torch.Tensor, axis: str | None, dim: int) -> torch.Tensor:
    """The inverse of :func:`zigzag_split`: all-gather the zigzag chunks and put them in order (forward, the
    result invariant over ``axis``); this device's chunks of the cotangent (backward, no communication).

    Args:
        x: this device's zigzag chunks along ``dim``, ``L_i`` long (``torch.tensor_split``'s lengths of the
            sequence, as :func:`zigzag_split` gives them).
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, ``x`` itself.
        dim: the sequence dim.

    Returns:
        The full sequence along ``dim``, invariant over ``axis``.

    Raises:
        ShardingError: local lengths that are not ``torch.tensor_split``'s of their sum.

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
    sizes = list(block_sizes(x.shape[d], axis))  # every device's length (learnt only in an uneven call)
    seq = sum(sizes)
    if sizes != split_sizes(seq, n):
        raise ShardingError(
            f"zigzag_merge: the devices of {axis!r} hold {sizes} positions along dim {d}, not torch.tensor_split's "
            f"{split_sizes(seq, n)} of {seq}; lay the sequence out with zigzag_split (or an ordinary split of "
            f"zigzag_indices' order)."
        )
    y = lax.all_gather_invariant(x, axis, dim=d, tiled=True)  # [.., L_i, ..] -> [.., s, ..] in zigzag order
    return y.index_select(d, zigzag_inverse_indices(seq, n).to(y.device))  # [.., s, ..] -> [.., s, ..] in order


# --- ring attention -------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, fn: str) -> None:
    """ShardingError naming the shapes and the fix."""
    with torch._C.DisableTorchFunction():  # shape reads only: none through the vma mode (~20 dispatches a call)
        _check_shapes(q, k, v, causal, layout, fn)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, fn: str) -> None:
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


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    axis: str | None = "cp",
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
    sizes: Sequence[int] | None = None,
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

    Uneven sequences: the devices may hold different lengths ``L_i`` (``torch.tensor_split``'s blocks, e.g. 30
    positions on 4 devices: 8, 8, 7, 7). Under zigzag device ``i``'s first chunk is ``ceil(L_i / 2)`` long and
    its second ``floor(L_i / 2)`` (:func:`zigzag_chunk_sizes`; the rule holds for any chunk lengths, so odd local
    lengths are fine too). The k/v blocks then travel padded to the longest and are cut on arrival.

    Args:
        q: ``[b, h, L_i, d]`` this device's queries.
        k: ``[b, hkv, L_i, d]`` this device's keys (``h`` a multiple of ``hkv``: grouped-query attention).
        v: ``[b, hkv, L_i, d]`` this device's values.
        axis: the context-parallel mesh axis; ``None``: the sequence is not split, plain :func:`attention`
            (on one device both layouts are the sequence in order).
        causal: mask each query's future positions (global positions, per ``layout``).
        layout: ``"zigzag"`` (device ``i`` holds chunks ``i`` and ``2n-1-i`` of ``2n``) or ``"contiguous"``
            (chunk ``i`` of ``n``).
        scale: score scale, default ``1/sqrt(d)``.
        sizes: every device's local k/v length ``L_j`` (q's too under ``causal``) in axis order, if known;
            default: learnt with :func:`funcshard.extend.block_sizes` (no communication unless the call has an
            uneven argument).

    Returns:
        ``[b, h, L_i, d]`` this device's rows of the attention output, in ``q``'s dtype, varying over ``axis``.

    Raises:
        ShardingError: an unknown layout, shapes that do not fit, or ``sizes`` that do not hold this device's.

    Example:
        >>> # inside shard_map over {"cp": 4}, q/k/v with spec P(None, None, "cp") in zigzag order:
        >>> # out = ring_attention(q, k, v, axis="cp")  # [b, h, s/4, d] -> [b, h, s/4, d]
        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> torch.equal(ring_attention(q, k, v, axis=None), attention(q, k, v, causal=True))  # no axis: local
        True
    """
    _check(q, k, v, causal, layout, "ring_attention")
    if axis is None:
        return attention(q, k, v, causal=causal, scale=scale)  # [b, h, s, d] x [b, hkv, s, d] -> [b, h, s, d]
    lengths = _sizes(k, axis, sizes)  # the k/v blocks' (under causal, q's too)
    if needs_autograd_ring(q, k, v):  # vmap / jvp / forward-mode AD: the Function has no rule for them
        return ring_through_autograd(q, k, v, axis, causal, layout, scale, lengths)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # the ring: [b, h, s/n, d] x 2 x [b, hkv, s/n, d] -> out [b, h, s/n, d], lse [b, h, s/n] (unused); bind makes
    # k/v vary over axis first (they enter the ppermutes), q/k/v agree under check_vma, and it tags the results
    params = (causal, layout, scale, lengths)
    ys = bind(RingAttention, q, k, v, axis=axis, name="ring_attention", params=params)
    assert ys is not None  # (its rule never declines)
    return ys[0]


def _sizes(k: torch.Tensor, axis: str, sizes: Sequence[int] | None) -> tuple[int, ...]:
    """Every device's local k/v length on ``axis``: ``sizes`` checked against this device's, or learnt."""
    with torch._C.DisableTorchFunction():
        here = k.shape[2]
    if sizes is None:
        return tuple(block_sizes(here, axis))  # [L_0, ..., L_{n-1}] (no exchange in an even call)
    lengths = tuple(int(s) for s in sizes)
    n = lax.axis_size(axis)
    if len(lengths) != n or lengths[axis_index_int(axis)] != here:
        raise ShardingError(
            f"ring_attention: sizes={list(lengths)} do not describe axis {axis!r} (size {n}) "
            f"where this device holds {here} positions; pass every device's local length in axis order, or "
            f"leave sizes=None to learn them."
        )
    return lengths
