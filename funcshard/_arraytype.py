"""``fs.Array``, the type: a global value laid out over a mesh, as the blocks this process's devices hold.

``device_put`` / ``device_get`` / ``reshard`` (in ``_array``) sit above ``shard_map``; this module sits below
it, so the transform can take and make Arrays without an import circle.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> sorted(local_shards(torch.arange(4.0), mesh, P("tp")).items())
    [((0,), tensor([0., 1.])), ((1,), tensor([2., 3.]))]
"""

from __future__ import annotations

from typing import Any

import torch

from ._errors import ShardingError
from ._mesh import Mesh
from ._spec import P, format_mesh, shard_slices

__all__ = ["Array", "Coords", "is_array", "local_coords", "local_shards"]

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


def is_array(x: Any) -> bool:
    """True for an :class:`Array` (an optree ``is_leaf`` predicate)."""
    return isinstance(x, Array)


def local_coords(mesh: Mesh) -> list[Coords]:
    """The coordinates of the devices this process runs: every device under ``"sim"``, one under ``"dist"``."""
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
    for c in local_coords(mesh):
        block = x[shard_slices(x.shape, spec, mesh.shape, dict(zip(names, c, strict=True)))]
        if mesh.backend == "dist" and block.numel() < x.numel():
            block = block.clone()  # own storage: the process keeps its shard, not the whole tensor
        out[c] = block
    return out
