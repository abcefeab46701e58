"""Hand-off between ``fs.Array`` and torch's ``DTensor`` under ``"dist"``, over one ``DeviceMesh`` per mesh
(built on funcshard's own process groups), so tools that take DTensors (DCP state dicts, FSDP2 modules,
``parallelize_module``) mix with funcshard code. No data moves: a block is a block.

Example:
    >>> # under torchrun, mesh = fs.make_mesh({"dp": 2, "tp": 2}):
    >>> # dt = fs.to_dtensor(fs.device_put(w, mesh, P(None, "tp")))  # placements (Replicate(), Shard(1))
    >>> # a = fs.from_dtensor(dt)                                     # Array with spec P(None, 'tp')
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ShardingError
from ..runtime.mesh import Mesh, get_backend, make_mesh
from ..tree.spec import P, is_even, split_sizes
from .array import Array

__all__ = ["from_dtensor", "to_dtensor"]


def _shard_dims(spec: P, ndim: int, mesh: Mesh) -> list[int | None]:
    """Per mesh axis, the tensor dim it splits (None: replicated). A dim split over several axes needs
    them in mesh order: DTensor splits a dim over mesh dims in mesh-dim order."""
    out: list[int | None] = [None] * len(mesh.axis_names)
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    for d, axes in enumerate(spec.dim_axes(ndim)):
        if list(axes) != sorted(axes, key=order.__getitem__):
            raise ShardingError(
                f"to_dtensor: spec {spec!r} splits dim {d} over {axes}, out of the mesh's axis order "
                f"{mesh.axis_names}; DTensor splits a dim over mesh dims in mesh order. Reshard first to "
                f"{tuple(sorted(axes, key=order.__getitem__))} on that dim."
            )
        for a in axes:
            out[order[a]] = d
    return out


def to_dtensor(a: Array) -> Any:
    """The ``DTensor`` holding ``a``'s blocks, on ``a.mesh``'s ``DeviceMesh`` (``"dist"`` only; no copy).

    Raises:
        ShardingError: not an Array, a ``"sim"`` Array, a dim split over axes out of mesh order, or a dim split
            unevenly (DTensor's uneven blocks are ``torch.chunk``'s, not ``torch.tensor_split``'s).

    Example:
        >>> # dt = fs.to_dtensor(w); dt.placements  # (Replicate(), Shard(dim=1))
    """
    if not isinstance(a, Array):
        raise ShardingError(f"to_dtensor: expected an fs.Array, found {type(a).__name__}; use fs.device_put first.")
    if not a.mesh.backend_impl.dtensor:
        raise ShardingError(
            "to_dtensor: DTensors live on torch.distributed process groups, but this Array is on a 'sim' mesh. "
            "Run under torchrun (backend 'dist'), or take the whole value with fs.device_get(a)."
        )
    if not is_even(a.shape, a.spec, a.mesh.shape):
        d, axes = next(
            (d, axes)
            for d, axes in enumerate(a.spec.dim_axes(a.ndim))
            if axes and a.shape[d] % math.prod(a.mesh.shape[x] for x in axes)
        )
        n = math.prod(a.mesh.shape[x] for x in axes)
        raise ShardingError(
            f"to_dtensor: dim {d} of shape {a.shape} is split unevenly over {axes} (torch.tensor_split's blocks "
            f"{list(split_sizes(a.shape[d], n))}), which a DTensor's Shard placement would read as torch.chunk's; "
            f"reshard to a spec whose axes divide dim {d} (e.g. P() on it) first."
        )
    return a.mesh.backend_impl.dtensor_from_local(a.local, a.mesh, _shard_dims(a.spec, a.ndim, a.mesh), a.shape)


def from_dtensor(dt: Any, mesh: Mesh | None = None) -> Array:
    """The ``fs.Array`` holding ``dt``'s blocks (``"dist"``). Partial placements are reduced first (one
    all-reduce); the mesh is ``mesh`` or one made from ``dt``'s ``DeviceMesh`` (its dim names and sizes).

    Raises:
        ShardingError: not a DTensor, a DeviceMesh without dim names, a ``mesh`` that is not a ``"dist"``
            fs.Mesh or does not match it, or a placement with no spec equivalent (a strided or uneven split).

    Example:
        >>> # a = fs.from_dtensor(dt); a.spec  # P(None, 'tp')
    """
    impl = get_backend("dist")  # the backend DTensors live on (torch.distributed's process groups)
    if not impl.is_dtensor(dt):
        raise ShardingError(f"from_dtensor: expected a torch DTensor, found {type(dt).__name__}.")
    names, sizes, dims, local = impl.dtensor_layout(dt)
    if names is None:
        raise ShardingError(
            "from_dtensor: the DTensor's DeviceMesh has no mesh_dim_names; build it with "
            "init_device_mesh(..., mesh_dim_names=(...)) so that its dims are named mesh axes."
        )
    want = dict(zip(names, sizes, strict=True))
    if mesh is not None and (not isinstance(mesh, Mesh) or not mesh.backend_impl.dtensor):
        found = f"a '{mesh.backend}' fs.Mesh" if isinstance(mesh, Mesh) else f"a {type(mesh).__name__}"
        raise ShardingError(
            f"from_dtensor: mesh must be a 'dist' fs.Mesh of the DTensor's axes {want}, found {found}; pass "
            f"fs.make_mesh({want}, backend='dist'), or omit mesh= to make it from the DTensor's DeviceMesh."
        )
    mesh = make_mesh(want, backend="dist") if mesh is None else mesh
    if dict(mesh.shape) != want:
        raise ShardingError(f"from_dtensor: the DTensor's DeviceMesh is {want} but mesh is {dict(mesh.shape)}.")
    entries: list[list[str]] = [[] for _ in range(dt.ndim)]
    for name, d in zip(names, dims, strict=True):
        if d is not None and not isinstance(d, int):
            raise ShardingError(f"from_dtensor: placement {d!r} on mesh dim '{name}' has no fs spec equivalent.")
        if d is not None:
            entries[d].append(name)
    if any(d is not None for d in dims):
        _check_ranks(dt.device_mesh.mesh.tolist(), names, mesh)
    spec = P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])
    for d, (size, axes) in enumerate(zip(dt.shape, spec.dim_axes(dt.ndim), strict=True)):
        n = math.prod(mesh.shape[a] for a in axes)
        if size % n:
            raise ShardingError(
                f"from_dtensor: dim {d} of shape {tuple(dt.shape)} (size {size}) is split unevenly over {axes}; "
                f"funcshard needs it divisible by {n}. Pad the tensor first."
            )
    coords = tuple(mesh.local_device_coords()[0].values())
    return Array(mesh, spec, tuple(dt.shape), dt.dtype, {coords: local})


def _check_ranks(grid: Any, names: tuple[str, ...], mesh: Mesh) -> None:
    """Raise unless every rank sits at the same coordinates (by axis name) in the DeviceMesh's rank grid
    (``grid``: nested lists, one level per name) as in ``mesh`` (row-major over its axes): else this process's
    block would be filed under another device's coordinates, and the Array's value be a silent shuffle.

    Raises:
        ShardingError: a rank placed differently.
    """
    coords = mesh.device_coords()

    def walk(g: Any, at: tuple[int, ...]) -> None:
        if isinstance(g, list):
            for i, sub in enumerate(g):
                walk(sub, (*at, i))
            return
        here = dict(zip(names, at, strict=True))
        if not 0 <= g < len(coords) or coords[g] != here:
            raise ShardingError(
                f"from_dtensor: the DTensor's DeviceMesh puts rank {g} at {here}, but mesh {dict(mesh.shape)} has "
                f"it at {coords[g] if 0 <= g < len(coords) else 'no position'} (rank = row-major index of the "
                f"coordinates, as init_device_mesh lays ranks out). Build the DeviceMesh with init_device_mesh and "
                f"these axis names in the mesh's order, or redistribute the DTensor to Replicate() first."
            )

    walk(grid, ())
