"""``load`` (a checkpoint laid out over any mesh and specs) and ``info`` (its manifest)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import optree
import torch

from ..extend import Array, BackendImpl, PyTree, user_call
from ._async import wait_in_flight
from ._checksums import verify as verify_checksums
from ._files import resolve
from ._manifest import CheckpointError, check_data, parse_dtype, read_manifest
from ._planners import cause_of, dcp_api, quiet
from ._tree import backend_of, block_offsets, flatten


def info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``: ``step``, ``metadata`` and per leaf path its kind,
    global shape, dtype, mesh and spec (as saved).

    Example:
        >>> checkpoint.info("ckpt/step_100")["step"]  # doctest: +SKIP
        100
    """
    path = Path(os.fspath(path))
    where = f"info('{path}')"
    return read_manifest(resolve(path, where), where)


def load(path: str | os.PathLike[str], like: PyTree, *, strict: bool = True) -> PyTree:
    """The checkpoint at ``path``, laid out like ``like``: same tree, and each array on ``like``'s mesh and spec.

    ``like`` gives the target layout and nothing else: a tree of ``fs.Array`` (any mesh, any specs, either
    backend; its values are ignored), ``torch.Tensor`` (read whole, onto that tensor's device) and Python
    scalars (the saved value is returned). Each process reads only the saved blocks that overlap the blocks
    it holds (under ``"sim"``, one process holds them all).

    Args:
        path: a checkpoint directory written by :func:`save`.
        like: the target tree.
        strict: when False, leaves in the checkpoint that ``like`` lacks are ignored (a partial load).

    Returns:
        A tree of ``like``'s structure with the saved values.

    Raises:
        CheckpointError: no checkpoint at ``path``; a damaged one (missing or truncated files, or a block whose
            bytes fail the checksum recorded at save time, naming the file and the leaf); a leaf of
            ``like`` missing from it (or, with ``strict``, one of it missing from ``like``); a leaf whose
            kind, shape or dtype differs from ``like``'s. The message names the path and the leaf.

    Example:
        >>> params = checkpoint.load("ckpt/step_100", like=params)  # doctest: +SKIP
    """
    with user_call("checkpoint.load"):
        return _load(Path(os.fspath(path)), like, strict=strict)


def _load(path: Path, like: PyTree, *, strict: bool) -> PyTree:
    where = f"load('{path}')"
    wait_in_flight()  # a save still writing in the background finishes first (it may be the one asked for)
    leaves, treedef = flatten(like, where)
    procs = backend_of(leaves, where)
    ckpt = resolve(path, where)
    saved = read_manifest(ckpt, where)["leaves"]
    _check_names([n for n, _ in leaves], saved, where, strict=strict)
    requests = {}
    for name, leaf in leaves:
        blocks = _request(name, leaf, saved[name], where)
        if blocks is not None:
            requests[name] = blocks
    if requests:
        _read(ckpt, requests, saved, where, procs)
    out = []
    for name, leaf in leaves:
        if isinstance(leaf, Array):
            blocks = requests[name]
            views = ((c, blocks[block_offsets(leaf, c)[0]]) for c in leaf.shards)
            shards = {c: t.view(t.shape) for c, t in views}  # one tensor object per device, as device_put
            out.append(Array(leaf.mesh, leaf.spec, leaf.shape, leaf.dtype, shards))
        elif isinstance(leaf, torch.Tensor):
            out.append(next(iter(requests[name].values())))
        else:
            out.append(saved[name]["value"])
    return optree.tree_unflatten(treedef, out)


def _check_names(names: list[str], saved: dict[str, Any], where: str, *, strict: bool) -> None:
    """Every leaf of ``like`` is in the checkpoint (and, with ``strict``, every saved leaf is in ``like``)."""
    missing = [n for n in names if n not in saved]
    if missing:
        raise CheckpointError(
            f"{where}: leaf '{missing[0]}' of `like` is not in the checkpoint ({len(missing)} missing: "
            f"{missing[:5]}); the checkpoint has {list(saved)[:10]}. Load into a tree with the saved structure."
        )
    extra = [n for n in saved if n not in set(names)]
    if extra and strict:
        raise CheckpointError(
            f"{where}: the checkpoint has leaves that `like` lacks: {extra[:5]} ({len(extra)} in all); the tree "
            f"structure differs. Pass the full tree, or strict=False to load only the leaves of `like`."
        )


def _request(name: str, leaf: Any, entry: dict[str, Any], where: str) -> dict[tuple[int, ...], torch.Tensor] | None:
    """The empty blocks (``{offsets: tensor}``) to read for leaf ``name`` laid out like ``leaf``, after checking
    that its saved kind, shape and dtype fit; ``None`` for a Python scalar (it lives in the manifest)."""
    kind = entry.get("kind")
    if not isinstance(leaf, (Array, torch.Tensor)):
        if kind != "value":
            raise CheckpointError(
                f"{where}: leaf '{name}' was saved as a tensor of shape {tuple(entry.get('shape', ()))}, but "
                f"`like` has a {type(leaf).__name__} there; pass a tensor or fs.Array of that shape."
            )
        if type(entry["value"]) is not type(leaf):
            raise CheckpointError(
                f"{where}: leaf '{name}' was saved as {type(entry['value']).__name__} {entry['value']!r}, but "
                f"`like` has a {type(leaf).__name__} there."
            )
        return None
    if kind not in ("array", "tensor"):
        raise CheckpointError(
            f"{where}: leaf '{name}' was saved as the value {entry.get('value')!r}, but `like` has a "
            f"{type(leaf).__name__} there; pass a Python {type(entry.get('value')).__name__}."
        )
    shape, dtype = tuple(entry["shape"]), parse_dtype(entry["dtype"], where)
    if tuple(leaf.shape) != shape or leaf.dtype != dtype:
        raise CheckpointError(
            f"{where}: leaf '{name}' was saved with shape {shape} and dtype {dtype}, but `like` has shape "
            f"{tuple(leaf.shape)} and dtype {leaf.dtype}; build `like` with the saved shapes and dtypes."
        )
    if not isinstance(leaf, Array):
        return {(0,) * len(shape): torch.empty(shape, dtype=dtype, device=_real(leaf.device, None))}
    dev = _real(next(iter(leaf.shards.values())).device, leaf)
    blocks = {}
    for c in leaf.shards:
        off, sizes = block_offsets(leaf, c)
        if off not in blocks:
            blocks[off] = torch.empty(sizes, dtype=dtype, device=dev)
    return blocks


def _read(ckpt: Path, requests: dict[str, Any], saved: dict[str, Any], where: str, procs: BackendImpl) -> None:
    """Fill the requested blocks from the checkpoint at ``ckpt``, after checking its data files and checksums
    (``procs``: the backend whose processes read it together, where it is multiprocess)."""
    dcp, _, load_planner, _ = dcp_api()
    distributed = procs.multiprocess
    err = None
    try:
        _check_files(ckpt, requests, saved, where)
    except CheckpointError as e:
        if not distributed:
            raise
        err = e
    if distributed:
        _agree(err, where, procs)  # every process raises, or none: DCP's read below is a collective
    try:
        with quiet():
            reader = dcp.FileSystemReader(str(ckpt))
            dcp.load(requests, storage_reader=reader, planner=load_planner(), no_dist=not distributed)
    except (Exception, dcp.CheckpointException) as e:  # DCP wraps a failed read in CheckpointException
        peer = procs.peer_failure("torch.distributed.checkpoint's exchange of the load plans", e)
        if peer is not None:
            raise peer from None
        raise CheckpointError(
            f"{where}: reading the tensor data failed ({cause_of(e)}); the checkpoint is damaged."
        ) from e


def _check_files(ckpt: Path, requests: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """The DCP metadata reads, every requested leaf's data is on disk, and the saved blocks this process
    reads pass their checksums.

    Raises:
        CheckpointError: the first damage found, naming the file and the leaf.
    """
    dcp, _, _, index_cls = dcp_api()
    try:
        meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read the metadata means a damaged checkpoint
        raise CheckpointError(
            f"{where}: cannot read the DCP metadata '{ckpt / '.metadata'}' ({type(e).__name__}: {e}); "
            f"the checkpoint is damaged."
        ) from None
    for name, blocks in requests.items():
        check_data(ckpt, meta, name, saved[name], where, index_cls)
        wanted = [(off, tuple(t.shape)) for off, t in blocks.items()]
        verify_checksums(ckpt, meta, index_cls, name, saved[name], wanted, where)


def _agree(err: CheckpointError | None, where: str, procs: BackendImpl) -> None:
    """Under ``"dist"``, before any process starts DCP's collective read: raise on every process when any
    found damage. Each process checks only the saved blocks it reads, so a damaged block may be seen by one
    rank alone; the others would wait in the read until the collective timeout, then report that timeout.

    Raises:
        CheckpointError: this process's own error, or the first other rank's, named.
    """
    found = procs.all_gather_object(None if err is None else str(err))
    if err is not None:
        raise err
    for rank, msg in enumerate(found):
        if msg is not None:
            raise CheckpointError(f"{where}: rank {rank} found the checkpoint damaged, so no process reads it: {msg}")


def _real(dev: torch.device, a: Array | None) -> torch.device:
    """Where a loaded block goes: ``dev``, unless ``like`` was made of meta tensors."""
    if dev.type != "meta":
        return dev
    if a is not None and a.mesh.is_multiprocess:
        return a.mesh.local_device() or torch.device("cpu")
    return torch.device("cpu")
