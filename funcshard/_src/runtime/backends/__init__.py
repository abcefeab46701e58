"""Communication backends: ``sim`` (devices simulated in this process), ``dist`` (torch.distributed) and
``abstract`` (no data: shapes and communication counts only, for meshes of any size).

Each exposes one device handle per device with the same six collectives, each over an ordered tuple of
mesh axes (a "group": the devices that share this device's coordinates on every other axis, ordered
row-major over the named axes). Every primitive works on a leading group dim ``n``:

- ``all_reduce(x, axes, op)``: ``[*s] -> [*s]``, op in ``"sum" | "max" | "min"``.
- ``all_gather(x, axes)``: ``[*s] -> [n, *s]``, row i from group member i.
- ``reduce_scatter(x, axes)``: ``[n, *s] -> [*s]``, the sum over members of their row ``my_index``.
- ``all_to_all(x, axes)``: ``[n, *s] -> [n, *s]``, row j goes to member j; row i of the result came from i.
- ``ppermute(x, axes, perm)``: ``[*s] -> [*s]``, from ``src`` to ``dst`` for each pair; zeros elsewhere.
- ``ragged_all_to_all(x, axes, send, recv)``: ``[N, *s] -> [sum(recv), *s]``, ``send[j]`` rows to member j,
  ``recv[i]`` rows from member i, in source order (the leading group dim is ragged: row counts per member).

and one asynchronous point-to-point call, not differentiable (for runtimes that do their own backward, as
``pipeline.run``): ``p2p(ops, axes)`` posts a batch of sends and receives and returns one work per op, each
waited on (``wait()``) only where its block is needed.

Each backend declares what it can do beyond that (``DeviceHandle``'s capabilities: in-place sums, pending
results, point-to-point) and answers the process questions (:class:`~.base.BackendImpl`); this package's
registry hands out its one :class:`~.base.BackendImpl` by name (:func:`get`), importing the backend's module at
the first request. ``runtime.mesh`` is the only module that asks the registry; everything else asks the mesh
(``mesh.backend_impl``, ``mesh.process_index()``, ...), so no code outside this package names a backend.

This package is the only code that imports torch.distributed.

Example:
    >>> get("sim").multiprocess, names()
    (False, ('sim', 'dist', 'abstract'))
"""

from __future__ import annotations

import importlib

from ...errors import MeshError
from .base import BackendImpl, DeviceHandle, group_members

__all__ = ["BackendImpl", "DeviceHandle", "auto", "get", "group_members", "loaded", "names", "running"]

#: name -> (module of this package, its BackendImpl class), in the order the names are listed
_REGISTRY = {
    "sim": ("sim", "SimBackend"),
    "dist": ("dist", "DistBackend"),
    "abstract": ("abstract", "AbstractBackend"),
}
#: the backend ``auto`` and ``running`` fall back to: every device in this process
_DEFAULT = "sim"
_LOADED: dict[str, BackendImpl] = {}


def names() -> tuple[str, ...]:
    """The registered backends' names.

    Example:
        >>> names()
        ('sim', 'dist', 'abstract')
    """
    return tuple(_REGISTRY)


def get(name: str) -> BackendImpl:
    """The backend named ``name`` (its module imported at the first request).

    Raises:
        MeshError: no backend of that name.

    Example:
        >>> get("sim").name
        'sim'
    """
    impl = _LOADED.get(name)
    if impl is None:
        if name not in _REGISTRY:
            listed = " or ".join(repr(n) for n in _REGISTRY)
            raise MeshError(f"make_mesh: unknown backend {name!r}; use 'auto', {listed}.")
        module, cls = _REGISTRY[name]
        impl = _LOADED[name] = getattr(importlib.import_module(f".{module}", __name__), cls)()
    return impl


def loaded() -> tuple[BackendImpl, ...]:
    """The backends asked for so far (a backend never asked for has no devices, threads or groups to report).

    Example:
        >>> get("sim") in loaded()
        True
    """
    return tuple(_LOADED.values())


def auto() -> str:
    """The backend ``make_mesh(backend="auto")`` picks: the first other than the default whose environment asks
    for it (``"dist"``: torch.distributed initialised, or torchrun's ``RANK`` / ``WORLD_SIZE`` set), else the
    default, ``"sim"``.

    Example:
        >>> auto()  # outside torchrun  # doctest: +SKIP
        'sim'
    """
    for name in _REGISTRY:
        if name != _DEFAULT and get(name).requested():
            return name
    return _DEFAULT


def running() -> BackendImpl:
    """The backend this process's job runs on when no mesh says: the first other than the default whose
    processes are up (``"dist"``: torch.distributed initialised), else the default's.

    Example:
        >>> running().name  # outside torchrun  # doctest: +SKIP
        'sim'
    """
    for name in _REGISTRY:
        if name != _DEFAULT and get(name).started():
            return get(name)
    return get(_DEFAULT)
