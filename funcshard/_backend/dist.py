"""The ``dist`` backend: one device per torch.distributed process (gloo on CPU, NCCL on CUDA).

Process groups: one per mesh axis, built once per mesh shape when the mesh is made; a group over a tuple of
axes is built the first time a collective uses it (every process reaches that collective, so every process
takes part in building it) and kept. torch orders a group's ranks by global rank; the primitives here
reorder rows to the logical (row-major over the named axes) order.

Example:
    >>> # under torchrun --nproc-per-node 2:
    >>> # mesh = fs.make_mesh({"tp": 2}, backend="dist")
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from .._errors import MeshError
from .base import DeviceHandle, default_timeout, group_members

__all__ = [
    "DistDevice",
    "barrier",
    "broadcast_object",
    "device_for",
    "initialized",
    "process_rank",
    "requested",
    "setup",
    "shutdown",
    "tensor_device",
]

# torch 2.13 renamed the flat collectives; keep both spellings working (torch >= 2.4).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _drop_groups() -> None:
    """Forget the cached process groups and devices (before the interpreter tears torch down: gloo can
    abort at exit while a module-level dict still holds its groups)."""
    for dev in _DEVICES.values():
        dev._order.clear()
    _DEVICES.clear()
    _GROUPS.clear()


atexit.register(_drop_groups)


def shutdown() -> None:
    """End this process's part in torch.distributed cleanly: drop funcshard's groups, destroy the default
    process group (a no-op when none was started)."""
    _drop_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_GROUPS: dict[tuple[Any, ...], dict[frozenset[str], Any]] = {}
_DEVICES: dict[Any, DistDevice] = {}


def _init_default_group() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise MeshError(
            "make_mesh(backend='dist'): torch.distributed is not initialised and RANK / WORLD_SIZE are not set; "
            "launch with torchrun (torchrun --nproc-per-node N script.py) or use backend='sim'."
        )
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=default_timeout()))


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (mesh.axis_names, tuple(mesh.shape.values()))


def _build_group(mesh: Any, axes: frozenset[str]) -> Any:
    """Build (collectively) every group over ``axes``; return the one holding this process."""
    world = dist.get_world_size()
    ordered = tuple(a for a in mesh.axis_names if a in axes)
    if len(ordered) == len(mesh.axis_names) or all(mesh.shape[a] == 1 for a in mesh.axis_names if a not in axes):
        return dist.group.WORLD
    seen: set[tuple[int, ...]] = set()
    mine = None
    me = dist.get_rank()
    for r in range(world):
        members = tuple(sorted(group_members(mesh, mesh.coords_of(r), ordered)[0]))
        if members in seen:
            continue
        seen.add(members)
        g = dist.new_group(list(members))
        if me in members:
            mine = g
    return mine


def requested() -> bool:
    """True when torch.distributed is initialised or torchrun's RANK / WORLD_SIZE are set."""
    if dist.is_available() and dist.is_initialized():
        return True
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def process_rank() -> int:
    """This process's global rank."""
    return dist.get_rank()


def tensor_device() -> torch.device | None:
    """Where this process's shards live: the current CUDA device under NCCL, else None (leave them)."""
    if "nccl" not in _BACKEND:
        _BACKEND["nccl"] = dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if _BACKEND["nccl"] else None


_BACKEND: dict[str, bool] = {}


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def setup(mesh: Any) -> None:
    """Initialise the default process group if needed, check the world size, build one group per axis."""
    _init_default_group()
    world = dist.get_world_size()
    if mesh.size != world:
        raise MeshError(
            f"make_mesh: the mesh {mesh.shape} has {mesh.size} devices but torch.distributed runs {world} "
            f"processes; make the product of the axis sizes equal {world} (or launch {mesh.size} processes)."
        )
    key = _mesh_key(mesh)
    if key not in _GROUPS:
        _GROUPS[key] = {frozenset([a]): _build_group(mesh, frozenset([a])) for a in mesh.axis_names}


def device_for(mesh: Any) -> DistDevice:
    """This process's device handle on ``mesh`` (made once per mesh)."""
    dev = _DEVICES.get(mesh)
    if dev is None:
        setup(mesh)
        dev = _DEVICES[mesh] = DistDevice(mesh)
    return dev


class DistDevice(DeviceHandle):
    """This process, as a device of ``mesh``."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.coords = mesh.coords_of(self.rank)
        self._groups = _GROUPS[_mesh_key(mesh)]
        self._order: dict[tuple[str, ...], tuple[Any, list[int], list[int], int]] = {}

    def _group(self, axes: tuple[str, ...]) -> tuple[Any, list[int], list[int], int]:
        """(process group, logical members, group-rank of each logical index, my logical index)."""
        hit = self._order.get(axes)
        if hit is None:
            s = frozenset(axes)
            g = self._groups.get(s)
            if g is None:
                g = self._groups[s] = _build_group(self.mesh, s)
            members, idx = group_members(self.mesh, self.coords, axes)
            by_rank = sorted(members)
            hit = self._order[axes] = (g, members, [by_rank.index(m) for m in members], idx)
        return hit

    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        g = self._group(axes)[0]
        out = x.detach().clone(memory_format=torch.contiguous_format)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(out, op=red, group=g)  # [*s] -> [*s]
        return out

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        g, members, gr, _ = self._group(axes)
        n = len(members)
        out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather(out, x.detach().reshape(-1).contiguous(), group=g)  # [*s] -> [n * |s|] (group-rank order)
        out = out.view(n, *x.shape)
        return out if gr == sorted(gr) else out[gr]

    def reduce_scatter(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        g, _, gr, _ = self._group(axes)
        inp = x.detach()
        if gr != sorted(gr):
            inp = inp[_inverse(gr)]  # logical order -> group-rank order
        out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
        _reduce_scatter(out, inp.reshape(-1).contiguous(), group=g)  # [n * |s|] -> [|s|]
        return out.view(x.shape[1:])

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        g, _, gr, _ = self._group(axes)
        inp = x.detach()
        reorder = gr != sorted(gr)
        if reorder:
            inp = inp[_inverse(gr)]  # logical order -> group-rank order
        flat = inp.reshape(-1).contiguous()
        out = torch.empty_like(flat)
        dist.all_to_all_single(out, flat, group=g)  # [n * |s|] -> [n * |s|] (group-rank order)
        out = out.view(x.shape)
        return out[gr] if reorder else out

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        g, members, _, idx = self._group(axes)
        send = x.detach().contiguous()
        out = torch.zeros_like(send)
        ops = []
        for src, dst in perm:
            if src == idx and dst == idx:
                out.copy_(send)
            elif src == idx:
                ops.append(dist.P2POp(dist.isend, send, members[dst], group=g))
            elif dst == idx:
                ops.append(dist.P2POp(dist.irecv, out, members[src], group=g))
        if ops:
            for req in dist.batch_isend_irecv(ops):  # [*s] -> [*s]
                req.wait()
        return out


def initialized() -> bool:
    """True when the default process group is up."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait until every process of the default group reaches this call."""
    dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as process ``src`` passed it, on every process (pickled; a collective)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
