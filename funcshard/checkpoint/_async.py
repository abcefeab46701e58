"""Asynchronous saves: the handle, and the one save in flight.

``save(..., async_save=True)`` stages every block it writes into shared host memory (:mod:`._writer`: a writer
process of its own writes them) and hands the rest to one background thread, which waits for the writer and
runs the same commit as a synchronous save over the backend's side channel (under ``"dist"`` a second gloo
process group, so its collectives never interleave with the training step's). At most one save is in flight
per process: any save waits for the one before it. The temporary folder and the atomic swap are those of a
synchronous save, so a process killed mid-write leaves the previous checkpoint readable.

Example:
    >>> import tempfile, torch
    >>> from funcshard import checkpoint
    >>> d = tempfile.mkdtemp()
    >>> h = checkpoint.save(f"{d}/ckpt", {"w": torch.ones(3)}, async_save=True)
    >>> h.wait() == f"{d}/ckpt", h.done()
    (True, True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..extend import BackendImpl, user_call

__all__ = ["SaveHandle", "in_flight", "start_in_flight", "wait_in_flight"]


class SaveHandle:
    """An asynchronous save in flight (:func:`funcshard.checkpoint.save` with ``async_save=True``).

    Attributes:
        path: the checkpoint directory being written.
        started: ``time.perf_counter()`` when the write began; ``seconds``: how long it took (None until done).

    Example:
        >>> h = checkpoint.save("ckpt/step_200", state, step=200, async_save=True)  # doctest: +SKIP
        >>> h.wait()  # doctest: +SKIP
        'ckpt/step_200'
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reported = False

    def done(self) -> bool:
        """Whether the write has ended (in place, or failed: ``wait()`` then raises)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is in place; return its path.

        Args:
            timeout: seconds to wait at most (None: as long as it takes).

        Raises:
            CheckpointError: the write failed (the previous checkpoint is untouched); ``PeerError``: a peer was
                lost meanwhile; ``TimeoutError``: still writing after ``timeout`` seconds.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint.save('{self.path}'): still writing after {timeout} s.")
        if self._error is not None and not self._reported:
            self._reported = True  # raised once: a later save does not fail for an error already seen
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"SaveHandle('{self.path}', {state})"


_IN_FLIGHT: list[SaveHandle] = []  # the one save in flight in this process (at most one)


def in_flight() -> SaveHandle | None:
    """The asynchronous save this process has in flight, or None.

    Example:
        >>> in_flight() is None or isinstance(in_flight(), SaveHandle)
        True
    """
    return _IN_FLIGHT[0] if _IN_FLIGHT else None


def wait_in_flight() -> None:
    """Wait for the save in flight, if any (raising its error, once)."""
    if _IN_FLIGHT:
        handle = _IN_FLIGHT[0]
        try:
            handle.wait()
        finally:
            _IN_FLIGHT.clear()


def start_in_flight(run: Callable[[BackendImpl], None], procs: BackendImpl, path: str) -> SaveHandle:
    """Run ``run(procs)`` on a background thread and return its handle (kept as the save in flight)."""
    handle = SaveHandle(path)

    def write() -> None:
        try:
            with user_call("checkpoint.save (asynchronous)"):
                run(procs)
        except BaseException as e:  # noqa: BLE001 - kept for wait(), on the caller's thread
            handle._error = e
        finally:
            handle.seconds = time.perf_counter() - handle.started

    handle._thread = threading.Thread(target=write, name="funcshard-checkpoint-save", daemon=True)
    _IN_FLIGHT[:] = [handle]
    handle._thread.start()
    return handle
