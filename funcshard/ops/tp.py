"""Tensor, sequence and loss parallelism as pure functions over local shards (use inside ``shard_map``).

Weights use torch's ``F.linear`` layout ``[out_features, in_features]``: column-parallel is
``P("tp", None)`` (each device holds a block of output features), row-parallel ``P(None, "tp")`` (a block
of input features); an embedding table ``[vocab, dim]`` is vocab-parallel as ``P("tp", None)``.

Megatron's pairs: the input of a column-parallel linear is the identity-forward / all-reduce-backward
region (``pvary``); the output of a row-parallel linear is the all-reduce-forward / identity-backward one
(``psum``). With sequence parallelism the pair becomes all-gather / reduce-scatter over the sequence dim.

Every op takes ``axis=None`` to mean "not sharded": plain local math (``F.linear``, ``F.embedding``,
``F.cross_entropy``, the identity), with no collective. A model then calls the same op for every mesh and
takes the axis from its parallel plan (:class:`funcshard.models.ParallelPlan`), ``None`` where a role is off.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.ops import column_parallel_linear, row_parallel_linear
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> def mlp(x, w1, w2):
    ...     return row_parallel_linear(torch.relu(column_parallel_linear(x, w1)), w2)
    >>> x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    >>> f = fs.shard_map(mlp, mesh=mesh, in_specs=(P(), P("tp"), P(None, "tp")), out_specs=P())
    >>> torch.allclose(fs.device_get(f(x, w1, w2)), torch.relu(x @ w1.T) @ w2.T, atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import lax
from ..extend import (
    AllReduce,
    Audited,
    Op,
    ShardingError,
    axes_of,
    bind,
    block_sizes,
    call,
    current,
    known_vma,
    one_op,
    psum_owned,
    split_invariant,
    tracing,
    transforms_active,
)

__all__ = [
    "column_parallel_linear",
    "row_parallel_linear",
    "sequence_gather",
    "sequence_scatter",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]

Weights = torch.Tensor | Sequence[torch.Tensor]


def column_parallel_linear(
    x: torch.Tensor,
    w: Weights,
    b: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    *,
    axis: str | None = "tp",
    gather_dim: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``F.linear`` with the output features sharded over ``axis``.

    Forward: identity on ``x`` (replicated over ``axis``); backward: all-reduce of ``x``'s gradient.
    With ``gather_dim`` (sequence parallelism) ``x`` arrives sharded along that dim instead: all-gather
    forward, reduce-scatter backward. ``w`` may be a list of weights sharing the input (e.g. ``[wq, wk,
    wv]``): the input is made varying once, so the backward needs one collective, not one per weight.

    Args:
        x: ``[..., in]`` (or ``[..., s/n, ..., in]`` with ``gather_dim``).
        w: local ``[out/n, in]`` block(s) of a ``P(axis, None)`` weight.
        b: local ``[out/n]`` block(s) of a ``P(axis)`` bias, or None.
        axis: the tensor-parallel mesh axis; ``None``: not sharded, plain ``F.linear`` (``gather_dim`` ignored).
        gather_dim: the sequence dim of ``x`` under sequence parallelism.

    Returns:
        ``[..., out/n]``, varying over ``axis`` (a tuple when ``w`` is a list).

    Example:
        >>> # q, k, v = column_parallel_linear(h, [wq, wk, wv])  # [b, s, d] -> 3 x [b, s, heads/tp * hd]
        >>> import torch, torch.nn.functional as F
        >>> x, w = torch.randn(2, 8), torch.randn(4, 8)
        >>> torch.equal(column_parallel_linear(x, w, axis=None), F.linear(x, w))  # no axis: local math
        True
    """
    if axis is not None and gather_dim is None and b is None:
        ys = _column_overlapped(x, [w] if isinstance(w, torch.Tensor) else list(w), axis)
        if ys is not None:
            return ys[0] if isinstance(w, torch.Tensor) else ys
    if axis is not None and gather_dim is not None:
        x = lax.all_gather(x, axis, dim=gather_dim, tiled=True)  # [.., s/n, .., in] -> [.., s, .., in]
    elif axis is not None:
        x = lax.pvary(x, axis)  # identity forward, psum backward (a no-op if x already varies over axis)
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)  # [..., in] @ [in, out/n] -> [..., out/n]
    bs = [None] * len(w) if b is None else list(b)
    return tuple(F.linear(x, wi, bi) for wi, bi in zip(w, bs, strict=True))  # [..., in] @ [in, out_i/n]


class ColumnParallel(Op):
    """Column-parallel ``F.linear`` of one input ``x`` (invariant over ``axes``) with ``k`` weights, no bias.

    - forward: ``ys_i = x @ w_i.T`` (``[..., in] @ [in, out_i/n] -> [..., out_i/n]``), varying over ``axes``.
    - backward: ``dx = psum(sum_i g_i @ w_i)`` over ``axes``, the all-reduce issued BEFORE the weights' gradients
      ``dw_i = g_i.T @ x`` are computed: under ``dist`` (``fs.value_and_grad``'s overlapped backward) it travels
      while they compute, where ``pvary`` + ``F.linear`` would issue it after them and wait for it at once
      (Megatron's asynchronous tensor-parallel all-reduce). The same matmuls as ``F.linear``'s backward.

    Not used under a ``torch.func`` transform or in a compiled graph (no ``jvp`` / ``vmap`` rule: the plain ops
    run there).
    """

    @staticmethod
    def forward(dev: object, axes: tuple[str, ...], x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(F.linear(x, w) for w in ws)  # [..., in] @ [in, out_i/n] -> [..., out_i/n]

    @staticmethod
    def setup_context(ctx: object, inputs: tuple, output: object) -> None:
        dev, axes, x, *ws = inputs
        ctx.dev, ctx.axes = dev, axes  # type: ignore[attr-defined]
        ctx.save_for_backward(x, *ws)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, *gs: torch.Tensor | None) -> tuple:  # type: ignore[override]
        x, *ws = ctx.saved_tensors  # type: ignore[attr-defined]
        x2 = x.reshape(-1, x.shape[-1])  # [n, in]
        # [n, out_i/tp] (n spelled out: an empty block of the vocabulary, out_i/tp = 0, leaves -1 ambiguous)
        g2 = [None if g is None else g.reshape(x2.shape[0], g.shape[-1]) for g in gs]
        dx = None
        for g, w in zip(reversed(g2), reversed(ws), strict=True):  # summed in the order autograd sums them
            if g is not None:
                part = g.mm(w)  # [n, out_i/tp] @ [out_i/tp, in] -> [n, in]
                dx = part if dx is None else dx + part
        if dx is not None:  # issued now (under dist, pending); the weights' gradients compute meanwhile
            dx = call(AllReduce, dx.view(x.shape), ctx.dev, ctx.axes, "sum", "psum")  # type: ignore[attr-defined]
        dws = [None if g is None else g.t().mm(x2) for g in g2]  # [out_i/tp, n] @ [n, in] -> [out_i/tp, in]
        return (None, None, dx, *dws)

    @staticmethod
    def vma(axes: frozenset[str], x_axes: frozenset[str], *w_axes: frozenset[str]) -> frozenset[str] | None:
        """``pvary`` + ``F.linear``'s: the results vary over ``x``'s axes and ``axes``; declined where ``x`` already
        varies over one of ``axes`` (no all-reduce in its backward), or a weight varies over other axes."""
        if not isinstance(x_axes, Audited) and not x_axes.isdisjoint(axes):
            return None
        tag = frozenset(x_axes | axes)
        for wt in w_axes:
            if wt != tag:
                return None
        return Audited(tag) if isinstance(x_axes, Audited) else tag


def _column_overlapped(x: torch.Tensor, ws: list[torch.Tensor], axis: str) -> tuple[torch.Tensor, ...] | None:
    """:class:`ColumnParallel` of ``x`` and ``ws``, tagged as ``pvary`` + ``F.linear`` would be; None where the
    plain ops must run instead: a gradient-less call, a ``torch.func`` transform, a compiled graph, ``x``
    already varying over ``axis`` (no all-reduce in its backward), or operands whose varying axes differ."""
    if not torch.is_grad_enabled() or transforms_active() or tracing():
        return None
    return bind(
        ColumnParallel, x, *ws, axis=axis, name="column_parallel_linear", need_grad=True
    )  # -> k x [.., out_i/n]


def row_parallel_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    axis: str | None = "tp",
    scatter_dim: int | None = None,
) -> torch.Tensor:
    """``F.linear`` with the input features sharded over ``axis``; the partial sums are reduced.

    Forward: all-reduce (or, with ``scatter_dim``, reduce-scatter along that dim for sequence
    parallelism); backward: identity (or all-gather). The bias is added once, after the reduction.

    Args:
        x: ``[..., in/n]``, varying over ``axis``.
        w: local ``[out, in/n]`` block of a ``P(None, axis)`` weight.
        b: ``[out]`` bias, replicated, or None.
        axis: the tensor-parallel mesh axis; ``None``: not sharded, plain ``F.linear`` (``scatter_dim`` ignored).
        scatter_dim: the sequence dim to scatter the result over, for sequence parallelism.

    Returns:
        ``[..., out]`` invariant over ``axis`` (or ``[.., s/n, .., out]`` varying, with ``scatter_dim``).

    Example:
        >>> # y = row_parallel_linear(h, w2, scatter_dim=1)  # [b, s, f/tp] -> [b, s/tp, d]
        >>> import torch, torch.nn.functional as F
        >>> x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
        >>> torch.equal(row_parallel_linear(x, w, b, axis=None), F.linear(x, w, b))  # no axis: no reduction
        True
    """
    if axis is None:
        return F.linear(x, w, b)  # [..., in] @ [in, out] -> [..., out]
    y = F.linear(x, w)  # [..., in/n] @ [in/n, out] -> [..., out] (partial sums)
    if scatter_dim is None:
        y = psum_owned(y, axis)  # [..., out] -> [..., out] (summed in the matmul's own buffer)
    else:
        y = lax.psum_scatter(y, axis, dim=scatter_dim, tiled=True)  # [.., s, .., out] -> [.., s/n, .., out]
    if b is not None:
        y = y + (lax.pvary(b, axis) if scatter_dim is not None else b)
    return y


def _check_ids(ids: torch.Tensor, vocab: int, what: str, fn: str, ignore: int | None = None) -> None:
    if tracing() or ids.is_meta:  # recorded into a compiled graph / shapes only (eval_shape, an abstract mesh)
        return
    with torch._C.DisableTorchFunction():  # a check of values: no result is kept, so no tag is needed
        bad = (ids < 0) | (ids >= vocab)
        if ignore is not None:
            bad &= ids != ignore
        if not bool(bad.any()):
            return
        v = ids[bad][0].item()
    raise ShardingError(
        f"{fn}: {what} contain {v}, outside [0, {vocab}) (the vocabulary: local rows x axis size)"
        + (f" and not the ignore index {ignore}" if ignore is not None else "")
        + "; check the tokenizer's vocabulary size against the table."
    )


def _check_replicated(t: torch.Tensor, axis: str | tuple[str, ...], what: str, fn: str) -> None:
    """ShardingError where ``t`` is known to vary over ``axis`` (check_vma's tag, or, untracked, an argument's spec
    or a collective's result; not the sim audit's tags, which dist has not): every device of the axis must look up
    the same ids, or the reduction over the axis mixes different tokens."""
    ctx = current(fn)
    axes = axes_of(axis, ctx.mesh, fn)
    with torch._C.DisableTorchFunction():  # a tag read: no result is kept
        have = known_vma(t, ctx.check_vma)
        shape = tuple(t.shape)
    if have is None or isinstance(have, Audited):
        return
    bad = [a for a in axes if a in have]
    if bad:
        raise ShardingError(
            f"{fn}: the {what} (shape {shape}) vary over axis {bad[0]!r}, the axis the vocabulary is split over; "
            f"every device of {bad[0]!r} must hold the same {what}, or the sum over it mixes different tokens. "
            f"Give the {what} an in_spec that does not name {bad[0]!r}, or gather them with fs.all_gather_invariant."
        )


def _check_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """ShardingError unless ``labels`` are int64 / int32 ids (as ``F.embedding`` takes), ``logits.shape[:-1]``."""
    with torch._C.DisableTorchFunction():  # shape and dtype reads only
        lshape, shape = tuple(logits.shape), tuple(labels.shape)
        ok = len(lshape) >= 1 and shape == lshape[:-1] and labels.dtype in (torch.int64, torch.int32)
        dtype = labels.dtype
    if not ok:
        raise ShardingError(
            f"vocab_parallel_cross_entropy: logits of shape {lshape} need int64 or int32 labels of shape {lshape[:-1]} "
            f"(one id per row of logits, the vocabulary last), but the labels have shape {shape} and dtype {dtype}; "
            f"reshape or cast them (labels.long())."
        )


def vocab_parallel_embedding(
    ids: torch.Tensor, table: torch.Tensor, *, axis: str | None = "tp", scatter_dim: int | None = None
) -> torch.Tensor:
    """``F.embedding`` with the vocabulary sharded over ``axis``: each device looks up the ids in its rows
    (zeros elsewhere), then all-reduce (or reduce-scatter along ``scatter_dim`` for sequence parallelism).

    Args:
        ids: ``[...]`` token ids, replicated over ``axis``.
        table: local ``[vocab/n, dim]`` rows of a ``P(axis, None)`` table.
        axis: the mesh axis the vocabulary is split over; ``None``: not sharded, plain ``F.embedding``
            (``scatter_dim`` ignored).
        scatter_dim: scatter the result along this dim (sequence parallelism).

    Returns:
        ``[..., dim]`` (invariant over ``axis``; or sharded along ``scatter_dim``).

    Raises:
        ShardingError: an id outside the vocabulary, or ids varying over ``axis``.

    Example:
        >>> # h = vocab_parallel_embedding(tokens, emb)  # [b, s] -> [b, s, d]
        >>> import torch, torch.nn.functional as F
        >>> ids, table = torch.tensor([[1, 3]]), torch.randn(4, 8)
        >>> torch.equal(vocab_parallel_embedding(ids, table, axis=None), F.embedding(ids, table))
        True
    """
    if axis is None:
        return _embedding(ids, table)  # [...] -> [..., dim]
    _check_replicated(ids, axis, "ids", "vocab_parallel_embedding")
    n = lax.axis_size(axis)
    with torch._C.DisableTorchFunction():
        rows = table.shape[0]
    vocab = sum(block_sizes(rows, axis))  # rows * n, unless the vocabulary is split unevenly (tensor_split's)
    _check_ids(ids, vocab, "ids", "vocab_parallel_embedding")
    emb = _embedding_slice(ids, table, lax.axis_index(axis), *divmod(vocab, n))  # [...] -> [..., dim]
    if scatter_dim is None:
        return psum_owned(emb, axis)  # [..., dim] -> [..., dim] (summed in emb's own buffer)
    return lax.psum_scatter(emb, axis, dim=scatter_dim, tiled=True)  # [.., s, .., dim] -> [.., s/n, .., dim]


@one_op  # one op for check_vma's tracking (its result depends on every operand), not its ~10
def _embedding_slice(ids: torch.Tensor, table: torch.Tensor, index: torch.Tensor, q: int, r: int) -> torch.Tensor:
    """``[..., dim]``: the rows of ``ids`` that lie in the vocabulary slice ``index`` held as ``table``, zeros for
    the other ids; the vocabulary is ``q * n + r`` rows split as ``torch.tensor_split`` splits it."""
    rows = table.shape[0]
    local = ids - _block_start(index, q, r)
    mine = (local >= 0) & (local < rows)
    if rows == 0:  # a vocabulary smaller than the axis: this block holds no row (zeros, still a function of table)
        # [0, dim] -> [dim] (zeros) -> [..., dim]: a buffer of its own (an expanded view would reach the psum)
        return table.new_zeros(*ids.shape, table.shape[1]) + table.sum(0)
    emb = _embedding(torch.where(mine, local, 0), table)  # [...] -> [..., dim]
    return emb * mine.unsqueeze(-1).to(emb.dtype)


def _block_start(index: torch.Tensor, q: int, r: int) -> torch.Tensor:
    """The first row of block ``index`` of a dim of ``q * n + r`` rows split as ``torch.tensor_split`` splits it
    (the first ``r`` blocks one row longer): ``index * q`` for an even split."""
    return index * q + index.clamp(max=r) if r else index * q


def _embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``F.embedding``; a bfloat16 / float16 table on CPU is looked up in float32 (the same values), so the backward
    sums each row's gradient in float32: CPU's embedding backward sums in the table's dtype (bf16: a 2.8% error on
    the byte-level Llama's embedding gradient, 4x any other weight's), where CUDA's already sums in float32."""
    if table.device.type == "cpu" and table.dtype in (torch.bfloat16, torch.float16):
        return F.embedding(ids, table.float()).to(table.dtype)  # [...] -> [..., dim]
    return F.embedding(ids, table)  # [...] -> [..., dim]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    axis: str | None = "tp",
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` over logits whose vocabulary dim is sharded over ``axis``, never gathering it.

    Each device reduces its slice: the max (all-reduce max, no gradient), then the sum of exponentials and
    the target logit together (one all-reduce of two numbers per token). Computed in float32 (float64 logits
    in float64, as ``F.cross_entropy``).

    Args:
        logits: ``[..., vocab/n]`` local logits.
        labels: ``[...]`` target ids, replicated over ``axis``; ``ignore_index`` entries are skipped.
        axis: the mesh axis the vocabulary is split over; ``None``: not sharded, plain ``F.cross_entropy``
            (in float32, or float64; ``"mean"`` of no valid label is 0, as with an axis).
        ignore_index: label value that contributes no loss (as ``F.cross_entropy``).
        reduction: ``"mean"`` (over the non-ignored labels of this device), ``"sum"`` or ``"none"``.

    Returns:
        The loss, invariant over ``axis``.

    Raises:
        ShardingError: labels outside the vocabulary (other than ``ignore_index``), labels not int64 / int32 ids of
            shape ``logits.shape[:-1]``, labels varying over ``axis``, or a bad reduction.

    Example:
        >>> # loss = vocab_parallel_cross_entropy(logits, targets)  # [b, s, V/tp], [b, s] -> []
        >>> import torch, torch.nn.functional as F
        >>> logits, labels = torch.randn(2, 3, 5), torch.tensor([[0, 4, -100], [2, 2, 1]])
        >>> ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        >>> torch.allclose(vocab_parallel_cross_entropy(logits, labels, axis=None), ref)
        True
    """
    if reduction not in ("mean", "sum", "none"):
        raise ShardingError(
            f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', not {reduction!r}."
        )
    _check_labels(logits, labels)
    if axis is None:
        return _local_cross_entropy(logits, labels, ignore_index, reduction)
    _check_replicated(labels, axis, "labels", "vocab_parallel_cross_entropy")
    n = lax.axis_size(axis)
    v_local = logits.shape[-1]
    vocab = sum(block_sizes(v_local, axis))  # v_local * n, unless the vocabulary is split unevenly
    _check_ids(labels, vocab, "labels", "vocab_parallel_cross_entropy", ignore=ignore_index)
    x, lmax = _float_and_max(logits)  # [..., V/n] -> [..., V/n] fp32, [...]
    gmax = lax.pmax(lmax, axis)  # [...] -> [...], the global max (no gradient needed)
    both = _exp_sum_and_target(x, gmax, labels, lax.axis_index(axis), *divmod(vocab, n))  # [..., 2]
    both = lax.psum(both, axis)  # [..., 2] -> [..., 2]: sum of exp, target logit
    return _cross_entropy_from_sums(both, labels, ignore_index, reduction)


# The local math of vocab_parallel_cross_entropy between its collectives, each one op for check_vma's tracking
# (its ~25 ops are one dispatch each through the vma mode otherwise): every result of each depends on every
# operand, so each result varies over the union of the operands' axes, what the ops one by one would give.


@one_op
def _float_and_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` in float32 (float64 stays float64) and its max over the last dim (no gradient)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if x.shape[-1] == 0:  # a vocabulary smaller than the axis: no column here (amax of none is -inf, not an error)
        return x, x.new_full(x.shape[:-1], float("-inf")).detach()  # [..., 0] -> [...]
    return x, x.detach().amax(-1)  # [..., V/n] -> [...]


@one_op
def _exp_sum_and_target(
    x: torch.Tensor, gmax: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, q: int, r: int
) -> torch.Tensor:
    """``[..., 2]``: this device's sum of ``exp(x - gmax)`` and its shifted target logit (0 where the label is
    another device's), for the vocabulary slice ``index`` of ``x``'s width (of ``q * n + r``, tensor_split's)."""
    v_local = x.shape[-1]
    shifted = x - gmax.unsqueeze(-1)  # [..., V/n]
    if v_local == 0:  # a vocabulary smaller than the axis: no column, no target here (zeros, still of x)
        zero = shifted.sum(-1)  # [..., 0] -> [...]
        return torch.stack([zero, zero], dim=-1)  # [..., 2]
    local = labels - _block_start(index, q, r)
    mine = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)  # [..., V/n] -> [...]
    # 0 where the label is another device's: selected, not multiplied by 0 (a masked -inf logit in the column
    # picked in its place would make -inf * 0 = NaN, and the psum would spread it to every device)
    picked = torch.where(mine, picked, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.stack([shifted.exp().sum(-1), picked], dim=-1)  # [..., 2]


@one_op
def _cross_entropy_from_sums(
    both: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str
) -> torch.Tensor:
    """The loss from the summed ``[..., 2]`` (sum of exp, target logit), reduced as ``reduction`` says."""
    loss = both[..., 0].log() - both[..., 1]  # [...]
    valid = labels != ignore_index
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1).to(loss.dtype)


def _local_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """``F.cross_entropy`` over the last dim of ``logits``, in float32 (float64 stays float64), with the sharded
    op's reductions."""
    flat = logits.reshape(-1, logits.shape[-1])  # [..., V] -> [N, V]
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    labels = labels if labels.dtype == torch.long else labels.long()  # int32 ids too, as with an axis
    if reduction == "none":
        loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="none")  # [N]
        return loss.view(labels.shape)
    total = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")  # [N, V] -> []
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1).to(total.dtype)


def sequence_gather(x: torch.Tensor, axis: str | None, dim: int) -> torch.Tensor:
    """All-gather the sequence shards of ``x`` along ``dim`` (forward); reduce-scatter (backward).

    The result varies over ``axis`` (each device goes on to compute its own part from it). With
    ``axis=None`` the sequence is not split: ``x`` itself.

    Example:
        >>> # full = sequence_gather(x, "tp", dim=1)  # [b, s/tp, d] -> [b, s, d]
        >>> import torch
        >>> x = torch.randn(2, 4, 8)
        >>> sequence_gather(x, None, dim=1) is x
        True
    """
    if axis is None:
        return x
    return lax.all_gather(x, axis, dim=dim, tiled=True)  # [.., s/n, ..] -> [.., s, ..]


def sequence_scatter(x: torch.Tensor, axis: str | None, dim: int) -> torch.Tensor:
    """Keep this device's block of ``dim`` of a replicated ``x`` (forward, no communication); all-gather
    the gradient blocks (backward). With ``axis=None`` the sequence is not split: ``x`` itself.

    Example:
        >>> # x_sp = sequence_scatter(h, "tp", dim=1)  # [b, s, d] -> [b, s/tp, d]
        >>> import torch
        >>> x = torch.randn(2, 4, 8)
        >>> sequence_scatter(x, None, dim=1) is x
        True
    """
    if axis is None:
        return x
    return split_invariant(x, axis, dim=dim)  # [.., s, ..] -> [.., s/n, ..]
