"""``save``: write a tree to a checkpoint directory, atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as _package  # swap_in is called through the package (as _swap_in), where tests patch it
from ..extend import Array, BackendImpl, PyTree, user_call
from ._async import SaveHandle, start_in_flight, wait_in_flight
from ._checksums import record as record_checksums
from ._files import check_replaceable, fsync_dir
from ._manifest import FORMAT, MANIFEST, VALUE_TYPES, VERSION, CheckpointError, dtype_name, manifest_text, spec_json
from ._planners import cause_of, dcp_api, quiet
from ._tree import all_block_offsets, backend_of, block_offsets, flatten
from ._writer import Staged, merge_metadata, rank_folder, stage, write


def save(
    path: str | os.PathLike[str],
    tree: PyTree,
    *,
    step: int | None = None,
    metadata: Any = None,
    async_save: bool = False,
) -> str | SaveHandle:
    """Write ``tree`` to the checkpoint directory ``path``, atomically (a crash keeps the previous one).

    Every process calls it with its part of the tree. Each ``fs.Array`` leaf is written as the distinct
    blocks of its layout (under ``"dist"`` each process writes its own; a replicated block once); plain
    tensors and Python scalars (int, float, bool, str) are saved whole as extras (under ``"dist"``, rank
    0's). ``None`` leaves are empty subtrees, as in optree.

    With ``async_save=True`` the blocks are copied to host memory (pinned on CUDA) and the call returns a
    :class:`SaveHandle` at once; a background thread writes them and puts the checkpoint in place while the
    caller goes on (under ``"dist"`` over a process group of its own). At most one save is in flight: the next
    save (either kind) waits for it first; call ``handle.wait()`` before the program ends (a save killed
    mid-write leaves the previous checkpoint readable, as a synchronous one does).

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is replaced).
        tree: a pytree of ``fs.Array``, ``torch.Tensor`` and Python scalars.
        step: an optional step number, recorded in the manifest (see :func:`info`).
        metadata: optional JSON-serialisable data recorded in the manifest.
        async_save: write in the background and return a :class:`SaveHandle`.

    Returns:
        ``path`` as a string; with ``async_save``, a :class:`SaveHandle` whose ``wait()`` returns it.

    Raises:
        CheckpointError: a leaf of another type, two leaves with one path, metadata that is not JSON, or a
            ``path`` that exists and is not a checkpoint (at once, also with ``async_save``); a failed write
            (with ``async_save``, from ``wait()``).
        PeerError: a peer process lost during the save (one line naming ``checkpoint.save``).

    Example:
        >>> checkpoint.save("ckpt/step_100", {"params": params, "opt": opt_state}, step=100)  # doctest: +SKIP
        >>> handle = checkpoint.save("ckpt/step_200", state, step=200, async_save=True)  # doctest: +SKIP
        >>> handle.wait()  # doctest: +SKIP
        'ckpt/step_200'
    """
    with user_call("checkpoint.save"):
        wait_in_flight()  # at most one save in flight: an earlier asynchronous one finishes first
        job = _prepare(Path(os.fspath(path)), tree, step, metadata)
        if not async_save:
            job.run(job.procs)
            return str(job.path)
        side = job.procs.side_channel()  # (made by every process here, at the same point, the first time)
        staged = stage(job.state)  # into shared host memory: the caller may write into its tensors at once
        folder = rank_folder(job.tmp, job.procs.process_index())
        return start_in_flight(lambda procs: job.run(procs, staged=(staged, folder)), side, str(job.path))


@dataclasses.dataclass
class _Job:
    """A save, planned: what this process writes (``state``) and the manifest rank 0 commits."""

    path: Path
    where: str
    procs: BackendImpl
    manifest: dict[str, Any]
    state: _Blocks
    tmp: Path

    def run(self, procs: BackendImpl, staged: tuple[Staged, Path] | None = None) -> None:
        """Write the blocks into ``tmp`` (or have the writer process write the ``staged`` ones into its folder),
        then rank 0 swaps them in (``procs``: the channel of the collectives)."""
        distributed, rank0 = procs.multiprocess, procs.process_index() == 0
        if staged is None:
            _write_blocks(self.tmp, self.state, self.where, self.path, procs=procs)
            if distributed:
                procs.barrier()  # every process has written and fsync'd its blocks
        else:
            self._children_done(procs, write(*staged))
        err: BaseException | None = None
        if rank0:
            try:
                if staged is not None:
                    merge_metadata(self.tmp, procs.process_count())
                _commit(self.tmp, self.path, self.manifest, self.where)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                shutil.rmtree(self.tmp, ignore_errors=True)
                err = e
        if distributed:
            msg = procs.broadcast_object(None if err is None else f"{type(err).__name__}: {err}")
            if msg is not None and err is None:
                raise CheckpointError(
                    f"{self.where}: rank 0 could not put the checkpoint in place ({msg}); nothing changed."
                )
        if err is not None:
            raise err

    def _children_done(self, procs: BackendImpl, reason: str | None) -> None:
        """Every process's writer has answered (a collective); CheckpointError on every process if one failed."""
        reasons = procs.all_gather_object(reason) if procs.multiprocess else [reason]
        failed = [(r, m) for r, m in enumerate(reasons) if m is not None]
        if failed:
            if procs.process_index() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            r, msg = failed[0]
            raise CheckpointError(
                f"{self.where}: writing the blocks failed on rank {r} ({msg}); the previous checkpoint is untouched."
            )


def _prepare(path: Path, tree: PyTree, step: int | None, metadata: Any) -> _Job:
    """Check the arguments, list this process's blocks and build the manifest; under ``"dist"`` agree on the
    temporary folder (a collective)."""
    where = f"save('{path}')"
    leaves, treedef = flatten(tree, where)
    procs = backend_of(leaves, where)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointError(f"{where}: step must be an int or None, found {step!r}.")
    try:
        user_meta = json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: metadata must be JSON-serialisable ({e}).") from None
    check_replaceable(path)
    rank0 = not procs.multiprocess or procs.process_index() == 0
    entries, state = _entries_and_blocks(leaves, where, rank0=rank0)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "metadata": user_meta,
        "treedef": str(treedef),
        "leaves": entries,
    }
    uid = uuid.uuid4().hex[:12]
    if procs.multiprocess:
        uid = procs.broadcast_object(uid)  # every process writes into rank 0's temp dir
    return _Job(path, where, procs, manifest, state, path.with_name(f"{path.name}.tmp-{uid}"))


_Blocks = dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]]]


def _is_meta(leaf: Any) -> bool:
    """Whether a tensor leaf, or any block of an ``fs.Array`` leaf, is on the meta device."""
    if isinstance(leaf, torch.Tensor):
        return leaf.is_meta
    return any(t.is_meta for t in leaf.shards.values())


def _entries_and_blocks(leaves: list[tuple[str, Any]], where: str, *, rank0: bool) -> tuple[dict[str, Any], _Blocks]:
    """Per leaf path, its manifest entry, and the distinct blocks this process writes (its global shape and
    ``{offsets: block}``); a plain tensor is written by rank 0 only, a Python scalar lives in the manifest."""
    entries: dict[str, dict[str, Any]] = {}
    state: _Blocks = {}
    for name, leaf in leaves:
        if isinstance(leaf, (Array, torch.Tensor)) and _is_meta(leaf):
            raise CheckpointError(
                f"{where}: leaf '{name}' lives on the meta device (a shape without values); initialise it on a real "
                f"device before saving (e.g. the model's init inside fs.shard_map)."
            )
        if isinstance(leaf, Array):
            blocks: dict[tuple[int, ...], torch.Tensor] = {}
            owners = _owners(leaf)
            for c, t in leaf.shards.items():
                off, sizes = block_offsets(leaf, c)
                if tuple(t.shape) != sizes:
                    raise CheckpointError(
                        f"{where}: leaf '{name}': the shard of device {c} has shape {tuple(t.shape)}, but spec "
                        f"{leaf.spec!r} of shape {leaf.shape} on mesh {leaf.mesh.shape} gives blocks of {sizes}."
                    )
                if owners is None or owners[off] == leaf.mesh.process_index():
                    blocks.setdefault(off, t)
            state[name] = (leaf.shape, blocks)
            entries[name] = {
                "kind": "array",
                "shape": list(leaf.shape),
                "dtype": dtype_name(leaf.dtype),
                "mesh": leaf.mesh.shape,
                "backend": leaf.mesh.backend,
                "spec": spec_json(leaf.spec),
                "blocks": all_block_offsets(leaf),
            }
        elif isinstance(leaf, torch.Tensor):
            if rank0:
                state[name] = (tuple(leaf.shape), {(0,) * leaf.dim(): leaf})
            entries[name] = {"kind": "tensor", "shape": list(leaf.shape), "dtype": dtype_name(leaf.dtype)}
        elif isinstance(leaf, VALUE_TYPES):
            entries[name] = {"kind": "value", "value": leaf}
        else:
            raise CheckpointError(
                f"{where}: leaf '{name}' is a {type(leaf).__name__}; a checkpoint holds fs.Array, torch.Tensor "
                f"and int / float / bool / str leaves (convert it, e.g. with torch.as_tensor)."
            )
    return entries, state


def _owners(a: Array) -> dict[tuple[int, ...], int] | None:
    """Under ``"dist"``, the process that writes each block of ``a``: the lowest rank holding it (a replicated
    block is written once); None where one process holds every device."""
    if not a.mesh.is_multiprocess:
        return None
    owners: dict[tuple[int, ...], int] = {}
    for rank, c in enumerate(a.mesh.device_coords()):
        owners.setdefault(block_offsets(a, tuple(c.values()))[0], rank)
    return owners


def _write_blocks(tmp: Path, state: _Blocks, where: str, path: Path, *, procs: BackendImpl) -> None:
    """Write this process's blocks into ``tmp`` through DCP (fsync'd; its collectives over ``procs``' process
    group); on failure remove ``tmp`` and raise a ``CheckpointError`` naming the OS's reason and the file, or
    the ``PeerError`` of a peer lost meanwhile."""
    dcp, save_planner, _, _ = dcp_api()
    failures: list[tuple[OSError, str]] = []
    distributed = procs.multiprocess
    try:
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True, thread_count=1)
        _record_failures(writer, failures)
        with quiet():
            dcp.save(
                state,
                storage_writer=writer,
                planner=save_planner(),
                process_group=procs.process_group,
                no_dist=not distributed,
            )
    except BaseException as e:
        if not distributed or procs.process_index() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        peer = procs.peer_failure("torch.distributed.checkpoint's exchange of the save plans", e)
        if peer is not None:
            raise peer from None
        if isinstance(e, OSError) or failures:
            raise _write_error(where, path, e, failures) from e
        if isinstance(e, dcp.CheckpointException):  # a BaseException that names only the failing ranks
            raise CheckpointError(
                f"{where}: writing the blocks failed ({cause_of(e)}); the previous checkpoint is untouched."
            ) from e
        raise


def _commit(tmp: Path, path: Path, manifest: dict[str, Any], where: str) -> None:
    """Rank 0: record the blocks' checksums, write the manifest (fsync'd), and swap ``tmp`` in at ``path``."""
    dcp, _, _, index_cls = dcp_api()
    try:
        record_checksums(tmp, dcp.FileSystemReader(str(tmp)).read_metadata(), index_cls, manifest["leaves"])
        with open(tmp / MANIFEST, "w") as f:
            f.write(manifest_text(manifest))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _write_error(where, path, e, [(e, str(tmp / MANIFEST))]) from e
    fsync_dir(tmp)
    _package._swap_in(tmp, path)


class _Guarded:
    """A file DCP writes to, noting the ``OSError`` of a failed write: torch.save inside DCP turns it into an
    "unexpected pos" error that has lost the reason (a full disk)."""

    def __init__(self, stream: Any, failures: list[tuple[OSError, str]], path: str) -> None:
        self._stream, self._failures, self._path = stream, failures, path

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as e:
            self._failures.append((e, self._path))
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._failures.append((e, self._path))
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _record_failures(writer: Any, failures: list[tuple[OSError, str]]) -> None:
    """Make ``writer`` (a DCP ``FileSystemWriter``) note every ``OSError`` with the path it happened on."""
    create = writer.fs.create_stream

    @contextlib.contextmanager
    def create_stream(path: Any, mode: str) -> Iterator[Any]:
        try:
            with create(path, mode) as stream:
                yield _Guarded(stream, failures, os.fspath(path))
        except OSError as e:
            if not any(e is f for f, _ in failures):
                failures.append((e, os.fspath(path)))
            raise

    writer.fs.create_stream = create_stream


def _write_error(where: str, path: Path, e: BaseException, failures: list[tuple[OSError, str]]) -> CheckpointError:
    """``No space left on device`` (or the OS's other reason) and the file, from a failed write."""
    if failures:
        err, file = failures[0]
    elif isinstance(e, OSError):
        err, file = e, os.fspath(e.filename) if e.filename is not None else str(path)
    else:
        return CheckpointError(
            f"{where}: writing the blocks failed ({cause_of(e)}); the previous checkpoint is untouched."
        )
    reason = err.strerror or str(err) or type(err).__name__
    hint = " (free space there, or save elsewhere)" if err.errno == errno.ENOSPC else ""
    return CheckpointError(f"{where}: {reason}: writing '{file}' failed{hint}; the previous checkpoint is untouched.")
