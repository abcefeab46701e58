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
from collections.abc import Mapping
from typing import Any, Literal

from ..errors import MeshError

__all__ = ["Mesh", "make_mesh"]

Backend = Literal["sim", "dist"]


class Mesh:
    """An immutable grid of devices with named axes (major to minor).

    Build it with :func:`make_mesh`. Two meshes are equal when axis names, sizes and backend agree.

    Example:
        >>> mesh = make_mesh({"dp": 2}, backend="sim")
        >>> mesh.axis_names, mesh.shape, mesh.backend
        (('dp',), {'dp': 2}, 'sim')
    """

    __slots__ = ("_backend", "_coords", "_names", "_shape", "_sizes")

    def __init__(self, shape: Mapping[str, int], backend: Backend) -> None:
        names = tuple(shape)
        sizes = tuple(shape[n] for n in names)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_backend", backend)
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
        """``"sim"`` or ``"dist"``."""
        return self._backend

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


def make_mesh(shape: Mapping[str, int], *, backend: str = "auto") -> Mesh:
    """Build a mesh of named axes.

    Args:
        shape: axis name -> size, major to minor (``{"dp": 2, "tp": 4}``).
        backend: ``"sim"`` (every device simulated in this process), ``"dist"`` (one device per
            torch.distributed process; initialises the default process group when needed and builds one
            process group per axis, once), or ``"auto"``: ``"dist"`` when torch.distributed is initialised
            or torchrun's ``RANK``/``WORLD_SIZE`` are set, else ``"sim"``.

    Returns:
        The mesh.

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
        from .backends import dist as dist_backend

        backend = "dist" if dist_backend.requested() else "sim"
    if backend not in ("sim", "dist"):
        raise MeshError(f"make_mesh: unknown backend {backend!r}; use 'auto', 'sim' or 'dist'.")
    mesh = Mesh(dict(shape), backend)  # type: ignore[arg-type]
    if backend == "dist":
        from .backends import dist as dist_backend

        dist_backend.setup(mesh)
    return mesh
