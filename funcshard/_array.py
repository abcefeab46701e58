"""``fs.Array``: a global value laid out over a mesh, and ``device_put`` / ``device_get`` / ``reshard``.

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

from . import pytree
from ._errors import ShardingError
from ._mesh import Mesh
from ._spec import P, block_index, check_spec, format_mesh, is_spec, shard_slices

__all__ = ["Array", "device_get", "device_put", "local_shards", "reshard"]

PyTree = Any
Coords = tuple[int, ...]


class Array:
    """A global value of ``shape`` laid out over ``mesh`` by ``spec``; each device holds one block.

    Attributes:
        mesh: the mesh.
        spec: the layout.
        shape: the global shape.
        dtype: the element type.
        shards: dict of device coordinates (a tuple in axis order) -> that device's block; every device
            under ``"sim"``, this process's under ``"dist"``.

    Example:
        >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")  # doctest: +SKIP
        >>> fs.device_put(torch.zeros(4, 6), mesh, P(None, "tp"))  # doctest: +SKIP
        Array(shape=(4, 6), dtype=torch.float32, spec=P(None, 'tp'), mesh={'tp': 2}, backend='sim')
    """

    __slots__ = ("dtype", "mesh", "shape", "shards", "spec")

    def __init__(
        self, mesh: Mesh, spec: P, shape: tuple[int, ...], dtype: torch.dtype, shards: dict[Coords, torch.Tensor]
    ) -> None:
        self.mesh = mesh
        self.spec = spec
        self.shape = tuple(shape)
        self.dtype = dtype
        self.shards = shards

    @property
    def local(self) -> torch.Tensor:
        """This process's shard (``"dist"``).

        Raises:
            ShardingError: under ``"sim"``, where one process holds every device's shard.
        """
        if self.mesh.backend == "sim":
            raise ShardingError(
                f"Array.local: under the 'sim' backend this process holds all {self.mesh.size} devices' shards; "
                f"use .shards[coords] (e.g. .shards[{tuple(0 for _ in self.mesh.axis_names)}]) or fs.device_get(a)."
            )
        return next(iter(self.shards.values()))

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @property
    def requires_grad(self) -> bool:
        """True when any local shard requires grad."""
        return any(s.requires_grad for s in self.shards.values())

    def __repr__(self) -> str:
        return (
            f"Array(shape={self.shape}, dtype={self.dtype}, spec={self.spec!r}, mesh={format_mesh(self.mesh)}, "
            f"backend='{self.mesh.backend}')"
        )


def _is_array(x: Any) -> bool:
    return isinstance(x, Array)


def _local_coords(mesh: Mesh) -> list[Coords]:
    if mesh.backend == "sim":
        return [tuple(c.values()) for c in mesh.device_coords()]
    from ._backend import dist as dist_backend

    return [tuple(mesh.coords_of(dist_backend.process_rank()).values())]


def _target_device(mesh: Mesh) -> torch.device | None:
    if mesh.backend == "dist":
        from ._backend import dist as dist_backend

        return dist_backend.tensor_device()
    return None


def local_shards(x: torch.Tensor, mesh: Mesh, spec: P) -> dict[Coords, torch.Tensor]:
    """The blocks of full tensor ``x`` held by this process's devices (views of ``x``)."""
    dev = _target_device(mesh)
    if dev is not None:
        x = x.to(dev)
    names = mesh.axis_names
    out = {}
    for c in _local_coords(mesh):
        block = x[shard_slices(x.shape, spec, mesh.shape, dict(zip(names, c, strict=True)))]
        if mesh.backend == "dist" and block.numel() < x.numel():
            block = block.clone()  # own storage: the process keeps its shard, not the whole tensor
        out[c] = block
    return out


def device_put(x: PyTree, mesh: Mesh, spec: PyTree = None) -> PyTree:
    """Lay out ``x`` (a tensor or a tree of them) over ``mesh`` by ``spec`` (a spec or a spec-tree prefix).

    Every process keeps only the blocks it owns. Under ``"dist"`` every process passes the same full value.
    An ``fs.Array`` on the same mesh is resharded.

    Raises:
        ShardingError: a spec that does not fit its leaf (the message names the leaf path).

    Example:
        >>> w = device_put(torch.randn(8, 4), fs.make_mesh({"tp": 2}, backend="sim"), P("tp"))  # doctest: +SKIP
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"device_put: expected an fs.Mesh from fs.make_mesh, found {type(mesh).__name__}.")
    spec = P() if spec is None else spec
    leaves, treedef = optree.tree_flatten(x, is_leaf=_is_array)
    paths = [p for p, _ in pytree.leaves_with_path(x, is_leaf=_is_array)]
    specs = pytree.broadcast_prefix(spec, x, prefix_is_leaf=is_spec, where="device_put: ", what="spec tree")
    out = []
    for path, leaf, s in zip(paths, leaves, specs, strict=True):
        if isinstance(leaf, Array):
            if leaf.mesh != mesh:
                leaf = device_get(leaf)
            else:
                out.append(reshard(leaf, s))
                continue
        if not isinstance(leaf, torch.Tensor):
            raise ShardingError(
                f"device_put at '{path}': leaves must be torch.Tensors, found {type(leaf).__name__}; "
                f"convert with torch.as_tensor first."
            )
        check_spec(s, leaf.shape, mesh, path=path, fn="device_put")
        out.append(Array(mesh, s, tuple(leaf.shape), leaf.dtype, local_shards(leaf, mesh, s)))
    return optree.tree_unflatten(treedef, out)


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

    Under ``"dist"`` this gathers (a collective: every process must call it). Differentiable.

    Example:
        >>> full = device_get(w)  # doctest: +SKIP
    """

    def one(a: Any) -> Any:
        if not isinstance(a, Array):
            return a
        if a.mesh.backend == "sim":
            return _assemble(a)
        return reshard(a, P()).local

    return optree.tree_map(one, x, is_leaf=_is_array)


def reshard(x: PyTree, spec: PyTree) -> PyTree:
    """The same value laid out by ``spec``, moved with the fewest collectives.

    Blocks already present are sliced (no communication); an axis that moves from one dim to another is
    one all-to-all; an axis that leaves the layout is one all-gather.

    Example:
        >>> w2 = reshard(w, P("tp", None))  # doctest: +SKIP
    """
    leaves, treedef = optree.tree_flatten(x, is_leaf=_is_array)
    paths = [p for p, _ in pytree.leaves_with_path(x, is_leaf=_is_array)]
    specs = pytree.broadcast_prefix(spec, x, prefix_is_leaf=is_spec, where="reshard: ", what="spec tree")
    out = []
    for path, a, s in zip(paths, leaves, specs, strict=True):
        if not isinstance(a, Array):
            raise ShardingError(f"reshard at '{path}': expected an fs.Array, found {type(a).__name__}; use device_put.")
        check_spec(s, a.shape, a.mesh, path=path, fn="reshard")
        out.append(a if s == a.spec else _reshard_one(a, s))
    return optree.tree_unflatten(treedef, out)


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return b[: len(a)] == a


def reshard_plan(src: P, dst: P, ndim: int) -> list[tuple[Any, ...]]:
    """The collectives that take layout ``src`` to ``dst``: a list of steps
    ``("all_to_all", axis, split_dim, concat_dim)``, ``("all_gather", axes, dim)``, ``("slice", axes, dim)``.

    Example:
        >>> reshard_plan(P("a"), P(None, "a"), 2)
        [('all_to_all', 'a', 1, 0)]
    """
    cur = list(src.dim_axes(ndim))
    want = list(dst.dim_axes(ndim))
    steps: list[tuple[Any, ...]] = []
    while True:
        step = None
        for i in range(ndim):
            if cur[i] and not _is_prefix(cur[i], want[i]):
                a = cur[i][-1]
                for j in range(ndim):
                    if j != i and _is_prefix((*cur[j], a), want[j]):
                        step = ("all_to_all", a, j, i)
                        cur[i], cur[j] = cur[i][:-1], (*cur[j], a)
                        break
            if step:
                break
        if step is None:
            for i in range(ndim):
                if not _is_prefix(cur[i], want[i]):
                    k = 0
                    while k < min(len(cur[i]), len(want[i])) and cur[i][k] == want[i][k]:
                        k += 1
                    step = ("all_gather", cur[i][k:], i)
                    cur[i] = cur[i][:k]
                    break
        if step is None:
            break
        steps.append(step)
    for j in range(ndim):
        extra = want[j][len(cur[j]) :]
        if extra:
            steps.append(("slice", extra, j))
    return steps


def _reshard_one(a: Array, dst: P) -> Array:
    from . import lax
    from ._shard_map import shard_map

    steps = reshard_plan(a.spec, dst, a.ndim)

    def body(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            if step[0] == "all_to_all":
                _, axis, split_dim, concat_dim = step
                x = lax.all_to_all(
                    x, axis, split_dim, concat_dim, tiled=True
                )  # [.., s_j, .., s_i/n, ..] -> [.., s_j/n, .., s_i, ..]
            elif step[0] == "all_gather":
                _, axes, d = step
                x = lax.all_gather_invariant(x, axes, dim=d, tiled=True)  # [.., s_d/n, ..] -> [.., s_d, ..]
            else:
                _, axes, d = step
                x = lax.pvary(x, axes)  # the backward psum collects every device's block of the cotangent
                n = lax.axis_size(axes)
                size = x.shape[d] // n
                x = x.narrow(d, lax.axis_index_int(axes) * size, size)
        return x

    return shard_map(body, mesh=a.mesh, in_specs=(a.spec,), out_specs=dst, check_vma=False)(a)
