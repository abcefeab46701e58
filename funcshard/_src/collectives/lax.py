"""The collectives over named mesh axes, as ``funcshard.lax`` exports them (its docstring has the table of
forward / backward pairs and an example), and the core's own variants of them (owned, pending and cast sums,
invariant gathers) for the ops above."""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..errors import ConfigError, ShardingError
from ..runtime.context import (
    DeviceContext,
    axes_of,
    current,
    env,
    note_uneven,
    tracing,
    transforms_active,
)
from ..tree.spec import split_sizes
from . import prims as _prims
from . import prims_cast as _prims_cast
from . import prims_ragged as _prims_ragged
from .uneven import block_shapes, block_sizes, may_differ, pad_to
from .vma import EMPTY, Audited, bind_operand, bind_result, bind_results, get_vma, known_vma, known_vmas, set_vma

__all__ = [
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "axis_size",
    "bucket_bytes",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
    "ragged_all_to_all",
]

PyTree = Any
_Axis = str | tuple[str, ...]


def _tmap(fn: Any, tree: PyTree, name: str, *, numbers: bool = False) -> PyTree:
    """``fn`` on every tensor leaf of ``tree``. A Python number is a value invariant over every axis: passed
    to ``fn`` as it is where ``numbers`` (the reductions have a rule for it), else as a 0-dim tensor."""
    if isinstance(tree, torch.Tensor):  # one tensor (the common operand): no tree walk
        return fn(tree)

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return fn(x if numbers else torch.tensor(x))
        raise ShardingError(f"{name}: leaves must be torch.Tensors (or numbers), found {type(x).__name__}.")

    return optree.tree_map(leaf, tree)


def _n(ctx: DeviceContext, axes: tuple[str, ...]) -> int:
    return math.prod(ctx.mesh.shape[a] for a in axes)


def _reduce(x: PyTree, axis: _Axis, op: str, name: str, prim: Any = _prims.AllReduce) -> PyTree:
    ctx = current(name)
    axes = axes_of(axis, ctx.mesh, name)
    if isinstance(x, torch.Tensor):  # one tensor (the common operand): no closure, no tree walk
        return _reduce_tensor(x, ctx, axes, op, name, prim)

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):  # a number is the same on every device: n copies of it
            return t * _n(ctx, axes) if name == "psum" else t
        return _reduce_tensor(t, ctx, axes, op, name, prim)

    return _tmap(one, x, name, numbers=True)


def _reduce_tensor(t: torch.Tensor, ctx: DeviceContext, axes: tuple[str, ...], op: str, name: str, prim: Any) -> Any:
    """One tensor of :func:`_reduce`: made varying over ``axes`` where the vma rule asks, reduced, tagged."""
    with torch._C.DisableTorchFunction():
        if prim is _TEMPORARY:  # (psum's temporary, asked here: one switch of torch functions for both)
            prim = _prims.AllReduceOwned if _sole_holder_now(t) else _prims.AllReduce
        t, have = bind_operand(_prims.AllReduce, t, axes, ctx.device, ctx.check_vma, name)
        if op == "sum" and t.dtype == torch.bool:  # a count of the True copies, as JAX (not their logical or)
            t = t.to(torch.int32)
        y = _prims.call_on(prim, t, ctx.device, axes, op, name)  # [*s] -> [*s], invariant over axes
        if name == "pmean":  # JAX's dtypes: floats keep theirs, int64 -> float64, other integers -> float32
            y = (y.double() if y.dtype == torch.int64 else y) / _n(ctx, axes)
    return bind_result(_prims.AllReduce, y, have, axes)


def psum(x: PyTree, axis: _Axis) -> PyTree:
    """All-reduce sum over ``axis`` (forward); identity per device (backward, the transpose ``pvary``).

    The result is invariant over ``axis``. A value that is already invariant over ``axis`` is summed as the
    ``n`` equal copies it stands for (``psum(1, "tp") == axis_size("tp")``). A bool tensor is summed as a
    count of its Trues, in int32 (JAX's rule); other dtypes keep theirs.

    Example:
        >>> # inside shard_map over {"tp": 4}: y = fs.psum(x, "tp")  # [b, d] -> [b, d]
    """
    if type(x) is torch.Tensor and _getrefcount(x) == _TEMP_REFS and x.nbytes >= INPLACE_MIN_BYTES:
        # a temporary no one else can see (``psum(a @ b, "tp")``): summed in its own buffer, as psum_owned does, where
        # _sole_holder_now says so (asked by _reduce_tensor under its DisableTorchFunction; it asks for the
        # transforms; the backend falls back to a copy in a compiled graph)
        return _reduce(x, axis, "sum", "psum", _TEMPORARY)
    return _reduce(x, axis, "sum", "psum")


def _temp_refs(x: Any) -> int:
    """The references ``x`` has inside a function it was passed to (as :func:`psum`'s ``x``)."""
    return _getrefcount(x)


_getrefcount = sys.getrefcount
# the count a temporary has in ``psum``'s frame (``psum(a @ b)``: the frame's own reference, and getrefcount's), found
# by asking; 0 (never met) where a value another frame holds would show the same count (an interpreter whose calls
# borrow their arguments' references: 3.14's), so only a count that tells the two apart enables the in-place sum
_HELD = torch.empty(0)
_TEMP_REFS = _temp_refs(torch.empty(0)) if sys.version_info < (3, 14) else 0
if _temp_refs(_HELD) == _TEMP_REFS:
    _TEMP_REFS = 0
del _HELD
_storage_uses = torch._C._storage_Use_Count


def _sole_holder_now(x: torch.Tensor) -> bool:
    """Whether ``x`` is worth summing in place (:data:`INPLACE_MIN_BYTES`) and its memory is seen through ``x``
    alone, for a tensor whose Python object only the caller's frame holds: its C++ tensor is held by nothing else
    (no backward saved it as an input, no view's base, no DLPack capsule), and its storage by nothing else (no view
    or ``detach`` of it, no backward saved it as an output, no copy-on-write clone shares it; the storage object
    made here to ask is the second holder). Called with torch functions disabled (metadata reads the vma mode need
    not see)."""
    if transforms_active() or _is_wrapped(x):  # (a torch.func wrapper, live or dead: no storage of its own to ask)
        return False
    return (
        x.nbytes >= INPLACE_MIN_BYTES
        and x._use_count() == 1
        and x._base is None
        and _storage_uses(x.untyped_storage()._cdata) == 2
    )


#: :func:`psum`'s mark of a temporary (for ``_reduce_tensor``: AllReduceOwned where :func:`_sole_holder_now` says so)
_TEMPORARY = object()


#: the smallest temporary :func:`psum` sums in place: below it the copy costs less than the checks and the backend's
#: in-place path (callgrind, one psum of a temporary in a dist shard_map: 4 KiB +2.5k instructions in place, 128 KiB
#: -11.9k; the copy grows by ~0.23 instructions a byte, besides its page faults)
INPLACE_MIN_BYTES = 16 << 10


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def psum_owned(x: torch.Tensor, axis: _Axis) -> torch.Tensor:
    """:func:`psum` of a temporary the caller gives up (no one else holds it, no backward saves it: a
    row-parallel matmul's partial sums), summed in its own buffer under ``dist`` (no copy). For ``ops``; not a
    JAX name, not exported.

    Example:
        >>> # y = psum_owned(F.linear(x, w), "tp")  # [b, s, d] -> [b, s, d], in the matmul's output buffer
    """
    if transforms_active() or tracing():  # (transforms wrap it; a graph has no buffers)
        return psum(x, axis)
    return _reduce(x, axis, "sum", "psum", _prims.AllReduceOwned)


def psum_pending(x: torch.Tensor, axis: _Axis) -> torch.Tensor:
    """:func:`psum` whose result may be pending: under ``dist`` the all-reduce is issued now and waited for where
    its value is first read, so the caller computes on meanwhile (the rules, the value and the gradient are
    :func:`psum`'s; ``sim``, a torch.func transform and a compiled graph give a plain ``psum``). For a sum whose
    value is needed later than it can be issued, as the Llama loss's token count (read after the forward) and
    its mean (read after the backward: ``fs.value_and_grad`` seeds a pending value with 1 and waits for it at
    its end). For models; not a JAX name, not exported.

    Example:
        >>> # n = psum_pending(local_count, "dp")  # [] -> [] (pending); ... forward ...; loss / n (waits)
    """
    if transforms_active() or tracing():  # (transforms wrap it; a graph has its own)
        return psum(x, axis)
    return _reduce(x, axis, "sum", "psum", _prims.AllReducePending)


def pmean(x: PyTree, axis: _Axis) -> PyTree:
    """All-reduce mean over ``axis`` (forward); identity / n per device (backward).

    Floating dtypes keep theirs; integers and bools give float32, int64 gives float64 (JAX's dtypes).

    Example:
        >>> # loss = fs.pmean(local_loss, "dp")  # [] -> []
    """
    return _reduce(x, axis, "sum", "pmean")


def pmax(x: PyTree, axis: _Axis) -> PyTree:
    """All-reduce max over ``axis`` (forward); the gradient goes to the device(s) holding the max, split
    evenly between ties (backward).

    Example:
        >>> # m = fs.pmax(local_max, "tp")  # [b] -> [b]
    """
    return _reduce(x, axis, "max", "pmax")


def pmin(x: PyTree, axis: _Axis) -> PyTree:
    """All-reduce min over ``axis`` (forward); the gradient goes to the device(s) holding the min (backward).

    Example:
        >>> # m = fs.pmin(local_min, "tp")  # [b] -> [b]
    """
    return _reduce(x, axis, "min", "pmin")


#: ``FUNCSHARD_BUCKET_MB`` when unset: DDP's ``bucket_cap_mb``
DEFAULT_BUCKET_MB = 25.0
_BUCKET_CACHE: dict[str | None, int] = {}


def bucket_bytes() -> int:
    """The largest gradient bucket of :func:`pvary` in bytes: ``FUNCSHARD_BUCKET_MB`` (MiB, default 25 as DDP's
    ``bucket_cap_mb``; 0: no limit, one bucket per ``pvary`` call and dtype), read at each call.

    Raises:
        ConfigError: a value that is not a number of MiB >= 0.

    Example:
        >>> bucket_bytes()  # FUNCSHARD_BUCKET_MB=4 python ... gives 4194304
        26214400
    """
    text = env("FUNCSHARD_BUCKET_MB")
    hit = _BUCKET_CACHE.get(text)
    if hit is None:
        try:
            mb = DEFAULT_BUCKET_MB if text is None or not text.strip() else float(text)
        except ValueError:
            mb = float("nan")
        if not (mb >= 0 and math.isfinite(mb)):
            raise ConfigError(
                f"FUNCSHARD_BUCKET_MB={text!r}: expected the gradient bucket size in MiB, a number >= 0 (default "
                f"{DEFAULT_BUCKET_MB:g}; 0: one bucket per pvary call), e.g. FUNCSHARD_BUCKET_MB=25."
            )
        hit = _BUCKET_CACHE[text] = int(mb * 2**20)
    return hit


def _split_buckets(idx: list[int], leaves: list[Any]) -> list[list[int]]:
    """The leaves ``idx`` (one dtype, device and varying axes) cut into gradient buckets, DDP's rule: in reverse
    order (a later leaf's gradient is ready first in the backward), a bucket closes once it holds at least
    :func:`bucket_bytes`. Each bucket is its own backward node, so its all-reduce starts as soon as its own
    gradients are ready."""
    cap = bucket_bytes()
    if cap <= 0 or len(idx) == 1:
        return [idx]
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(idx):
        cur.append(i)
        size += leaves[i].numel() * leaves[i].element_size()
        if size >= cap:
            out.append(cur[::-1])
            cur, size = [], 0
    if cur:
        out.append(cur[::-1])
    return out


def pvary(x: PyTree, axis: _Axis) -> PyTree:
    """Mark ``x`` as varying over ``axis``: identity (forward), psum over ``axis`` (backward).

    With ``check_vma=True`` shard_map inserts it where needed; with ``check_vma=False`` write it where an
    invariant value (say a replicated weight) meets one that varies over ``axis`` (a sharded batch).
    On a pytree, the leaves of one dtype are bucketed: their gradients are written into one flat buffer and
    summed with a single all-reduce (as DDP's buckets do), instead of one collective per leaf; buckets hold
    about ``FUNCSHARD_BUCKET_MB`` (:func:`bucket_bytes`, default 25 MiB) each, cut in reverse leaf order.

    Example:
        >>> # w = fs.pvary(w, "dp")  # [d, h] -> [d, h]; its gradient is summed over dp
        >>> # params = fs.pvary(params, "dp")  # one all-reduce for all their gradients
    """
    ctx = current("pvary")
    axes = axes_of(axis, ctx.mesh, "pvary")
    with torch._C.DisableTorchFunction():  # dtype, device, sizes read without the vma mode (tags set here)
        if isinstance(x, torch.Tensor):  # one tensor (the common operand): no tree walk, no buckets
            have = known_vma(x, ctx.check_vma)
            # the axes it still has to be made varying over: unknown or audited axes are pvary-ed all, as dist (which
            # knows none) does
            if have is None or isinstance(have, Audited) or have.isdisjoint(axes):
                todo = axes
            else:
                todo = tuple(a for a in axes if a not in have)
                if not todo:
                    return x
            y = _prims.call_on(_prims.Pvary, x, ctx.device, todo)  # [*s] -> [*s]
            return bind_result(_prims.Pvary, y, have, axes)
        leaves, treedef = optree.tree_flatten(x)
        groups: dict[Any, list[int]] = {}
        haves = known_vmas(leaves, ctx.check_vma)
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                have = haves[i]
                # (the axes it still has to be made varying over, as for one tensor above)
                if have is None or isinstance(have, Audited) or have.isdisjoint(axes):
                    todo = axes
                else:
                    todo = tuple(a for a in axes if a not in have)
                if todo:
                    groups.setdefault((todo, t.dtype, t.device, have), []).append(i)
            elif isinstance(t, (int, float)) and not isinstance(t, bool):
                leaves[i] = torch.tensor(t)
                groups.setdefault((axes, leaves[i].dtype, leaves[i].device, EMPTY), []).append(i)
            else:
                raise ShardingError(f"pvary: leaves must be torch.Tensors (or numbers), found {type(t).__name__}.")
        out = list(leaves)
        for (todo, _, _, have), group in groups.items():
            for idx in _split_buckets(group, leaves):
                if len(idx) == 1:
                    ys: tuple[torch.Tensor, ...] = (
                        _prims.call_on(_prims.Pvary, leaves[idx[0]], ctx.device, todo),
                    )  # [*s] -> [*s]
                else:  # n x [*s_i] -> same; backward: one all-reduce of the bucket
                    ys = _prims.call(_prims.PvaryBucket, ctx.device, todo, *[leaves[i] for i in idx])
                for i, y in zip(idx, bind_results(_prims.Pvary, ys, have, axes), strict=True):
                    out[i] = y
    return optree.tree_unflatten(treedef, out)


def _dim(d: int, ndim: int, name: str, what: str, shape: Sequence[int]) -> int:
    if not -ndim <= d < ndim:
        raise ShardingError(f"{name}: {what}={d} is out of range for a value of shape {tuple(shape)}.")
    return d % ndim


def _gather(
    x: PyTree,
    axis: _Axis,
    dim: int,
    tiled: bool,
    name: str,
    cast: tuple[torch.dtype, torch.dtype] | None = None,
    *,
    even: bool = False,
) -> PyTree:
    """all_gather / all_gather_invariant / all_gather_cast: the same forward, different transposes and tags.
    ``even``: the blocks are known to be of one size (no sizes to learn in a call with an uneven argument)."""
    ctx = current(name)
    axes = axes_of(axis, ctx.mesh, name)
    invariant = name == "all_gather_invariant"
    prim: Any = (
        _prims.AllGatherInvariant if invariant else _prims.AllGather if cast is None else _prims_cast.AllGatherCast
    )

    def one(t: torch.Tensor) -> torch.Tensor:
        if tiled and t.dim() == 0:  # (was torch's IndexError from the flatten)
            raise ShardingError(
                f"{name}(tiled=True): a 0-dim value has no dim to concatenate along (JAX refuses it too); use "
                f"tiled=False to stack the {_n(ctx, axes)} values in a new dim, or reshape it to [1] first."
            )
        d = _dim(dim, t.dim() + (0 if tiled else 1), name, "dim", t.shape)
        if tiled and not even and may_differ(ctx):  # blocks may differ along d: learn their sizes
            sizes = block_sizes(t.shape[d], axes)
            if min(sizes) != max(sizes):
                return _gather_uneven(t, axis, d, sizes, name, cast)
        with torch._C.DisableTorchFunction():
            t, have = bind_operand(prim, t, axes, ctx.device, ctx.check_vma, name)
            if invariant:
                y = _prims.call(prim, t, ctx.device, axes, axis_index_int(axes))  # [*s] -> [n, *s]
            elif cast is not None:
                y = _prims.call(prim, t, ctx.device, axes, *cast)  # [*s] -> [n, *s] (in cast[0])
            else:
                y = _prims.call(prim, t, ctx.device, axes)  # [*s] -> [n, *s]
            y = y.movedim(0, d)
            if tiled:
                y = y.flatten(d, d + 1)  # [.., n, s_d, ..] -> [.., n*s_d, ..]
        return bind_result(prim, y, have, axes)

    return _tmap(one, x, name)


def _gather_uneven(
    t: torch.Tensor,
    axis: _Axis,
    d: int,
    sizes: tuple[int, ...],
    name: str,
    cast: tuple[torch.dtype, torch.dtype] | None,
) -> torch.Tensor:
    """:func:`_gather` (tiled) of blocks whose sizes along ``d`` differ (``sizes``, in axis order): each padded
    to the largest, gathered, the padding cut away; the backward (the gather's transpose, through the pad and the
    cut) gives each device its own rows of the cotangent."""
    m = max(sizes)
    t = pad_to(t, [*t.shape[:d], m, *t.shape[d + 1 :]])  # [.., sizes[i], ..] -> [.., m, ..]
    full = _gather(t, axis, d, True, name, cast, even=True)  # [.., m, ..] -> [.., n m, ..]
    note_uneven()
    return torch.cat([full.narrow(d, i * m, s) for i, s in enumerate(sizes)], dim=d)  # -> [.., sum(sizes), ..]


def all_gather(x: PyTree, axis: _Axis, *, dim: int = 0, tiled: bool = False) -> PyTree:
    """Gather the shards of ``axis`` in axis order (forward); reduce-scatter (backward).

    ``tiled=True`` concatenates along ``dim``; ``tiled=False`` stacks the shards in a new dim at ``dim``.
    The result varies over ``axis`` (as in JAX). In a call with an unevenly split argument, tiled blocks may
    differ in size along ``dim`` (``torch.tensor_split``'s blocks): the devices first learn the sizes
    (:func:`block_sizes`), then each block is padded to the largest, gathered, and the padding cut away.

    Example:
        >>> # w_full = fs.all_gather(w, "fsdp", dim=0, tiled=True)  # [h/n, d] -> [h, d]
    """
    return _gather(x, axis, dim, tiled, "all_gather")


def all_gather_cast(
    x: PyTree, axis: _Axis, *, dim: int = 0, tiled: bool = False, dtype: torch.dtype, grad_dtype: torch.dtype
) -> PyTree:
    """:func:`all_gather` of ``x`` cast to ``dtype`` (the forward moves ``dtype``), whose backward
    reduce-scatters the cotangent in ``grad_dtype`` and returns it in ``x``'s dtype: mixed precision's FSDP
    gather (``fs.Precision``: compute dtype forward, reduce dtype backward). Not a JAX name: used by
    ``ops.fsdp_gather``.

    Example:
        >>> # w = all_gather_cast(w32, "fsdp", tiled=True, dtype=torch.bfloat16, grad_dtype=torch.float32)
    """
    return _gather(x, axis, dim, tiled, "all_gather", (dtype, grad_dtype))


def pvary_cast(x: PyTree, axis: _Axis, *, dtype: torch.dtype, grad_dtype: torch.dtype) -> PyTree:
    """:func:`pvary` of the floating leaves of ``x`` cast to ``dtype``, their gradients summed over ``axis``
    in ``grad_dtype`` (one bucketed all-reduce per group of equal varying axes) and returned in each leaf's
    own dtype: mixed precision's DDP (``fs.Precision``). Leaves already varying over ``axis`` are only cast.

    Example:
        >>> # params = pvary_cast(params, "dp", dtype=torch.bfloat16, grad_dtype=torch.float32)
    """
    ctx = current("pvary")
    axes = axes_of(axis, ctx.mesh, "pvary")
    leaves, treedef = optree.tree_flatten(x)
    groups: dict[Any, list[int]] = {}
    out = list(leaves)
    for i, t in enumerate(leaves):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise ShardingError(f"pvary_cast: leaves must be floating torch.Tensors, found {type(t).__name__}.")
        have = known_vma(t, ctx.check_vma)
        todo = tuple(a for a in axes if have is None or isinstance(have, Audited) or a not in have)
        if todo:
            groups.setdefault((todo, t.device, have), []).append(i)
        elif t.dtype != dtype:
            out[i] = t.to(dtype)
    for (todo, _, have), group in groups.items():
        for idx in _split_buckets(group, leaves):
            with torch._C.DisableTorchFunction():
                ys = _prims.call(
                    _prims_cast.PvaryCast, ctx.device, todo, dtype, grad_dtype, *(leaves[i] for i in idx)
                )  # n x [*s_i] -> same (in dtype); backward: one all-reduce of the bucket in grad_dtype
            for i, y in zip(idx, ys, strict=True):
                out[i] = bind_result(_prims.Pvary, y, have, axes)
    return optree.tree_unflatten(treedef, out)


def all_gather_invariant(x: PyTree, axis: _Axis, *, dim: int = 0, tiled: bool = False) -> PyTree:
    """All-gather whose result is invariant over ``axis`` (forward); this device's block of the cotangent
    (backward, no communication), as ``jax.lax.all_gather_invariant``.

    Use it where the gathered value is then treated as replicated (e.g. to return it with a spec that omits
    ``axis``); use :func:`all_gather` where each device goes on to compute something different with it.

    Example:
        >>> # full = fs.all_gather_invariant(x, "tp", dim=0, tiled=True)  # [s/tp, d] -> [s, d]
    """
    return _gather(x, axis, dim, tiled, "all_gather_invariant")


def split_invariant(x: PyTree, axis: _Axis, *, dim: int = 0) -> PyTree:
    """This device's block of ``dim`` (split into axis-size blocks, ``torch.tensor_split``'s where the axis size
    does not divide it) of a value invariant over ``axis`` (forward, no communication); all-gather of the
    cotangent blocks (backward). The transpose of :func:`all_gather_invariant`; Megatron's "scatter to the
    sequence-parallel region".

    Under ``check_vma=True`` a value already varying over ``axis`` is sliced plainly (its cotangent is
    per device). Under ``check_vma=False`` the value is taken to be invariant.

    Example:
        >>> # x_local = fs.lax.split_invariant(x, "tp", dim=1)  # [b, s, d] -> [b, s/tp, d]
    """
    ctx = current("split_invariant")
    axes = axes_of(axis, ctx.mesh, "split_invariant")
    n = _n(ctx, axes)
    idx = _index(ctx, axes)  # (where the block starts, not its shape: the same program on every device)

    def one(t: torch.Tensor) -> torch.Tensor:
        d = _dim(dim, t.dim(), "split_invariant", "dim", t.shape)
        if t.shape[d] % n:  # torch.tensor_split's blocks: each padded to the largest, split, cut
            blocks = torch.tensor_split(t, n, dim=d)  # [.., s, ..] -> n x [.., sizes[i], ..]
            y = split_invariant(torch.cat([pad_to(b, blocks[0].shape) for b in blocks], dim=d), axis, dim=d)
            note_uneven()
            return y.narrow(d, 0, blocks[axis_index_int(axes)].shape[d])  # [.., m, ..] -> [.., sizes[i], ..]
        # under check_vma=False the value is taken to be invariant over axes (its tag may say otherwise: an
        # argument); its other axes are kept where known
        have = get_vma(t) if ctx.check_vma else known_vma(t, False)
        with torch._C.DisableTorchFunction():
            if ctx.check_vma and frozenset(axes) <= have:  # one block per member: slice it, no transpose needed
                size = t.shape[d] // n
                y = t.narrow(d, idx * size, size)  # [.., s_d, ..] -> [.., s_d/n, ..]
            else:
                xs = t.unflatten(d, (n, -1)).movedim(d, 0)  # [.., s_d, ..] -> [n, .., s_d/n, ..]
                y = _prims.call(_prims.SplitInvariant, xs, ctx.device, axes, idx)  # [n, *s] -> [*s]
        return bind_result(_prims.SplitInvariant, y, have, axes)

    return _tmap(one, x, "split_invariant")


def psum_scatter(x: PyTree, axis: _Axis, *, dim: int = 0, tiled: bool = False) -> PyTree:
    """Reduce-scatter over ``axis``: device i keeps block i of the sum (forward); all-gather (backward).

    ``tiled=True`` splits ``dim`` into axis-size blocks (``torch.tensor_split``'s, the first ones one row longer,
    where the axis size does not divide it); ``tiled=False`` needs ``x.shape[dim]`` equal to the axis size and
    removes ``dim``.

    Example:
        >>> # y = fs.psum_scatter(partial, "tp", dim=1, tiled=True)  # [b, s, d] -> [b, s/tp, d]
    """
    ctx = current("psum_scatter")
    axes = axes_of(axis, ctx.mesh, "psum_scatter")
    n = _n(ctx, axes)

    def one(t: torch.Tensor) -> torch.Tensor:
        d = _dim(dim, t.dim(), "psum_scatter", "dim", t.shape)
        if t.dtype == torch.bool:  # (psum counts Trues as int32; a blockwise count is that psum's block)
            raise ShardingError(
                f"psum_scatter: a bool tensor of shape {tuple(t.shape)} has no sum (JAX refuses it too); cast it "
                f"first, e.g. fs.psum_scatter(x.to(torch.int32), {axis!r}, ...) to count the Trues."
            )
        if may_differ(ctx):  # blocks of other shapes would be padded to one size and summed silently: refuse them
            _same_block_shapes(block_shapes(t.shape, axes, ctx), axes, "psum_scatter")
        if not tiled and t.shape[d] != n:
            raise ShardingError(
                f"psum_scatter(tiled=False): dim {d} of shape {tuple(t.shape)} must equal the size {n} of {axes}; "
                f"use tiled=True to split a longer dim into {n} blocks."
            )
        if tiled and t.shape[d] % n:  # torch.tensor_split's blocks: each padded to the largest, scattered, cut
            return _psum_scatter_uneven(t, axis, d, n)
        with torch._C.DisableTorchFunction():
            t, have = bind_operand(_prims.ReduceScatter, t, axes, ctx.device, ctx.check_vma, "psum_scatter")
            xs = t.unflatten(d, (n, -1)).movedim(d, 0) if tiled else t.movedim(d, 0)  # -> [n, ...]
            y = _prims.call(_prims.ReduceScatter, xs, ctx.device, axes)  # [n, *s] -> [*s]
        return bind_result(_prims.ReduceScatter, y, have, axes)

    return _tmap(one, x, "psum_scatter")


def _same_block_shapes(shapes: list[tuple[int, ...]], axes: tuple[str, ...], name: str) -> None:
    """Refuse a reduction over ``axes`` whose devices hold blocks of different ``shapes`` (in axis order)."""
    if any(sh != shapes[0] for sh in shapes):
        raise ShardingError(
            f"{name}: the devices of {axes} hold blocks of shapes {shapes} (in axis order), which differ; a sum needs "
            f"one shape on every device of the group. A dim split unevenly over {axes} cannot be summed over them: "
            f"all_gather it first, or split it over other axes."
        )


def _psum_scatter_uneven(t: torch.Tensor, axis: _Axis, d: int, n: int) -> torch.Tensor:
    """:func:`psum_scatter` (tiled) of a dim ``n`` does not divide: device i keeps block i of
    ``torch.tensor_split(sum, n, d)``; the backward (an all-gather, through the pad and the cut) likewise."""
    blocks = torch.tensor_split(t, n, dim=d)  # [.., s, ..] -> n x [.., sizes[i], ..]
    padded = [pad_to(b, blocks[0].shape) for b in blocks]  # each [.., m, ..]
    y = psum_scatter(torch.cat(padded, dim=d), axis, dim=d, tiled=True)  # [.., n m, ..] -> [.., m, ..]
    note_uneven()
    i = axis_index_int(axis)
    return y.narrow(d, 0, blocks[i].shape[d])  # [.., m, ..] -> [.., sizes[i], ..]


def _all_to_all_uneven(
    t: torch.Tensor,
    sd: int,
    cd: int,
    shapes: list[tuple[int, ...]],
    me: int,
    even: Any,
) -> torch.Tensor:
    """:func:`all_to_all` (tiled) of chunks of different shapes: device i's ``split_dim`` (of ``shapes[i]``) is cut
    as ``torch.tensor_split`` cuts it; every chunk is padded to the largest chunk, the even all-to-all
    (``even(t, sd, cd)``) moves them, and each arrival is cut back to its own shape before they are concatenated
    along ``concat_dim``. The backward (through the pad, the even all-to-all and the cut) is the reverse."""
    n = len(shapes)
    for sh in shapes:  # what arrives is concatenated along cd: the chunks must agree on every other dim, sd included
        if len(sh) != t.dim() or any(a != b for k, (a, b) in enumerate(zip(sh, shapes[0])) if k != cd):
            where = f"concat_dim {cd}" if sd == cd else f"concat_dim {cd} (not along split_dim {sd}: their chunks"
            where += "" if sd == cd else " would arrive in different sizes along it)"
            raise ShardingError(
                f"all_to_all: the devices' blocks have shapes {shapes}, which differ outside {where}; blocks may "
                f"differ only along the concat_dim."
            )
    got = [split_sizes(sh[sd], n) for sh in shapes]  # per source: the sizes of its chunks
    big = list(t.shape)
    big[sd] = max(max(g) for g in got)
    if cd != sd:
        big[cd] = max(sh[cd] for sh in shapes)
    chunks = torch.tensor_split(t, n, dim=sd)  # n x [.., sizes[j], ..]
    y = even(torch.cat([pad_to(c, big) for c in chunks], dim=sd), sd, cd)  # [.., n big_sd, ..] -> [.., n big_cd, ..]
    step = big[cd]
    parts = []
    for i, sh in enumerate(shapes):  # the chunk device i sent here, cut to its shape
        part = y.narrow(cd, i * step, sh[cd] if cd != sd else got[i][me])
        parts.append(part.narrow(sd, 0, got[i][me]) if cd != sd else part)
    return torch.cat(parts, dim=cd)


def all_to_all(x: PyTree, axis: _Axis, split_dim: int, concat_dim: int, *, tiled: bool = True) -> PyTree:
    """Split ``split_dim`` into axis-size chunks, send chunk j to device j, concatenate what arrives along
    ``concat_dim`` in source order (forward); the reverse all-to-all (backward).

    Where the axis size does not divide ``split_dim``, or in a call whose blocks may differ in shape (an uneven
    argument), the chunks are ``torch.tensor_split``'s and may differ between devices along ``split_dim`` and
    ``concat_dim``: each is padded to the largest, moved, and cut back to its shape.

    With ``tiled=False`` ``x.shape[split_dim]`` must equal the axis size; that dim is removed and the
    arrivals are stacked in a new dim at ``concat_dim``.

    Example:
        >>> # heads <-> sequence: [b, h, s/n, d] -> [b, h/n, s, d]
        >>> # y = fs.all_to_all(x, "cp", split_dim=1, concat_dim=2)
    """
    ctx = current("all_to_all")
    axes = axes_of(axis, ctx.mesh, "all_to_all")
    n = _n(ctx, axes)

    def one(t: torch.Tensor) -> torch.Tensor:
        sd = _dim(split_dim, t.dim(), "all_to_all", "split_dim", t.shape)
        if not tiled and t.shape[sd] != n:
            raise ShardingError(
                f"all_to_all: split_dim {sd} of shape {tuple(t.shape)} has size {t.shape[sd]}, which must be "
                f"equal to {n} (the size of {axes})."
            )
        cd = _dim(concat_dim, t.dim(), "all_to_all", "concat_dim", t.shape)
        if tiled and (t.shape[sd] % n or may_differ(ctx)):  # chunks of different sizes (tensor_split's)
            shapes = block_shapes(t.shape, axes, ctx)
            if t.shape[sd] % n or any(sh != shapes[0] for sh in shapes):
                return _all_to_all_uneven(t, sd, cd, shapes, axis_index_int(axes), even)
        return even(t, sd, cd)

    def even(t: torch.Tensor, sd: int, cd: int) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            t, have = bind_operand(_prims.AllToAll, t, axes, ctx.device, ctx.check_vma, "all_to_all")
            xs = t.unflatten(sd, (n, -1)).movedim(sd, 0) if tiled else t.movedim(sd, 0)  # -> [n, ...]
            ys = _prims.call(_prims.AllToAll, xs, ctx.device, axes)  # [n, *s] -> [n, *s]
            y = ys.movedim(0, cd)
            if tiled:
                y = y.flatten(cd, cd + 1)  # [.., n, c, ..] -> [.., n*c, ..]
        return bind_result(_prims.AllToAll, y, have, axes)

    return _tmap(one, x, "all_to_all")


_Sizes = torch.Tensor | Sequence[int]
_RAGGED = _prims_ragged.RaggedAllToAll


def ragged_all_to_all(x: PyTree, send_sizes: _Sizes, recv_sizes: _Sizes | None, axis: _Axis) -> PyTree:
    """Send ``send_sizes[j]`` rows of ``x`` to device j of ``axis`` and concatenate the rows that arrive, in
    source order (forward); the reverse exchange of the cotangent, ``send_sizes`` and ``recv_sizes`` swapped
    (backward). JAX's ``jax.lax.ragged_all_to_all`` in a simpler form (no offsets, no output buffer).

    - ``x``: ``[N, *s]``, its rows grouped by destination in axis-index order: rows ``0 .. send_sizes[0]`` go to
      device 0, the next ``send_sizes[1]`` to device 1, ...; rows after ``sum(send_sizes)`` (padding, as JAX's
      operand may be larger than what it sends) are not sent, and their gradient is zero.
    - ``send_sizes`` / ``recv_sizes``: ``n`` non-negative integers each (``n`` the size of ``axis``), an integer
      tensor or a sequence of ints, different on every device; ``recv_sizes[j]`` is the rows this device receives
      from device j and must equal ``send_sizes[me]`` on device j. ``recv_sizes=None`` exchanges them (one
      ``all_to_all`` of the ``n`` counts, counted as such).
    - result: ``[sum(recv_sizes), *s]``, the rows from device 0, then those from device 1, ...; it varies over
      ``axis`` (and over what ``x`` varies over); an ``x`` invariant over ``axis`` is made varying first
      (``pvary``: its gradient is summed over ``axis``), as for every collective.

    The counts fix the result's shape, so they are read on the host (``.tolist()``: a device-to-host sync where
    they live on a GPU). Under ``"sim"`` the counts of the whole group are checked (a disagreement raises
    ``fs.ShardingError`` naming the devices, the counts and the fix); under ``"dist"`` only with
    ``FUNCSHARD_AUDIT=1`` (one small all-gather of the counts a call): unchecked, mismatched counts end in the
    transport's error (gloo aborts the process). On an abstract mesh counts held in meta tensors are unknown:
    routing is taken as balanced, ``[N, *s] -> [N, *s]``, ``(n-1)/n`` of the rows to other devices.
    ``fs.comm_stats`` records one call per exchange (the backward's too) and the bytes sent to OTHER devices
    (the rows kept on this device are not counted), so uniform routing of ``N`` rows counts ``N (n-1)/n`` rows.
    A pytree ``x`` sends every leaf with the same counts.

    Example:
        >>> # MoE dispatch over "ep" (tokens sorted by the device of their expert, counts per device):
        >>> # got = fs.lax.ragged_all_to_all(tokens, send_counts, recv_counts, "ep")  # [N, d] -> [sum(recv), d]
        >>> # back = fs.lax.ragged_all_to_all(out, recv_counts, send_counts, "ep")  # [sum(recv), d] -> [N, d]
    """
    ctx = current("ragged_all_to_all")
    axes = axes_of(axis, ctx.mesh, "ragged_all_to_all")
    n = _n(ctx, axes)
    send = _sizes(send_sizes, n, "send_sizes", axes)
    if recv_sizes is None:  # exchanged: [n] -> [n], element j from device j (its send_sizes[me])
        sent = send_sizes if isinstance(send_sizes, torch.Tensor) else torch.tensor(send, dtype=torch.int64)
        recv_sizes = all_to_all(sent.reshape(n, 1), axes, 0, 0).reshape(n)
    recv = _sizes(recv_sizes, n, "recv_sizes", axes)
    if send is None or recv is None:
        if ctx.device.holds_data:
            raise ShardingError(
                f"ragged_all_to_all over {axes}: send_sizes and recv_sizes must hold values (meta tensors are "
                f"only for an abstract mesh, where they mean balanced routing)."
            )
        send = recv = None
    me = _index(ctx, axes)

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or (send is not None and sum(send) > t.shape[0]):
            raise ShardingError(
                f"ragged_all_to_all over {axes}: device {dict(ctx.device.coords)} sends send_sizes={list(send or ())} "
                f"(sum {sum(send or ())}) rows of a value of shape {tuple(t.shape)}; x needs at least sum(send_sizes) "
                f"rows in dim 0 (its rows grouped by destination; rows after the sum are not sent)."
            )
        with torch._C.DisableTorchFunction():
            t, have = bind_operand(_RAGGED, t, axes, ctx.device, ctx.check_vma, "ragged_all_to_all")
            y = _prims.call_on(_RAGGED, t, ctx.device, axes, send, recv, me)  # [N, *s] -> [sum(recv), *s]
        return bind_result(_RAGGED, y, have, axes)

    return _tmap(one, x, "ragged_all_to_all")


def _sizes(v: _Sizes, n: int, what: str, axes: tuple[str, ...]) -> tuple[int, ...] | None:
    """The ``n`` row counts ``v`` (an integer tensor, read on the host, or a sequence of ints) as Python ints;
    None for counts in a meta tensor (unknown: an abstract mesh's)."""
    with torch._C.DisableTorchFunction():
        if isinstance(v, torch.Tensor):
            if v.is_meta:
                return None
            if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool or v.dim() != 1:
                got: Any = f"a {v.dtype} tensor of shape {tuple(v.shape)}"
                vals = None
            else:
                vals = got = v.tolist()  # (a device-to-host sync: the counts fix the result's shape)
        else:
            try:
                vals = got = [int(operator.index(c)) for c in v]
            except TypeError:
                vals, got = None, v
    if vals is None or len(vals) != n or any(c < 0 for c in vals):
        raise ShardingError(
            f"ragged_all_to_all over {axes}: {what} must be {n} non-negative row counts (one per device of {axes}, "
            f"size {n}), as a 1-dim integer tensor or a sequence of ints; found {got!r}."
        )
    return tuple(vals)


def ppermute(x: PyTree, axis: _Axis, perm: Sequence[tuple[int, int]]) -> PyTree:
    """Send this device's value to ``dst`` from ``src`` for each ``(src, dst)`` pair (indices on ``axis``);
    devices that receive nothing get zeros (forward). The inverse permutation (backward). In a call whose blocks
    may differ in shape (an uneven argument), a device receives a block of its sender's shape (zeros of its own
    shape where nothing arrives).

    Example:
        >>> # ring shift: y = fs.ppermute(x, "cp", [(i, (i + 1) % n) for i in range(n)])  # [*s] -> [*s]
    """
    ctx = current("ppermute")
    axes = axes_of(axis, ctx.mesh, "ppermute")
    n = _n(ctx, axes)
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ShardingError(f"ppermute: perm must be a sequence of (src, dst) int pairs, found {perm!r}.") from None
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ShardingError(
            f"ppermute: perm {list(pairs)} over {axes} (size {n}) must pair indices in [0, {n}) with each source "
            f"and each destination at most once"
            + (f"; out of range: {bad}" if bad else "; a source or destination repeats")
            + "."
        )

    def one(t: torch.Tensor) -> torch.Tensor:
        if may_differ(ctx):  # the devices' blocks may differ in shape: each padded to the largest, moved, cut
            shapes = block_shapes(t.shape, axes, ctx)
            if any(sh != shapes[0] for sh in shapes):
                big = [max(col) for col in zip(*shapes, strict=True)]
                y = even(pad_to(t, big))  # [*s_i] -> [*big]
                src = next((s for s, d in pairs if d == _index(ctx, axes)), None)
                # what arrived, cut to its sender's shape; zeros of this device's own shape where nothing arrives
                want = shapes[src] if src is not None else tuple(t.shape)
                for d, size in enumerate(want):
                    y = y.narrow(d, 0, size)
                return y
        return even(t)

    def even(t: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            t, have = bind_operand(_prims.Ppermute, t, axes, ctx.device, ctx.check_vma, "ppermute")
            y = _prims.call(_prims.Ppermute, t, ctx.device, axes, pairs)  # [*s] -> [*s]
        return bind_result(_prims.Ppermute, y, have, axes)

    return _tmap(one, x, "ppermute")


def axis_index(axis: _Axis) -> torch.Tensor:
    """This device's index on ``axis`` (row-major over a tuple of axes): a 0-dim int64 tensor that varies
    over ``axis`` (as in JAX), so values computed from it are tracked (and their gradients summed) like any
    other varying value. Use ``int(...)`` where a Python number is truly needed (a shape, a branch).

    Example:
        >>> # start = fs.axis_index("tp") * block  # a varying 0-dim tensor
        >>> # rows = x.narrow(0, int(fs.axis_index("tp")) * block, block)
    """
    ctx = current("axis_index")
    axes = axes_of(axis, ctx.mesh, "axis_index")
    with torch._C.DisableTorchFunction():
        if ctx.device.holds_data:
            idx = torch.tensor(_index(ctx, axes))
        else:  # an abstract device: its value is not known to the program (``int(...)`` of it raises)
            idx = torch.empty((), dtype=torch.int64, device="meta")
    return set_vma(idx, frozenset(axes))


def axis_index_int(axis: _Axis) -> int:
    """:func:`axis_index` as a Python int, for shapes and control flow inside funcshard (untracked).

    Example:
        >>> # start = axis_index_int("cp") * block
    """
    ctx = current("axis_index")
    return ctx.device.index(axes_of(axis, ctx.mesh, "axis_index"))


def _index(ctx: DeviceContext, axes: tuple[str, ...]) -> int:
    """This device's index over ``axes``, not noted as read by the program (a block's place, not its shape)."""
    idx = 0
    for a in axes:
        idx = idx * ctx.mesh.shape[a] + ctx.device.coords[a]
    return idx


def axis_size(axis: _Axis) -> int:
    """The number of devices along ``axis`` (product over a tuple), a Python int.

    Example:
        >>> # n = fs.axis_size("tp")
    """
    ctx = current("axis_size")
    return _n(ctx, axes_of(axis, ctx.mesh, "axis_size"))
