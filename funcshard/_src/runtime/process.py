"""What a job needs from its processes, as ``funcshard.process`` exports it (see its docstring): the peer error,
the collective timeout, a flag any process may raise, and shutdown."""

from __future__ import annotations

import threading

from .comm import PeerError as PeerError
from .comm import default_timeout
from .mesh import Mesh, backend_names, get_backend, loaded_backends

__all__ = ["PeerError", "abandoned_threads", "any_process", "collective_timeout", "shutdown"]


def collective_timeout() -> float:
    """Seconds a collective may wait for its peers: ``FUNCSHARD_TIMEOUT`` (default 300), read at each call.

    Raises:
        MeshError: a value that is not a positive number of seconds (call it first to fail early).

    Example:
        >>> collective_timeout() > 0
        True
    """
    return default_timeout()


def any_process(flag: bool, mesh: Mesh) -> bool:
    """``flag`` on any process of ``mesh``: under ``"dist"`` a tiny all-reduce over the default group (every
    process must call it at the same point), under ``"sim"`` the flag itself (one process).

    Example:
        >>> import funcshard as fs
        >>> any_process(False, fs.make_mesh({"dp": 2}, backend="sim"))
        False
    """
    return mesh.backend_impl.any_process(flag)


def abandoned_threads() -> list[threading.Thread]:
    """Simulated device threads still running in calls that already raised. A program that exits with such a
    thread alive should leave with ``os._exit``: torch ops on a thread at interpreter shutdown can abort.

    Example:
        >>> abandoned_threads()
        []
    """
    return [t for impl in loaded_backends() for t in impl.abandoned_threads()]  # (none in a backend never used)


def shutdown() -> None:
    """End this process's part in torch.distributed cleanly: drop funcshard's process groups and destroy the
    default one (a no-op when none was started). Call it once, at the end of a job run under torchrun.

    Example:
        >>> shutdown()  # at the end of a job under torchrun  # doctest: +SKIP
    """
    for name in backend_names():
        get_backend(name).shutdown()
