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
from .._errors import ShardingError
from .._spec import P, is_spec

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
    params: Any, specs: Any, *, axis: str | None = "fsdp", replicate_axis: str | tuple[str, ...] | None = None
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
    out = []
    for path, leaf, spec in zip(paths, leaves, flat_specs, strict=True):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        d = _fsdp_dim(spec, leaf.dim(), axis, path)
        if d is not None:
            leaf = lax.all_gather(leaf, axis, dim=d, tiled=True)  # [.., s_d/n, ..] -> [.., s_d, ..]
        out.append(leaf)
    return optree.tree_unflatten(treedef, out)


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
