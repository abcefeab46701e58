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

import itertools
from typing import Any

import torch

from ..errors import ShardingError
from ..runtime.mesh import Mesh
from ..tree.spec import P, format_mesh, shard_slices, uneven_axes

__all__ = ["Array", "ClassShards", "Coords", "is_array", "local_coords", "local_shards"]

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

    __slots__ = ("dtype", "mesh", "owned", "shape", "shards", "spec")

    def __init__(
        self,
        mesh: Mesh,
        spec: P,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        shards: dict[Coords, torch.Tensor],
        owned: bool = False,
    ) -> None:
        self.mesh = mesh
        self.spec = spec
        self.shape = tuple(shape)
        self.dtype = dtype
        self.shards = shards
        #: the shards are this Array's alone (fresh results of a shard_map, no views, no shared storage), so a
        #: shard_map that is donated the Array may write into them in place
        self.owned = owned

    def delete(self, why: str = "deleted") -> None:
        """Drop the shards (JAX's ``Array.delete``); any later use of the Array raises a ShardingError."""
        self.shards = _Deleted(self, why)  # type: ignore[assignment]
        self.owned = False

    def is_deleted(self) -> bool:
        """True once the Array was deleted or donated (JAX's ``is_deleted``)."""
        return isinstance(self.shards, _Deleted)

    @property
    def local(self) -> torch.Tensor:
        """This process's shard (``"dist"``).

        Raises:
            ShardingError: under ``"sim"``, where one process holds every device's shard.
        """
        if not self.mesh.is_multiprocess:
            raise ShardingError(
                f"Array.local: under the '{self.mesh.backend}' backend this process holds all {self.mesh.size} "
                f"devices' shards; "
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
        for s in self.shards.values():  # (a loop: no generator's frame; read for every donated Array of a step)
            if s.requires_grad:
                return True
        return False

    def __repr__(self) -> str:
        return (
            f"Array(shape={self.shape}, dtype={self.dtype}, spec={self.spec!r}, mesh={format_mesh(self.mesh)}, "
            f"backend='{self.mesh.backend}')"
        )


class _Deleted(dict):  # type: ignore[type-arg]
    """The shards of a deleted Array: every access raises, naming why it is gone and what to use instead."""

    def __init__(self, a: Array, why: str) -> None:
        super().__init__()
        self.what = (a.shape, a.spec, why)  # (the message is written where it is raised: every step deletes many)

    @property
    def msg(self) -> str:
        """Why the Array is gone, and what to use instead."""
        shape, spec, why = self.what
        return (
            f"this Array (shape={shape}, spec={spec!r}) was {why}: its buffers now belong to that call's "
            f"results. Use the value the call returned (params, state = step(params, state, ...)), or leave the "
            f"argument out of donate= to keep it."
        )

    def _raise(self, *_: Any, **__: Any) -> Any:
        raise ShardingError(self.msg)

    __getitem__ = __iter__ = __len__ = values = items = keys = get = __contains__ = _raise  # type: ignore[assignment]


class ClassShards(dict):  # type: ignore[type-arg]
    """The blocks of an Array on a mesh that holds no data (``"abstract"``): one meta block per *class* of devices
    (devices whose blocks cannot differ), found for any device on request, so a mesh of 4096 devices holds a few
    blocks, not 4096. The dict holds the classes' representatives: the device with the class's coordinates on
    the class axes and 0 on every other axis.

    Example:
        >>> s = ClassShards((0,), {(0, 0): "stage 0", (1, 0): "stage 1"})
        >>> s[(1, 5)], len(s)
        ('stage 1', 2)
    """

    __slots__ = ("positions",)

    def __init__(self, positions: tuple[int, ...], blocks: dict[Coords, Any]) -> None:
        super().__init__(blocks)
        self.positions = positions  # the class axes, as positions in the mesh's axis order

    def __missing__(self, coords: Coords) -> Any:
        pos = self.positions
        rep = tuple(c if i in pos else 0 for i, c in enumerate(coords))
        if rep == coords:
            raise KeyError(coords)
        return self[rep]


def is_array(x: Any) -> bool:
    """True for an :class:`Array` (an optree ``is_leaf`` predicate)."""
    return isinstance(x, Array)


def local_coords(mesh: Mesh) -> list[Coords]:
    """The coordinates of the devices this process runs: every device under ``"sim"``, one under ``"dist"``."""
    return [tuple(c.values()) for c in mesh.local_device_coords()]


def local_shards(x: torch.Tensor, mesh: Mesh, spec: P) -> dict[Coords, torch.Tensor]:
    """The blocks of full tensor ``x`` held by this process's devices (views of ``x``); on a mesh that holds no
    data, one meta block per class of devices (:class:`ClassShards`): one for every device, or, where a dim is
    split unevenly, one per coordinate on the axes of such dims (their blocks' shapes differ)."""
    if not mesh.backend_impl.holds_data:
        names = mesh.axis_names
        uneven = set(uneven_axes(x.shape, spec, mesh.shape))
        positions = tuple(i for i, n in enumerate(names) if n in uneven)
        blocks: dict[Coords, torch.Tensor] = {}
        for c in itertools.product(*[range(mesh.shape[n]) if n in uneven else range(1) for n in names]):
            block = x[shard_slices(x.shape, spec, mesh.shape, dict(zip(names, c, strict=True)))]
            blocks[c] = torch.empty(block.shape, dtype=x.dtype, device="meta")
        return ClassShards(positions, blocks)
    dev = mesh.local_device()
    if dev is not None:
        x = x.to(dev)
    names, own = mesh.axis_names, mesh.is_multiprocess
    out = {}
    for c in local_coords(mesh):
        block = x[shard_slices(x.shape, spec, mesh.shape, dict(zip(names, c, strict=True)))]
        if own and block.numel() < x.numel():
            block = block.clone()  # own storage: the process keeps its shard, not the whole tensor
        out[c] = block
    return out
