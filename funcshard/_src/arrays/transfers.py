"""``fs.Array`` and the moves between layouts: ``device_put`` / ``device_get`` / ``reshard``, built on ``shard_map``.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> w = fs.device_put(torch.arange(8.0).reshape(2, 4), mesh, P(None, "tp"))
    >>> w.shards[(0, 1)]
    tensor([[2., 3.],
            [6., 7.]])
    >>> torch.equal(fs.device_get(fs.reshard(w, P("dp"))), torch.arange(8.0).reshape(2, 4))
    True
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from ..errors import ShardingError
from ..runtime.context import user_call
from ..runtime.mesh import Mesh
from ..shard_map.api import shard_map
from ..tree import pytree
from ..tree.shapes import ShapeDtype, to_meta
from ..tree.spec import P, block_index, check_spec, is_spec
from .array import Array, is_array, local_shards
from .reshard import reshard_plan

__all__ = ["Array", "device_get", "device_put", "reshard", "reshard_plan"]

PyTree = Any


def device_put(x: PyTree, mesh: Mesh, spec: PyTree = None) -> PyTree:
    """Lay out ``x`` (a tensor or a tree of them) over ``mesh`` by ``spec`` (a spec or a spec-tree prefix).

    Every process keeps only the blocks it owns. Under ``"dist"`` every process passes the same full value.
    An ``fs.Array`` on the same mesh is resharded. The blocks share no memory with ``x`` (under ``"sim"`` they
    are views of one copy of it), so writing into ``x`` afterwards leaves the Array as it was.

    Raises:
        ShardingError: a spec that does not fit its leaf (the message names the leaf path).

    Example:
        >>> w = device_put(torch.randn(8, 4), fs.make_mesh({"tp": 2}, backend="sim"), P("tp"))  # doctest: +SKIP
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"device_put: expected an fs.Mesh from fs.make_mesh, found {type(mesh).__name__}.")
    spec = P() if spec is None else spec
    leaves, treedef = optree.tree_flatten(x, is_leaf=is_array)
    paths = [p for p, _ in pytree.leaves_with_path(x, is_leaf=is_array)]
    specs = pytree.broadcast_prefix(spec, x, prefix_is_leaf=is_spec, where="device_put: ", what="spec tree")
    out = []
    for path, leaf, s in zip(paths, leaves, specs, strict=True):
        if isinstance(leaf, Array):
            if leaf.mesh != mesh:
                leaf = device_get(leaf)
            else:
                out.append(reshard(leaf, s))
                continue
        if isinstance(leaf, ShapeDtype) and not mesh.backend_impl.holds_data:
            leaf = to_meta(leaf)
        if not isinstance(leaf, torch.Tensor):
            abstract = isinstance(leaf, ShapeDtype)
            hint = " (fs.ShapeDtype leaves go on a mesh with backend='abstract')" if abstract else ""
            raise ShardingError(
                f"device_put at '{path}': leaves must be torch.Tensors{hint}, found {type(leaf).__name__}; "
                f"convert with torch.as_tensor first."
            )
        check_spec(s, leaf.shape, mesh, path=path, fn="device_put")
        shards = local_shards(leaf, mesh, s)
        if any(_shares_storage(t, leaf) for t in shards.values()):
            # blocks that are views of the caller's tensor would follow its later in-place writes (a batch
            # buffer refilled each step): cut them from one private copy instead, as JAX's device_put copies
            shards = local_shards(leaf.clone(), mesh, s)
        out.append(Array(mesh, s, tuple(leaf.shape), leaf.dtype, shards))
    return optree.tree_unflatten(treedef, out)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # a torch.func wrapper has no storage to ask: copy to be sure
        return True


def _assemble(a: Array) -> torch.Tensor:
    """Concatenate the blocks of a ``"sim"`` Array (differentiable)."""
    names = a.mesh.axis_names
    dims = a.spec.dim_axes(a.ndim)
    counts = [math.prod(a.mesh.shape[x] for x in axes) for axes in dims]
    by_block: dict[tuple[int, ...], torch.Tensor] = {}
    for c, t in a.shards.items():
        coords = dict(zip(names, c, strict=True))
        key = tuple(block_index(axes, coords, a.mesh.shape)[0] for axes in dims)
        by_block.setdefault(key, t)

    def build(prefix: tuple[int, ...], d: int) -> torch.Tensor:
        if d == a.ndim:
            return by_block[prefix]
        parts = [build((*prefix, i), d + 1) for i in range(counts[d])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

    if a.ndim == 0:
        return next(iter(a.shards.values()))
    return build((), 0)


def device_get(x: PyTree) -> PyTree:
    """The whole value of each ``fs.Array`` in ``x``, as a torch.Tensor, on every process.

    Under ``"dist"`` this gathers (a collective: every process must call it). Differentiable. The result is
    the caller's own tensor, as JAX's ``device_get`` gives a host copy: it shares no memory with the Array's
    device blocks, so a later call that writes them in place (one the Array is donated to) leaves it as it
    was, and writing into it leaves the Array as it was.

    Example:
        >>> full = device_get(w)  # doctest: +SKIP
    """

    def one(a: Any) -> Any:
        if not isinstance(a, Array):
            return a
        if not a.mesh.backend_impl.holds_data:  # an abstract Array: the whole value's shape, no data
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        full = reshard(a, P()).local if a.mesh.is_multiprocess else _assemble(a)
        if math.prod(a.mesh.shape[n] for n in a.spec.axes) == 1:
            # one block is the whole value (a replicated Array, or axes of size 1): that device's own buffer,
            # so copy it; more blocks were concatenated or gathered into a new tensor already
            full = full.clone()
        return full

    with user_call("fs.device_get"):  # a peer that never calls it: the error names device_get, not its gather
        return optree.tree_map(one, x, is_leaf=is_array)


def reshard(x: PyTree, spec: PyTree) -> PyTree:
    """The same value laid out by ``spec``, moved with the fewest collectives.

    Blocks already present are sliced (no communication); an axis that moves from one dim to another is
    one all-to-all; an axis that leaves the layout is one all-gather. All the leaves of a tree that live on
    one mesh move in one shard_map call.

    Example:
        >>> w2 = reshard(w, P("tp", None))  # doctest: +SKIP
    """
    leaves, treedef = optree.tree_flatten(x, is_leaf=is_array)
    paths = [p for p, _ in pytree.leaves_with_path(x, is_leaf=is_array)]
    specs = pytree.broadcast_prefix(spec, x, prefix_is_leaf=is_spec, where="reshard: ", what="spec tree")
    out = list(leaves)
    moves: dict[Mesh, list[int]] = {}
    for k, (path, a, s) in enumerate(zip(paths, leaves, specs, strict=True)):
        if not isinstance(a, Array):
            raise ShardingError(f"reshard at '{path}': expected an fs.Array, found {type(a).__name__}; use device_put.")
        check_spec(s, a.shape, a.mesh, path=path, fn="reshard")
        if s != a.spec:
            moves.setdefault(a.mesh, []).append(k)
    with user_call("fs.reshard"):  # a peer that never calls it: the error names reshard, not its collectives
        for mesh, idx in moves.items():
            dst = [specs[k] for k in idx]
            # an identity whose in_specs differ from the arguments' layouts: the executor runs the fewest
            # collectives (see _reshard.reshard_plan) on the devices before it
            moved = shard_map(_identity, mesh=mesh, in_specs=(dst,), out_specs=dst, check_vma=False)(
                [leaves[k] for k in idx]
            )
            for k, a in zip(idx, moved, strict=True):
                out[k] = a
    return optree.tree_unflatten(treedef, out)


def _identity(x: PyTree) -> PyTree:
    return x
