"""The writer process of asynchronous saves: the blocks staged in shared host memory, written by a process of
their own.

Why a process: a thread of the training process writing through DCP holds the GIL for most of the write
(``torch.save`` into a Python stream), and every op the training step dispatches waits for it
(``bench/async_ckpt.py``: the step during which such a save started took 1.84x a plain step, no better than a
synchronous save); a child forked at the save shares no GIL, but every page the step then writes is copied
once more (copy-on-write: 1.51x for a fork alone). So each process starts one writer process (``spawn``: a
fresh interpreter, no copy of the trainer's memory) at its first asynchronous save, and keeps it.

A save copies this process's blocks into a shared-memory file (``/dev/shm``, reused from save to save, grown
when a save needs more), the only work on the training thread; the writer maps the file, writes the blocks
with DCP's single-process save into ``<tmp>/rank_<r>/`` (fsync'd; at the lowest CPU priority, Linux's
``SCHED_IDLE``, so a busy machine runs the training step first) and answers. Once every process's writer has
answered (a collective over the side channel), rank 0 merges their DCP metadata into ``<tmp>/.metadata`` (each
block's file named relative to ``<tmp>``): the checkpoint is one standard DCP checkpoint, read as any other.

``bench/async_ckpt.py`` (a 102 MB Llama, a 307 MB checkpoint, 2 gloo processes on 2 busy cores): the step
during which a save starts took 1.17x a plain step (a synchronous save: 1.95x); the first asynchronous save,
which starts the writer, 2.45x.

Example:
    >>> import tempfile, torch
    >>> from funcshard import checkpoint
    >>> d = tempfile.mkdtemp()
    >>> checkpoint.save(f"{d}/ckpt", {"w": torch.arange(4.0)}, async_save=True).wait() == f"{d}/ckpt"
    True
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from ._planners import dcp_api, quiet

__all__ = ["Staged", "merge_metadata", "rank_folder", "stage", "write"]

_ALIGN = 64  # bytes: every block starts on a cache line in the shared file
Staged = tuple[str, int, list[tuple[Any, ...]]]  # (shared file, its bytes, items)


class _Writer:
    """This process's writer process and its shared-memory file (made at the first asynchronous save).

    The writer is a fresh interpreter (``python -c``: neither a fork of the trainer's memory nor a re-run of
    its main script, as ``multiprocessing``'s spawn would do) that reads pickled requests on its stdin and
    answers on a descriptor of its own (anything it prints goes to stderr); it ends when the trainer does
    (its stdin closes).
    """

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop("RANK", None)  # (a plain process: it joins no torch.distributed job)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from funcshard.checkpoint._writer import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.file: str | None = None
        self.nbytes = 0
        self.flat: torch.Tensor | None = None

    def ask(self, msg: Any) -> Any:
        """Send ``msg`` and return the answer (the GIL released while waiting)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        pickle.dump(msg, self.proc.stdin)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The shared file as a flat byte tensor of at least ``nbytes`` (a larger one made when needed)."""
        if self.flat is None or self.nbytes < nbytes:
            self.close_file()
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self.file = os.path.join(shm, f"funcshard-ckpt-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self.nbytes = nbytes
            storage = torch.UntypedStorage.from_file(self.file, shared=True, nbytes=nbytes)
            self.flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        return self.flat

    def close_file(self) -> None:
        if self.file is not None:
            self.flat = None
            _unlink(self.file)
            self.file = None

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the writer ends at EOF
        except OSError:
            pass
        self.close_file()


_WRITER: list[_Writer] = []


def _writer() -> _Writer:
    if not _WRITER or not _WRITER[0].alive():
        _WRITER[:] = [_Writer()]
    return _WRITER[0]


@atexit.register
def _close() -> None:
    for w in _WRITER:
        w.close()


def stage(state: dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]]]) -> Staged:
    """Copy every block of ``state`` (``{fqn: (shape, {offsets: block})}``) into this process's shared file;
    the caller may write into its tensors once this returns."""
    blocks = [(fqn, tuple(shape), tuple(off), t) for fqn, (shape, bs) in state.items() for off, t in bs.items()]
    items: list[tuple[Any, ...]] = []
    at = 0
    for fqn, shape, off, t in blocks:
        n = t.numel() * t.element_size()
        items.append((fqn, shape, off, t.dtype, tuple(t.shape), at, n))
        at += -(-n // _ALIGN) * _ALIGN
    w = _writer()
    flat = w.buffer(max(at, _ALIGN))
    for (_, _, _, t), (_, _, _, dtype, bshape, start, n) in zip(blocks, items, strict=True):
        if n:
            flat[start : start + n].view(dtype).view(bshape).copy_(t)  # (a CUDA block: copied to host here)
    assert w.file is not None
    return w.file, w.nbytes, items


def write(staged: Staged, folder: Path) -> str | None:
    """Have the writer write the staged blocks into ``folder`` (waiting, the GIL released); None when written,
    else why not."""
    w = _writer()
    try:
        answer = w.ask(("write", *staged, os.path.abspath(folder)))  # (the writer keeps the cwd it started in)
    except (EOFError, OSError, pickle.UnpicklingError) as e:
        return f"the writer process ended ({type(e).__name__}: {e})"
    if staged[0] == w.file:
        _unlink(staged[0])  # both processes keep their mapping: no name is left behind, whatever ends them
    return answer


def _unlink(file: str) -> None:
    try:
        os.unlink(file)
    except OSError:
        pass


def rank_folder(tmp: Path, rank: int) -> Path:
    """``<tmp>/rank_<rank, 5 digits>``: where process ``rank``'s writer writes."""
    return tmp / f"rank_{rank:05d}"


def main() -> None:
    """The writer process: write each staged save read from stdin, answer None or the reason it failed."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the write prints goes to stderr, not into the answers
    _lowest_priority()
    torch.set_num_threads(1)
    requests = sys.stdin.buffer
    files: set[str] = set()  # unlinked here when the trainer ends, even by os._exit or SIGKILL (stdin closes)
    try:
        while True:
            try:
                msg = pickle.load(requests)
            except (EOFError, OSError, pickle.UnpicklingError):
                return
            files.add(msg[1])
            _answer(msg, answers)
    finally:
        for f in files:
            _unlink(f)


def _answer(msg: Any, answers: Any) -> None:
    """Write the staged save ``msg`` describes; answer None, or why it failed."""
    _, file, nbytes, items, folder = msg
    try:
        _write(file, nbytes, items, Path(folder))
        answer = None
    except BaseException as e:  # noqa: BLE001 - sent to the trainer, which raises it
        answer = f"{type(e).__name__}: {e}"
    pickle.dump(answer, answers)
    answers.flush()


def _lowest_priority() -> None:
    """Run only where the cores have nothing else to do (Linux's ``SCHED_IDLE``; elsewhere ``nice 19``): a busy
    machine runs the training step first."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


_MAPPED: dict[str, torch.Tensor] = {}  # the writer's mapping of the trainer's shared file (the latest one)


def _write(file: str, nbytes: int, items: list[tuple[Any, ...]], folder: Path) -> None:
    dcp, save_planner, _, _ = dcp_api()
    if file not in _MAPPED:  # mapped once: the trainer unlinks the name after the first write
        _MAPPED.clear()
        _MAPPED[file] = torch.empty(0, dtype=torch.uint8).set_(
            torch.UntypedStorage.from_file(file, shared=True, nbytes=nbytes)
        )
    flat = _MAPPED[file]
    state: dict[str, Any] = {}
    for fqn, shape, off, dtype, bshape, start, n in items:
        block = flat[start : start + n].view(dtype).view(bshape) if n else torch.empty(bshape, dtype=dtype)
        state.setdefault(fqn, (shape, {}))[1][off] = block
    folder.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True, thread_count=1)
    with quiet():
        dcp.save(state, storage_writer=writer, planner=save_planner(), no_dist=True)


def merge_metadata(tmp: Path, ranks: int) -> None:
    """Rank 0: one DCP ``.metadata`` in ``tmp`` for the blocks the ``ranks`` writers wrote into their folders."""
    dcp, _, _, _ = dcp_api()
    merged: Any = None
    for r in range(ranks):
        folder = rank_folder(tmp, r)
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
        for info in meta.storage_data.values():
            info.relative_path = f"{folder.name}/{info.relative_path}"
        if merged is None:
            merged = meta
            continue
        for fqn, md in meta.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(fqn)
            if have is None:
                merged.state_dict_metadata[fqn] = md
            else:
                have.chunks.extend(md.chunks)
        merged.storage_data.update(meta.storage_data)
        if isinstance(meta.planner_data, dict) and isinstance(merged.planner_data, dict):
            merged.planner_data.update(meta.planner_data)
    with open(tmp / ".metadata", "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
