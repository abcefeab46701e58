"""torch's ``DeviceMesh`` / ``DTensor`` for a ``"dist"`` mesh, built on the process groups funcshard already
has (one per axis), so DTensors and funcshard's collectives share groups. ``funcshard._src.arrays.dtensor`` turns
specs into placements and back; this module is where torch.distributed is touched.

Example:
    >>> # under torchrun: dm = device_mesh(fs.make_mesh({"dp": 2, "tp": 2}))  # DeviceMesh(('dp', 'tp'), ...)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["device_mesh", "from_local", "is_dtensor", "layout"]

_MESHES: dict[Any, DeviceMesh] = {}


def device_mesh(mesh: Any) -> DeviceMesh:
    """The ``DeviceMesh`` of ``mesh`` (one per mesh, made on first use on every process): its dims are the
    mesh's axes in order, each backed by funcshard's process group of that axis."""
    dm = _MESHES.get(mesh)
    if dm is None:
        dev = mesh.backend_impl.device(mesh)  # (the dist backend's: this module is its DTensor hand-off)
        ranks = torch.arange(mesh.size).reshape(tuple(mesh.shape[a] for a in mesh.axis_names))
        groups = [dev.process_group((a,)) for a in mesh.axis_names]
        where = mesh.local_device()
        device_type = where.type if where is not None else "cpu"
        dm = _MESHES[mesh] = DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=mesh.axis_names)
    return dm


def from_local(local: torch.Tensor, mesh: Any, shard_dims: list[int | None], shape: tuple[int, ...]) -> DTensor:
    """The DTensor of this process's block ``local``: mesh axis ``i`` shards tensor dim ``shard_dims[i]``
    (None: replicated)."""
    placements = [Replicate() if d is None else Shard(d) for d in shard_dims]
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return DTensor.from_local(
        local, device_mesh(mesh), placements, shape=torch.Size(shape), stride=tuple(reversed(stride))
    )


def is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def layout(dt: DTensor) -> tuple[tuple[str, ...] | None, tuple[int, ...], list[Any], torch.Tensor]:
    """``(mesh dim names, mesh dim sizes, per mesh dim the tensor dim it shards or None / the placement
    itself when it has no spec equivalent, local block)``; a Partial placement is reduced first."""
    dm = dt.device_mesh
    if any(isinstance(p, Partial) for p in dt.placements):
        dt = dt.redistribute(dm, [Replicate() if isinstance(p, Partial) else p for p in dt.placements])
    dims: list[Any] = []
    for p in dt.placements:
        if type(p) is Shard:
            dims.append(p.dim % dt.ndim)
        elif isinstance(p, Replicate):
            dims.append(None)
        else:
            dims.append(p)
    return dm.mesh_dim_names, tuple(dm.mesh.shape), dims, dt.to_local()
