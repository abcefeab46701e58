"""The device mesh: named axes, major to minor, over simulated devices or torch.distributed processes.

Example:
    >>> import funcshard as fs
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="sim")
    >>> mesh.size, mesh.axis_size("tp"), mesh.device_coords()[5]
    (8, 4, {'dp': 1, 'tp': 1})
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch

from ..errors import MeshError
from . import backends
from .backends import BackendImpl

__all__ = ["BackendImpl", "Mesh", "backend_names", "get_backend", "loaded_backends", "make_mesh"]

Backend = Literal["sim", "dist", "abstract"]


class Mesh:
    """An immutable grid of devices with named axes (major to minor).

    Build it with :func:`make_mesh`. Two meshes are equal when axis names, sizes and backend agree.

    Besides its layout, a mesh answers the process questions of a job on every backend (as ``jax.process_index()``
    and friends do): :meth:`process_index`, :meth:`process_count`, :meth:`local_device_coords`, :meth:`is_local`,
    :meth:`local_device`, :meth:`node_local_axes`, :meth:`barrier`, :meth:`broadcast_object`,
    :meth:`all_gather_object`; code that needs to know how its devices run asks :attr:`is_multiprocess`, never
    the backend's name.

    Attributes:
        backend_impl: the backend's object (its declared capabilities, and the answers to the process
            questions), one per backend.

    Example:
        >>> mesh = make_mesh({"dp": 2}, backend="sim")
        >>> mesh.axis_names, mesh.shape, mesh.backend
        (('dp',), {'dp': 2}, 'sim')
    """

    __slots__ = ("_backend", "_coords", "_multiprocess", "_names", "_shape", "_sizes", "backend_impl")
    backend_impl: BackendImpl

    def __init__(self, shape: Mapping[str, int], backend: Backend) -> None:
        names = tuple(shape)
        sizes = tuple(shape[n] for n in names)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_backend", backend)
        impl = backends.get(backend)
        object.__setattr__(self, "backend_impl", impl)
        object.__setattr__(self, "_multiprocess", impl.multiprocess)
        coords = [dict(zip(names, c, strict=True)) for c in itertools.product(*(range(s) for s in sizes))]
        object.__setattr__(self, "_coords", tuple(coords))
        object.__setattr__(self, "_shape", dict(zip(names, sizes, strict=True)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Mesh is immutable; build a new one with fs.make_mesh")

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, major to minor."""
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in axis order (do not mutate it)."""
        return self._shape

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self._sizes)

    @property
    def backend(self) -> Backend:
        """``"sim"``, ``"dist"`` or ``"abstract"``."""
        return self._backend

    @property
    def is_multiprocess(self) -> bool:
        """Whether each device runs in its own process, this process one of them (``"dist"``); False: this
        process runs every device of the mesh (``"sim"``).

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").is_multiprocess
            False
        """
        return self._multiprocess

    def axis_size(self, name: str) -> int:
        """The size of axis ``name``.

        Raises:
            MeshError: the mesh has no such axis.
        """
        if name not in self._names:
            raise MeshError(f"Mesh.axis_size: the mesh {self} has no axis '{name}'; its axes are {list(self._names)}.")
        return self._sizes[self._names.index(name)]

    def device_coords(self) -> list[dict[str, int]]:
        """The coordinates of every device, in rank order (row-major over the axes)."""
        return [dict(c) for c in self._coords]

    def coords_of(self, rank: int) -> dict[str, int]:
        """The coordinates of the device with this rank."""
        return dict(self._coords[rank])

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank of the device at ``coords`` (row-major index)."""
        r = 0
        for n, s in zip(self._names, self._sizes, strict=True):
            r = r * s + coords[n]
        return r

    # ------------------------------------------------------------------------------------ the process questions
    def process_index(self) -> int:
        """This process's index among the job's processes (``jax.process_index()``): its rank under ``"dist"``,
        0 under ``"sim"`` (one process).

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").process_index()
            0
        """
        return self.backend_impl.process_index()

    def process_count(self) -> int:
        """The number of the job's processes (``jax.process_count()``): the world size under ``"dist"``, 1 under
        ``"sim"``.

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").process_count()
            1
        """
        return self.backend_impl.process_count()

    def local_device_coords(self) -> list[dict[str, int]]:
        """The coordinates of the devices this process runs, in rank order: every device under ``"sim"``, this
        process's one under ``"dist"``.

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").local_device_coords()
            [{'dp': 0}, {'dp': 1}]
        """
        return [dict(self._coords[r]) for r in self.backend_impl.local_ranks(self)]

    def is_local(self, coords: Mapping[str, int]) -> bool:
        """Whether the device at ``coords`` runs in this process.

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").is_local({"dp": 1})
            True
        """
        return self.rank_of(coords) in self.backend_impl.local_ranks(self)

    def local_device(self) -> torch.device | None:
        """The torch device this process's shards live on: the current CUDA device under ``"dist"`` with NCCL;
        None where shards stay where they are (``"sim"``, gloo).

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").local_device() is None
            True
        """
        return self.backend_impl.local_device()

    def barrier(self) -> None:
        """Wait until every process of the job reaches this call (a collective under ``"dist"``; nothing to wait
        for under ``"sim"``).

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").barrier()
        """
        self.backend_impl.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as process ``src`` passed it, on every process (pickled; a collective under ``"dist"``, every
        process calls it; ``obj`` itself under ``"sim"``).

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").broadcast_object({"step": 3})
            {'step': 3}
        """
        return self.backend_impl.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in process order, on every process (pickled; a collective under ``"dist"``;
        ``[obj]`` under ``"sim"``).

        Example:
            >>> make_mesh({"dp": 2}, backend="sim").all_gather_object("ok")
            ['ok']
        """
        return self.backend_impl.all_gather_object(obj)

    def node_local_axes(self) -> tuple[str, ...]:
        """The axes whose every group of devices lies inside one node (machine), in axis order: their
        collectives never cross the network.

        Under ``"dist"`` a node holds ``LOCAL_WORLD_SIZE`` consecutive ranks (torchrun's placement: node ``k`` runs
        ranks ``k * LOCAL_WORLD_SIZE`` on); since rank is the row-major index of the coordinates, the innermost
        axes are the ones that stay inside a node, so put ``tp`` (and ``cp``) last. One node (``LOCAL_WORLD_SIZE``
        unset or the world size), ``"sim"`` and ``"abstract"``: every axis.

        Example:
            >>> make_mesh({"dp": 2, "tp": 2}, backend="sim").node_local_axes()
            ('dp', 'tp')
            >>> # under torchrun --nnodes 2 --nproc-per-node 2: ('tp',); with {"tp": 2, "dp": 2}: ('dp',)
        """
        local = _processes_per_node(self)
        if local >= self.size:
            return self._names
        return tuple(n for n in self._names if _inside_nodes(self, n, local))

    def _key(self) -> tuple[tuple[str, ...], tuple[int, ...], str]:
        return (self._names, self._sizes, self._backend)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        inner = ", ".join(f"'{n}': {s}" for n, s in zip(self._names, self._sizes, strict=True))
        return f"Mesh({{{inner}}}, backend='{self._backend}')"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Mesh, (self.shape, self._backend))


def _processes_per_node(mesh: Mesh) -> int:
    """Processes per node: ``LOCAL_WORLD_SIZE`` under a multiprocess backend, else the whole mesh."""
    if not mesh.is_multiprocess:
        return mesh.size
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size)))
    except ValueError:
        return mesh.size


def _inside_nodes(mesh: Mesh, axis: str, local: int) -> bool:
    """Whether every group of ``axis`` (the devices that differ only on it) lies in one node of ``local`` ranks."""
    names = mesh.axis_names
    i = names.index(axis)
    size = mesh.shape[axis]
    stride = math.prod(mesh.shape[n] for n in names[i + 1 :])
    for rank in range(mesh.size):
        if (rank // stride) % size == 0 and len({(rank + k * stride) // local for k in range(size)}) > 1:
            return False
    return True


NODE_LOCAL_ROLES = ("tp", "cp")  # axes whose collectives run every layer: they belong inside a node


def _warn_cross_node(mesh: Mesh) -> None:
    """Warn when a ``tp`` or ``cp`` axis of a multi-node ``"dist"`` mesh has groups that cross nodes."""
    inside = mesh.node_local_axes()
    crossing = [a for a in NODE_LOCAL_ROLES if a in mesh.shape and mesh.shape[a] > 1 and a not in inside]
    if not crossing:
        return
    local = _processes_per_node(mesh)
    order = {a: s for a, s in mesh.shape.items() if a not in NODE_LOCAL_ROLES}
    order.update({a: mesh.shape[a] for a in NODE_LOCAL_ROLES if a in mesh.shape})
    warnings.warn(
        f"make_mesh: axis {', '.join(repr(a) for a in crossing)} of the mesh {mesh.shape} has groups that cross "
        f"nodes ({local} processes per node, LOCAL_WORLD_SIZE): its collectives, every layer, go over the network. "
        f"Put it last (the innermost axes stay inside a node): make_mesh({order}).",
        stacklevel=3,
    )


def make_mesh(shape: Mapping[str, int], *, backend: str = "auto") -> Mesh:
    """Build a mesh of named axes.

    Args:
        shape: axis name -> size, major to minor (``{"dp": 2, "tp": 4}``).
        backend: ``"sim"`` (every device simulated in this process), ``"dist"`` (one device per
            torch.distributed process; initialises the default process group when needed and builds one
            process group per axis, once), or ``"auto"``: ``"dist"`` when torch.distributed is initialised
            or torchrun's ``RANK``/``WORLD_SIZE`` are set, else ``"sim"``. ``"abstract"``: no data and no
            processes, a mesh of any size for planning (``fs.eval_shape``, ``lower().cost_analysis()``).

    Returns:
        The mesh.

    Axis order is major to minor: the innermost (last) axes vary fastest with the rank, so on several nodes
    (``torchrun --nnodes N``) they are the ones whose groups stay inside a node (:meth:`Mesh.node_local_axes`);
    a ``tp`` or ``cp`` axis whose groups would cross nodes is warned about (put it last).

    Raises:
        MeshError: bad axis names or sizes, an unknown backend, or (``"dist"``) a mesh size that is not the
            world size.

    Example:
        >>> make_mesh({"dp": 2, "tp": 2}, backend="sim")
        Mesh({'dp': 2, 'tp': 2}, backend='sim')
    """
    if not isinstance(shape, Mapping) or not shape:
        raise MeshError(
            f"make_mesh: expected a non-empty dict of axis name -> size such as {{'dp': 2, 'tp': 4}}, found {shape!r}."
        )
    for name, size in shape.items():
        if not isinstance(name, str) or not name:
            raise MeshError(f"make_mesh: axis names must be non-empty strings, found {name!r} in {dict(shape)}.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(
                f"make_mesh: axis '{name}' has size {size!r}; every axis size must be a positive int "
                f"(use 1 for an axis you want to name but not split)."
            )
    if backend == "auto":
        backend = backends.auto()
    if backend not in backends.names():
        backends.get(backend)  # MeshError naming the backends there are
    mesh = Mesh(dict(shape), backend)  # type: ignore[arg-type]
    mesh.backend_impl.setup(mesh)
    if mesh.is_multiprocess:
        _warn_cross_node(mesh)
    return mesh


def get_backend(name: str | None = None) -> BackendImpl:
    """The backend object named ``name`` (capabilities and process questions, as a mesh's ``backend_impl``);
    None: the one this process's job runs on when no mesh says (``"dist"`` once torch.distributed is up, else
    ``"sim"``).

    Raises:
        MeshError: no backend of that name.

    Example:
        >>> get_backend("sim").multiprocess
        False
    """
    return backends.running() if name is None else backends.get(name)


def backend_names() -> tuple[str, ...]:
    """The names of the backends there are.

    Example:
        >>> backend_names()
        ('sim', 'dist', 'abstract')
    """
    return backends.names()


def loaded_backends() -> tuple[BackendImpl, ...]:
    """The backends this process has used so far (their modules imported), each with its devices, threads and
    groups; one never used has none to report.

    Example:
        >>> get_backend("sim") in loaded_backends()
        True
    """
    return backends.loaded()
