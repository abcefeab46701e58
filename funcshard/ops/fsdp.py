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
from .._context import maybe_current
from .._errors import ShardingError
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

    Returns:
        The tree with ``axis`` gathered out of every leaf (other axes, e.g. ``tp``, stay sharded).

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
    if axis is None:  # not sharded: at most the replicas' gradient sum (identity forward, psum backward)
        return params if replicate_axis is None else lax.pvary(params, replicate_axis)
    flat_specs = pytree.broadcast_prefix(specs, params, prefix_is_leaf=is_spec, where="fsdp_gather: ")
    if replicate_axis is not None:
        # identity forward; backward: one bucketed psum over the replicas of all the shards' gradients
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
    for idx in _buckets(leaves, dims, bucket):
        gathered = _gather_bucket([leaves[i] for i in idx], [dims[i] for i in idx], axis)
        for i, full in zip(idx, gathered, strict=True):
            out[i] = full
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


def _gather_bucket(shards: list[torch.Tensor], dims: list[int], axis: str) -> list[torch.Tensor]:
    """All-gather ``shards`` over ``axis``, each along its own dim ``dims[i]``, in one collective: the shards
    flattened into one buffer, gathered, split and laid back out (device ``r``'s block of each leaf is block
    ``r`` of its dim)."""
    if len(shards) == 1:
        return [lax.all_gather(shards[0], axis, dim=dims[0], tiled=True)]  # [.., s_d/n, ..] -> [.., s_d, ..]
    n = lax.axis_size(axis)
    flat = torch.cat([t.reshape(-1) for t in shards])  # [sum numel_i]: this device's shards, one after another
    g = lax.all_gather(flat, axis, dim=0, tiled=False)  # [sum numel_i] -> [n, sum numel_i]
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
