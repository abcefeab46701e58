"""The train job's checkpoints: ``<ckpt-dir>/step_N``, the last two kept, written in the background with
``--async-ckpt`` (one save in flight; the next save and the end of the run wait for it), and a test hook that
kills a worker once a checkpoint is complete.

Example:
    >>> import tempfile
    >>> saver = Saver(Path(tempfile.mkdtemp()), {"model": {}}, asynchronous=False)
    >>> saver.finish()  # nothing in flight
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

from funcshard import checkpoint

__all__ = ["KILL_HOOK", "Saver", "async_default", "kill_hook", "remove_checkpoint"]

KILL_HOOK = "FUNCSHARD_TEST_KILL_AFTER_CKPT"


def async_default(multiprocess: bool) -> bool:
    """Whether checkpoints are written in the background when ``--async-ckpt`` is not given: under torchrun
    (``bench/async_ckpt.py``: the step during which a save starts took 1.0x a plain step with it, against
    several times that with a synchronous save), not on a simulated mesh (one process: its threads compete
    with the write for the same cores, and a notebook run wants its checkpoint on disk when the call returns).

    Example:
        >>> async_default(True), async_default(False)
        (True, False)
    """
    return multiprocess


def _lead() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class Saver:
    """Saves ``{"params", "opt_state", "step", "data_key"}`` as ``step_N`` under ``ckpt_dir`` and keeps the last
    two; with ``asynchronous`` the write goes on in the background until the next :meth:`save` or
    :meth:`finish`.

    Example:
        >>> saver = Saver(Path("runs/llama/ckpt"), {"model": {}}, asynchronous=True)  # doctest: +SKIP
        >>> saver.save(100, params, opt_state, data_key)  # doctest: +SKIP
        >>> saver.finish()  # the checkpoint of step 100 is in place  # doctest: +SKIP
    """

    def __init__(self, ckpt_dir: Path, metadata: dict[str, Any], *, asynchronous: bool) -> None:
        self.ckpt_dir, self.metadata, self.asynchronous = ckpt_dir, metadata, asynchronous
        self._pending: tuple[int, checkpoint.SaveHandle] | None = None

    def save(self, step: int, params: Any, state: Any, data_key: Any) -> None:
        """Save the state after ``step`` (waiting first for the save in flight)."""
        self.finish()
        tree = {"params": params, "opt_state": state, "step": step, "data_key": data_key}
        path = checkpoint.step_path(self.ckpt_dir, step)
        out = checkpoint.save(path, tree, step=step, metadata=self.metadata, async_save=self.asynchronous)
        if isinstance(out, checkpoint.SaveHandle):
            self._pending = (step, out)
        else:
            self._done(step)

    def finish(self) -> None:
        """Wait for the save in flight, if any (its error raised here)."""
        if self._pending is not None:
            step, handle = self._pending
            self._pending = None
            handle.wait()
            self._done(step)

    def _done(self, step: int) -> None:
        if _lead():
            for s in checkpoint.list_steps(self.ckpt_dir)[:-2]:  # keep the last two
                remove_checkpoint(self.ckpt_dir, s)
        kill_hook(step)


def remove_checkpoint(ckpt_dir: Path, step: int) -> None:
    """Delete the checkpoint of ``step``: renamed away first (one atomic step), so an interruption while its
    files go never leaves a half-deleted folder that looks like a checkpoint."""
    path = Path(checkpoint.step_path(ckpt_dir, step))
    trash = path.with_name(f"{path.name}.trash-{os.getpid()}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def kill_hook(step: int) -> None:
    """A test hook: with ``FUNCSHARD_TEST_KILL_AFTER_CKPT=RANK:STEP`` set, the process of that rank kills itself
    (SIGKILL) once the checkpoint of that step is complete, in the first generation of a torchrun job only
    (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a test can check that ``torchrun --max-restarts 1 ...
    train --resume`` survives a dead worker. Unset (the normal case) it does nothing.

    Example:
        >>> kill_hook(10)  # FUNCSHARD_TEST_KILL_AFTER_CKPT unset: nothing happens
    """
    spec = os.environ.get(KILL_HOOK)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, _, at = spec.partition(":")
    if int(rank) == int(os.environ.get("RANK", "0")) and int(at) == step:
        os.kill(os.getpid(), signal.SIGKILL)
