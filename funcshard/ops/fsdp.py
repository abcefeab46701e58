"""FSDP / ZeRO-3 / HSDP as a function: gather each parameter just before use.

Parameters live sharded on an ``fsdp`` axis (one dim of each is split over it, optionally beside a
tensor-parallel axis). :func:`fsdp_gather` all-gathers them inside ``shard_map``; the all-gather's
backward is the reduce-scatter, so the gradients come out sharded exactly like the parameters. With a
``replicate_axis`` (HSDP: replicas of the sharded group, e.g. ``dp``) the gradient is reduce-scattered
over ``fsdp`` first and then all-reduced over the replicas, on the small shard.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.ops import fsdp_gather
    >>> mesh = fs.make_mesh({"fsdp": 2}, backend="sim")
    >>> specs = {"w": P("fsdp", None)}
    >>> def loss(p, x):
    ...     full = fsdp_gather(p, specs)  # w: [4/2, 3] -> [4, 3]
    ...     return fs.pmean((x @ full["w"].T).pow(2).mean(), "fsdp")
    >>> step = fs.shard_map(torch.func.grad(loss), mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=specs)
    >>> step({"w": torch.randn(4, 3)}, torch.randn(8, 3))["w"].spec
    P('fsdp', None)

Reshard-after-forward without remat (FSDP2's ``reshard_after_forward=True``): :func:`reshard_after_forward` is
a scope around one layer's forward in which the tensors autograd saves that are (views of) the gathered
weights are dropped, and gathered again in the backward (``torch.autograd.graph.saved_tensors_hooks``).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import lax, pytree
from ..extend import (
    ConfigError,
    P,
    Precision,
    Prim,
    ShardingError,
    all_gather_cast,
    call,
    current_vma_mode,
    device_scope,
    is_spec,
    known_vma,
    maybe_current,
    only_grad_transforms,
    prefetch_scope,
    pvary_cast,
    settle,
)

__all__ = ["fsdp_gather", "fsdp_unsharded_specs", "reshard_after_forward"]


@functools.lru_cache(maxsize=1024)
def _fsdp_dim(spec: P, ndim: int, axis: str) -> int | None:
    """The dim ``spec`` splits over ``axis`` (None: not split); -1 when ``axis`` is not the minor-most axis of
    its dim (an error, raised by the caller with the leaf's path). Cached: the same few specs every call."""
    for d, axes in enumerate(spec.dim_axes(ndim)):
        if axis in axes:
            return d if axes[-1] == axis else -1
    return None


def _misplaced(spec: P, ndim: int, axis: str, path: str) -> ShardingError:
    axes = next(a for a in spec.dim_axes(ndim) if axis in a)
    d = spec.dim_axes(ndim).index(axes)
    return ShardingError(
        f"fsdp_gather at '{path}': spec {spec!r} puts '{axis}' before {axes[axes.index(axis) + 1 :]} "
        f"in dim {d}; the FSDP axis must be the minor-most (last) axis of its dim, e.g. "
        f"P(('tp', '{axis}')), so that gathering it gives one contiguous block."
    )


def fsdp_gather(
    params: Any,
    specs: Any,
    *,
    axis: str | None = "fsdp",
    replicate_axis: str | tuple[str, ...] | None = None,
    bucket: bool = True,
    precision: Precision | None = None,
    prefetch: bool = False,
) -> Any:
    """All-gather every parameter sharded over ``axis`` along its sharded dim (forward); the backward is
    the reduce-scatter, so gradients keep the parameters' layout.

    Args:
        params: a tree of local parameter shards (inside ``shard_map``).
        specs: the parameters' spec tree (or prefix), as given to ``shard_map``.
        axis: the FSDP mesh axis; ``None``: the parameters are not sharded, nothing is gathered (``specs``
            is not read) and, without ``replicate_axis``, ``params`` is returned as it is.
        replicate_axis: HSDP's replica axis (or axes): the shards are made varying over it before the
            gather, so the backward all-reduces the small reduce-scattered shards (all of them in one
            bucketed collective), not the full gradients. With ``axis=None`` this is DDP: the replicated
            parameters are made varying over it, so their gradients are summed over the replicas.
        bucket: gather the leaves of one dtype (and the same varying axes) in one collective, as FSDP2 gathers
            a module's parameters: a flat buffer all-gathered once, its backward one reduce-scatter. False:
            one all-gather per leaf. The result is the same.
        precision: mixed precision (``fs.Precision``): every floating leaf is returned in its
            ``compute_dtype`` (the all-gather moves that dtype: half the bytes of float32 for bfloat16), and the
            gradients are reduce-scattered (and all-reduced over ``replicate_axis``) in its ``reduce_dtype``,
            then handed back in the parameters' own dtype. ``None``: no cast.
        prefetch: issue the all-gathers now and return a function that gives the tree when called: under
            ``dist`` the gathers travel meanwhile (FSDP2's prefetch: the next layer's weights while this layer
            computes); under ``sim`` they are done at once. The numbers are the same.

    Returns:
        The tree with ``axis`` gathered out of every leaf (other axes, e.g. ``tp``, stay sharded); with
        ``prefetch``, a function of no arguments returning it.

    Raises:
        ShardingError: ``specs`` does not fit ``params``, or ``axis`` is not the minor-most axis of a dim.

    Example:
        >>> # full = fsdp_gather(params, specs, axis="fsdp")  # wq: [d/fsdp, d] -> [d, d]
        >>> params = {"w": torch.randn(4, 3)}
        >>> fsdp_gather(params, {"w": P("fsdp", None)}, axis=None) is params  # no axis: the identity
        True
    """
    if not replicate_axis:
        replicate_axis = None
    mixed = precision is not None and precision.is_mixed
    if axis is None:  # not sharded: at most the replicas' gradient sum (identity forward, psum backward)
        done = _unsharded(params, replicate_axis, precision if mixed else None)
        return (lambda: done) if prefetch else done
    if replicate_axis is not None:
        params = _vary_over_replicas(params, replicate_axis, precision if mixed else None)
    leaves, treedef = optree.tree_flatten(params)
    flat_specs = pytree.broadcast_prefix(
        specs, params, prefix_is_leaf=is_spec, where="fsdp_gather: ", full_treedef=treedef
    )
    dims = _gathered_dims(params, leaves, flat_specs, axis)
    out = list(leaves)
    cast = (precision.compute_dtype, precision.reduce_dtype) if mixed else None
    issued = []
    with prefetch_scope(prefetch):
        for idx in _buckets(leaves, dims, bucket):
            issued.append((idx, _issue_bucket([leaves[i] for i in idx], axis, cast)))
    if mixed:  # the leaves not sharded over axis: cast (their gradients come back in the parameters' dtype)
        for i, leaf in enumerate(leaves):
            if i not in dims and isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                out[i] = leaf.to(precision.compute_dtype)

    def finish() -> Any:
        for idx, g in issued:
            if type(g).__name__ == "AsyncCollectiveTensor":  # dist's prefetch: waited for once, here
                g = call(_Settled, g)  # [n, ...] -> [n, ...]
            for i, full in zip(idx, _unpack_bucket(g, [leaves[i] for i in idx], [dims[i] for i in idx]), strict=True):
                out[i] = full
        return optree.tree_unflatten(treedef, out)

    return finish if prefetch else finish()


def _unsharded(params: Any, replicate_axis: str | tuple[str, ...] | None, precision: Precision | None) -> Any:
    """:func:`fsdp_gather` with ``axis=None``: ``params`` made varying over ``replicate_axis`` (the replicas'
    gradient sum: identity forward, psum backward) and cast to the compute dtype under a mixed ``precision``
    (``None``: no cast)."""
    if precision is None:
        return params if replicate_axis is None else lax.pvary(params, replicate_axis)
    if replicate_axis is None:
        return precision.cast_to_compute(params)
    # cast forward; backward: the gradients summed over the replicas in the reduce dtype, one bucket
    return _vary_cast(params, replicate_axis, precision.compute_dtype, precision.reduce_dtype)


def _vary_over_replicas(params: Any, replicate_axis: str | tuple[str, ...], precision: Precision | None) -> Any:
    """HSDP's shards made varying over ``replicate_axis`` before their gather: identity forward; backward: one
    bucketed psum over the replicas of all the shards' gradients (in the reduce dtype under a mixed
    ``precision``: the gathered leaves are cast by their all-gather, so here only the backward's dtype changes)."""
    if precision is not None:
        return _vary_cast(params, replicate_axis, precision.param_dtype, precision.reduce_dtype)
    return lax.pvary(params, replicate_axis)


def _gathered_dims(params: Any, leaves: list[Any], flat_specs: list[P], axis: str) -> dict[int, int]:
    """Leaf index -> the dim ``axis`` shards, for every tensor leaf sharded over it (checked: ``axis`` must be
    the minor-most axis of its dim)."""
    dims: dict[int, int] = {}
    for i, (leaf, spec) in enumerate(zip(leaves, flat_specs, strict=True)):
        if isinstance(leaf, torch.Tensor):
            d = _fsdp_dim(spec, leaf.dim(), axis)
            if d == -1:
                raise _misplaced(spec, leaf.dim(), axis, pytree.leaves_with_path(params)[i][0])
            if d is not None:
                dims[i] = d
    return dims


class _Settled(Prim):
    """Identity (forward and backward) that waits for a pending gathered bucket (dist's prefetch) once: the
    leaves cut from it are then plain views, where on the pending result each op on them (the unpacking views,
    then every layer op reading a weight) passes through its Python wrapper first (~600 such ops a step of the
    13.2M Llama). Applied with ``call(_Settled, g)``.

    - forward: ``y = g`` waited for (a plain tensor with ``g``'s varying axes).
    - backward: the cotangent as it is.
    """

    @staticmethod
    def forward(g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return settle(g)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _vary_cast(params: Any, axis: str | tuple[str, ...], dtype: torch.dtype, grad_dtype: torch.dtype) -> Any:
    """``pvary`` over ``axis`` of the floating leaves cast to ``dtype``, gradients summed in ``grad_dtype``."""
    leaves, treedef = optree.tree_flatten(params)
    floats = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    others = [i for i in range(len(leaves)) if i not in set(floats)]
    out = list(leaves)
    if floats:
        for i, y in zip(floats, pvary_cast([leaves[i] for i in floats], axis, dtype=dtype, grad_dtype=grad_dtype)):
            out[i] = y
    if others:
        for i, y in zip(others, lax.pvary([leaves[i] for i in others], axis)):
            out[i] = y
    return optree.tree_unflatten(treedef, out)


def _buckets(leaves: list[Any], dims: dict[int, int], bucket: bool) -> list[list[int]]:
    """The leaves to gather, grouped so that each group is one collective: by dtype, device and varying axes
    (so no leaf is made to vary over an axis it does not, which would change its gradient's reduction)."""
    if not bucket:
        return [[i] for i in dims]
    ctx = maybe_current()
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i in dims:
        t = leaves[i]
        vma = known_vma(t, ctx.check_vma) if ctx is not None else None
        groups.setdefault((t.dtype, t.device, vma), []).append(i)
    return list(groups.values())


def _issue_bucket(
    shards: list[torch.Tensor], axis: str, cast: tuple[torch.dtype, torch.dtype] | None = None
) -> torch.Tensor:
    """All-gather ``shards`` over ``axis`` in one collective: one leaf as it is (``[n, *s]``), several flattened
    into one buffer (``[n, sum numel_i]``). ``cast``: (forward dtype, gradient dtype) of mixed precision. Under
    ``dist`` with a prefetch the result is pending until :func:`_unpack_bucket` first reads it."""
    x = shards[0] if len(shards) == 1 else torch.cat([t.reshape(-1) for t in shards])  # [sum numel_i]
    if cast is None or not x.is_floating_point():
        return lax.all_gather(x, axis, dim=0, tiled=False)  # [*s] -> [n, *s]
    return all_gather_cast(x, axis, dim=0, tiled=False, dtype=cast[0], grad_dtype=cast[1])  # [*s] -> [n, *s]


def _unpack_bucket(g: torch.Tensor, shards: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
    """The gathered leaves of :func:`_issue_bucket`'s ``g``, each laid back out along its own dim ``dims[i]``
    (device ``r``'s block of each leaf is block ``r`` of its dim)."""
    if len(shards) == 1:
        d = dims[0]
        return [g.movedim(0, d).flatten(d, d + 1)]  # [n, .., s_d/n, ..] -> [.., n, s_d/n, ..] -> [.., s_d, ..]
    n = g.shape[0]
    out = []
    for t, d, part in zip(shards, dims, g.split([t.numel() for t in shards], dim=1), strict=True):
        # [n, numel_i] -> [n, .., s_d/n, ..] -> [.., n, s_d/n, ..] -> [.., s_d, ..]
        out.append(part.reshape(n, *t.shape).movedim(0, d).flatten(d, d + 1))
    return out


# ------------------------------------------------------------------------------------------ reshard-after-forward
def _raw(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a pending collective's result (its storage is allocated already; no wait)."""
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else t  # type: ignore[attr-defined]


def _key(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage lives (its data pointer; a meta tensor's: the storage itself, which has no memory), or
    None for a tensor without a plain storage."""
    try:
        raw = _raw(t)
        storage = raw.untyped_storage()
        ptr = storage._cdata if raw.is_meta else storage.data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):  # a wrapper subclass, a functorch wrapper
        return None
    return ptr or None


class _Arg:
    """A tensor argument of a recorded weight-derived op: a view (size, stride, offset) of a known storage."""

    __slots__ = ("key", "offset", "size", "stride")

    def __init__(self, key: int, t: torch.Tensor) -> None:
        t = _raw(t)
        self.key, self.size, self.stride, self.offset = key, tuple(t.shape), t.stride(), t.storage_offset()


class _Layer:
    """One scope's gathered weights once its forward is done: the storages that were theirs (and of the tensors
    computed from them alone), how to gather them again, and, once gathered again, the new leaves."""

    def __init__(self, regather: Callable[[], Any], before: _Layer | None, prefetch: bool) -> None:
        self.regather = regather
        self.before = None if before is None else weakref.ref(before)
        self.prefetch = prefetch
        self.sources: dict[int, tuple[int, int, torch.dtype]] = {}  # storage -> (leaf index, bytes, dtype)
        self.derived: dict[int, tuple[Any, Any, Any, int, torch.dtype]] = {}  # storage -> (op, args, kwargs, ..)
        self.dctx = maybe_current()
        self.vma_mode = current_vma_mode()
        self.pending: Any = None  # the issued regather (a function giving the tree, or the tree)
        self.leaves: list[Any] | None = None
        self.rebuilt: dict[int, torch.Tensor] = {}
        self.dropped = 0  # saved tensors dropped in the forward (restored in the backward)
        self.restored = 0
        self.prefetched = False  # the previous layer's regather issued from this one's backward

    def known(self, key: int | None) -> tuple[int, torch.dtype] | None:
        """(bytes, dtype) of a known storage, or None."""
        if key is None:
            return None
        hit = self.sources.get(key)
        if hit is not None:
            return hit[1], hit[2]
        d = self.derived.get(key)
        return None if d is None else (d[3], d[4])

    def issue(self) -> None:
        """Issue the regather (no gradient flows through it); under dist with a prefetch it travels meanwhile.

        First waits for the later layers' gradient reduce-scatters still in flight (issued as the backward now
        running started; they travelled during its first half): their full-size inputs are freed before another
        gathered buffer is allocated, so about one layer's buckets travel at a time."""
        if self.pending is None and self.leaves is None:
            _settle_pending()
            with torch.no_grad(), device_scope(self.dctx, None, self.vma_mode):
                self.pending = self.regather()

    def gathered(self) -> list[Any]:
        """The regathered leaves: issued now (or by the next layer's prefetch), then waited for. Not waited for
        here: the reduce-scatter autograd issued just before (a later layer's gradients; with the forward's
        prefetch, the gather's backward node runs once the layer it was issued in is differentiated too): it
        travels during this layer's backward until the previous layer's regather is issued (issue #11: waiting for
        it here cost 180-250 ms a step of the 13.2M Llama on 2 gloo ranks, 30-80 ms after)."""
        if self.leaves is None:
            self.issue()
            with torch.no_grad(), device_scope(self.dctx, None, self.vma_mode):
                tree = self.pending() if callable(self.pending) else self.pending
                self.leaves = [settle(t) for t in optree.tree_leaves(tree)]
            self.pending = None
        return self.leaves

    def restore(self, a: _Arg) -> torch.Tensor:
        """The saved tensor ``a`` describes, over the regathered weights; once half of this layer's dropped saved
        tensors are restored, the previous layer's regather is issued (under dist it travels during the rest of
        this layer's backward).

        Not at this layer's first restore (FSDP2's place, where its CPU prefetch is synchronous): the layer's
        backward starts with its largest activation gradients (the MLP's), and a gloo all-gather in flight holds
        a second copy of its output (``ProcessGroupGloo::allgather`` gathers into a flat temporary, then copies)
        besides the output itself, so an early prefetch puts up to two layers' gathered size on top of this
        layer's peak. Past the half, the layer's first saved activations are freed already."""
        t = self.view(a.key, a.size, a.stride, a.offset)
        self.restored += 1
        if self.prefetch and not self.prefetched and 2 * self.restored >= self.dropped:
            self.prefetched = True
            before = None if self.before is None else self.before()
            if before is not None:
                before.issue()  # the layer whose backward comes next: its weights travel while this one's ends
        return t

    def base(self, key: int) -> torch.Tensor:
        """A tensor over the regathered (or rebuilt) storage that was ``key`` in the forward."""
        hit = self.sources.get(key)
        if hit is not None:
            t = self.gathered()[hit[0]]
        else:
            t = self.rebuilt.get(key)
            if t is None:
                func, args, kwargs, _, _ = self.derived[key]
                with torch.no_grad():
                    t = func(*optree.tree_map(self._fill, args), **optree.tree_map(self._fill, kwargs))
                self.rebuilt[key] = t
        nbytes, dtype = self.known(key)  # type: ignore[misc]
        if t.untyped_storage().nbytes() != nbytes or t.dtype != dtype:
            raise RuntimeError(  # the regather is not the forward's gather (a different layout): never silently
                f"reshard_after_forward: the regathered weights do not have the forward's layout "
                f"({t.untyped_storage().nbytes()} bytes of {t.dtype}, expected {nbytes} of {dtype}); regather must "
                f"run the same gather as the forward."
            )
        return t

    def _fill(self, a: Any) -> Any:
        return self.view(a.key, a.size, a.stride, a.offset) if isinstance(a, _Arg) else a

    def view(self, key: int, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
        return self.base(key).as_strided(size, stride, offset)


class _Dropped:
    """What autograd keeps of a saved (view of a) gathered weight: where it was; the tensor is rebuilt on unpack."""

    __slots__ = ("args", "layer")

    def __init__(self, layer: _Layer, key: int, t: torch.Tensor) -> None:
        self.layer, self.args = layer, _Arg(key, t)

    def restore(self) -> torch.Tensor:
        return self.layer.restore(self.args)


_local = threading.local()  # .pending: weakrefs to gradients of resharded shards, maybe still in flight (dist)


def _hold(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    """A post-hook on the gather's backward node: note its results (reduce-scatters) that are still in flight."""
    for g in grad_inputs:
        if type(g).__name__ == "AsyncCollectiveTensor":
            pending = getattr(_local, "pending", None)
            if pending is None:
                pending = _local.pending = []
            pending.append(weakref.ref(g))


def _gather_nodes(leaves: list[Any], depth: int = 8) -> list[Any]:
    """The backward nodes of the all-gathers the gathered ``leaves`` come from (a few view / split nodes up)."""
    found, seen = [], set()
    frontier = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if node is None or node in seen:
                continue
            seen.add(node)
            if "AllGather" in type(node).__name__:
                found.append(node)
            else:
                nxt.extend(n for n, _ in node.next_functions)
        frontier = nxt
    return found


def _settle_pending() -> None:
    """Wait for the shards' gradient reductions still in flight (dist's overlapped reduce-scatters of the layers
    whose backward is done): each holds a full-size gradient bucket until waited for, so one layer's travel
    while the next is differentiated, not every layer's until the step ends."""
    pending, _local.pending = getattr(_local, "pending", None), None
    for ref in pending or ():
        g = ref()
        if g is not None:
            settle(g)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.restore() if type(packed) is _Dropped else packed


def _tensors(args: Any) -> list[Any]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class _Derive(TorchDispatchMode):
    """Records the ops computed from the gathered weights alone (a cast, a concatenation), so that a saved result
    of one is rebuilt from the regathered weights too; refuses an in-place write into them."""

    def __init__(self, layer: _Layer, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.layer, self.held = layer, held

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        layer = self.layer
        if schema.is_mutable:
            for a, v in zip(schema.arguments, args, strict=False):
                if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor):
                    if layer.known(_key(v)) is not None:
                        raise ConfigError(
                            f"reshard_after_forward: {func} writes in place into the gathered weights; they are "
                            f"gathered again for the backward, so the write would be lost. Compute out of place."
                        )
            return out
        if not isinstance(out, torch.Tensor) or any(r.alias_info is not None for r in schema.returns):
            return out  # a view of a known storage is known by its storage already
        if torch.Tag.nondeterministic_seeded in func.tags:
            return out
        ins = _tensors(args) + _tensors(kwargs.values())
        if not ins:
            return out
        keys = [_key(t) for t in ins]
        if any(layer.known(k) is None for k in keys):
            return out
        k_out = _key(out)
        if k_out is None or layer.known(k_out) is not None:
            return out
        it = iter(keys)

        def arg(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return _Arg(next(it), a)
            if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
                return type(a)(arg(t) for t in a)
            return a

        rec_args = tuple(arg(a) for a in args)
        rec_kwargs = {n: arg(v) for n, v in kwargs.items()}
        layer.derived[k_out] = (func, rec_args, rec_kwargs, out.untyped_storage().nbytes(), out.dtype)
        self.held.append(out)  # its storage is not reused by another tensor while the scope may still pack
        return out


class reshard_after_forward:
    """A scope around one layer's forward on gathered weights (FSDP2's ``reshard_after_forward=True`` without
    activation checkpointing): the tensors autograd saves that are the gathered weights, views of them
    (transposes, slices) or computed from them alone (casts, concatenations) are not kept; the backward gathers
    the weights again (``regather``: the same collective on every device, in the same order, under ``sim`` and
    ``dist``) and rebuilds them, bit for bit. No gradient flows through the regather: the gradients still go
    through the forward's gather (its reduce-scatter).

    The forward's gathered weights are then freed as soon as the caller drops them (after the layer): memory
    holds one layer's gathered weights in the forward (two with the next layer's prefetch) and, in the backward,
    the layer being differentiated (plus, with ``prefetch``, the one before it, whose regather is issued once half
    of this layer's dropped saved tensors are restored, and travels during the rest of its backward under
    ``dist``). Outside a gradient computation, or under a ``torch.func`` transform (which has no saved-tensor
    hooks), it does nothing: the weights are kept.

    Args:
        gathered: the tree of gathered weights the layer uses (``fsdp_gather``'s result).
        regather: gathers them again, as the forward did: returns the tree, or a function of no arguments
            returning it (``fsdp_gather(..., prefetch=True)``). Called once, in the backward, without grad.
        after: the scope of the layer before this one (its regather is prefetched when this one's runs).
        prefetch: issue ``after``'s regather during this layer's backward (once half of its dropped saved tensors
            are restored: past the layer's largest activation gradients).
        derive: record the ops computed from the weights alone (a ``TorchDispatchMode`` over the layer's
            forward, every op through Python), so that their saved results are dropped and rebuilt too. False:
            no mode; only the weights and their views are dropped, a saved cast or concatenation of them is
            kept as autograd keeps it (the same numbers, more memory), and an in-place write into the weights is
            found by their version counters as the scope ends. For a layer that reads its weights through views
            only (``F.linear``'s transpose), as the Llama's, the same memory at less CPU.

    Under ``dist`` with ``FUNCSHARD_OVERLAP`` the gradient reduce-scatters of the forward's gather stay in flight
    until a later layer's regather is issued: each scope waits for those still pending before it issues its
    regather (half-way through the backward of the layer after it, with ``prefetch``), so about one layer's
    gradient buckets travel at a time, not every layer's until the step ends, and a reduce-scatter issued as a
    layer's backward starts travels during its first half.

    Raises:
        ConfigError: the layer writes into the gathered weights in place (with ``derive=False``: as the scope
            ends).

    Example:
        >>> import funcshard as fs
        >>> from funcshard import P
        >>> mesh = fs.make_mesh({"fsdp": 2}, backend="sim")
        >>> specs = {"w": P("fsdp", None)}
        >>> def loss(p, x):
        ...     full = fsdp_gather(p, specs)  # w: [4/2, 3] -> [4, 3]
        ...     with reshard_after_forward(full, lambda: fsdp_gather(p, specs)):
        ...         y = torch.tanh(x @ full["w"].T) @ full["w"]  # [b, 3] @ [3, 4] @ [4, 3]: saves w, dropped
        ...     return fs.pmean(y.pow(2).mean(), "fsdp")
        >>> step = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=(P(), specs))
        >>> with fs.comm_stats() as stats:
        ...     _, g = step({"w": torch.ones(4, 3)}, torch.ones(8, 3))
        >>> tuple(g["w"].shape), stats.calls("all_gather")  # the forward's gather and the backward's regather
        ((4, 3), 2)
    """

    def __init__(
        self,
        gathered: Any,
        regather: Callable[[], Any],
        *,
        after: reshard_after_forward | None = None,
        prefetch: bool = True,
        derive: bool = True,
    ) -> None:
        if not callable(regather):
            raise ConfigError(f"reshard_after_forward: regather must be a function, found {type(regather).__name__}.")
        self._gathered = gathered
        self._regather = regather
        self._after = after
        self._prefetch = prefetch
        self._derive = derive
        self._versions: list[tuple[torch.Tensor, int]] = []  # derive=False: the weights' versions at the start
        self.layer: _Layer | None = None
        self._held: list[Any] = []
        self._hooks: Any = None
        self._mode: _Derive | None = None

    def __enter__(self) -> reshard_after_forward:
        if not torch.is_grad_enabled() or only_grad_transforms() is not None:
            return self  # nothing saved for a backward / torch.func's own graph: the weights are kept
        before = None if self._after is None else self._after.layer
        layer = _Layer(self._regather, before, self._prefetch)
        for j, t in enumerate(optree.tree_leaves(self._gathered)):
            k = _key(t) if isinstance(t, torch.Tensor) else None
            if k is not None:
                raw = _raw(t)
                layer.sources.setdefault(k, (j, raw.untyped_storage().nbytes(), raw.dtype))
                self._held.append(t)
        self._gathered = None
        self.layer = layer
        for node in _gather_nodes(self._held):  # their reduce-scatters: waited for at the next regather
            node.register_hook(_hold)

        def pack(t: torch.Tensor) -> Any:
            k = _key(t)
            hit = layer.known(k)
            if hit is not None and hit[1] == _raw(t).dtype:
                layer.dropped += 1
                return _Dropped(layer, k, t)  # type: ignore[arg-type]
            # not the tensor itself: an op's saved output would hold its own grad_fn, a cycle through C++
            return t.detach()

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._hooks.__enter__()
        if self._derive:
            self._mode = _Derive(layer, self._held)
            self._mode.__enter__()
        else:
            self._versions = [(r, r._version) for r in map(_raw, self._held)]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        versions, self._versions = self._versions, []
        self._held = []
        self._gathered = None
        if exc[0] is None and any(t._version != v for t, v in versions):
            raise ConfigError(
                "reshard_after_forward: the layer wrote in place into the gathered weights; they are gathered "
                "again for the backward, so the write would be lost. Compute out of place."
            )

    def regather_at(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` through an identity whose backward issues this scope's regather: under ``dist`` it travels from
        the moment the backward reaches ``t`` until the layer's backward first reads it (FSDP2's root
        pre-backward, which prefetches the last block while the output head is differentiated). ``t`` itself
        when the scope did nothing (no gradient computation, or a ``torch.func`` transform).

        Example:
            >>> # with reshard_after_forward(full, regather) as last: h = layer(h, full)
            >>> # logits = last.regather_at(head(h))  # the backward issues the layer's regather here
            >>> scope = reshard_after_forward({}, lambda: {})
            >>> x = torch.ones(2)
            >>> scope.regather_at(x) is x  # never entered: nothing to regather
            True
        """
        if self.layer is None:
            return t
        return call(_IssueOnBackward, t, self.layer)  # [...] -> [...]


class _IssueOnBackward(Prim):
    """Identity forward; the backward issues a reshard scope's regather (:meth:`reshard_after_forward.regather_at`)
    and passes the gradient through. Applied with ``call(_IssueOnBackward, t, layer)``.

    - forward: ``y = t`` (a view).
    - backward: ``layer``'s regather issued; the cotangent as it is.
    """

    @staticmethod
    def forward(t: torch.Tensor, layer: _Layer) -> torch.Tensor:  # type: ignore[override]
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.layer = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.layer.issue()
        return grad, None


def fsdp_unsharded_specs(specs: Any, *, axis: str | None = "fsdp") -> Any:
    """The spec tree with ``axis`` removed: the layout :func:`fsdp_gather` returns (``specs`` itself when
    ``axis`` is None).

    Example:
        >>> fsdp_unsharded_specs({"w": P(("tp", "fsdp"), None)})
        {'w': P('tp', None)}
    """
    if axis is None:
        return specs

    def drop(s: P) -> P:
        entries = []
        for e in s.entries:
            axes = (e,) if isinstance(e, str) else tuple(e or ())
            kept = tuple(a for a in axes if a != axis)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return P(*entries)

    return optree.tree_map(drop, specs, is_leaf=is_spec)
