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
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .. import lax, pytree
from .._backend.base import prefetch_scope
from .._context import maybe_current
from .._errors import ShardingError
from .._precision import Precision
from .._spec import P, is_spec
from .._vma import known_vma

__all__ = ["fsdp_gather", "fsdp_unsharded_specs"]


def _fsdp_dim(spec: P, ndim: int, axis: str, path: str) -> int | None:
    for d, axes in enumerate(spec.dim_axes(ndim)):
        if axis in axes:
            if axes[-1] != axis:
                raise ShardingError(
                    f"fsdp_gather at '{path}': spec {spec!r} puts '{axis}' before {axes[axes.index(axis) + 1 :]} "
                    f"in dim {d}; the FSDP axis must be the minor-most (last) axis of its dim, e.g. "
                    f"P(('tp', '{axis}')), so that gathering it gives one contiguous block."
                )
            return d
    return None


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
        if not mixed:
            done = params if replicate_axis is None else lax.pvary(params, replicate_axis)
        elif replicate_axis is None:
            done = precision.cast_to_compute(params)
        else:  # cast forward; backward: the gradients summed over the replicas in the reduce dtype, one bucket
            done = _vary_cast(params, replicate_axis, precision.compute_dtype, precision.reduce_dtype)
        return (lambda: done) if prefetch else done
    flat_specs = pytree.broadcast_prefix(specs, params, prefix_is_leaf=is_spec, where="fsdp_gather: ")
    if replicate_axis is not None:
        # identity forward; backward: one bucketed psum over the replicas of all the shards' gradients (in the
        # reduce dtype under mixed precision: the gathered leaves are cast by their all-gather, so here only the
        # backward's dtype changes)
        if mixed:
            params = _vary_cast(params, replicate_axis, precision.param_dtype, precision.reduce_dtype)
        else:
            params = lax.pvary(params, replicate_axis)
    leaves, treedef = optree.tree_flatten(params)
    paths = [p for p, _ in pytree.leaves_with_path(params)]
    dims: dict[int, int] = {}
    for i, (path, leaf, spec) in enumerate(zip(paths, leaves, flat_specs, strict=True)):
        if isinstance(leaf, torch.Tensor):
            d = _fsdp_dim(spec, leaf.dim(), axis, path)
            if d is not None:
                dims[i] = d
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
            for i, full in zip(idx, _unpack_bucket(g, [leaves[i] for i in idx], [dims[i] for i in idx]), strict=True):
                out[i] = full
        return optree.tree_unflatten(treedef, out)

    return finish if prefetch else finish()


def _vary_cast(params: Any, axis: str | tuple[str, ...], dtype: torch.dtype, grad_dtype: torch.dtype) -> Any:
    """``pvary`` over ``axis`` of the floating leaves cast to ``dtype``, gradients summed in ``grad_dtype``."""
    leaves, treedef = optree.tree_flatten(params)
    floats = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    others = [i for i in range(len(leaves)) if i not in set(floats)]
    out = list(leaves)
    if floats:
        for i, y in zip(floats, lax.pvary_cast([leaves[i] for i in floats], axis, dtype=dtype, grad_dtype=grad_dtype)):
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
    return lax.all_gather_cast(x, axis, dim=0, tiled=False, dtype=cast[0], grad_dtype=cast[1])  # [*s] -> [n, *s]


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
