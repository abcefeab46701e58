"""``load`` (a checkpoint laid out over any mesh and specs) and ``info`` (its manifest)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import optree
import torch

from .._array import Array
from ..pytree import PyTree
from ._checksums import verify as verify_checksums
from ._files import _resolve
from ._manifest import CheckpointError, _check_data, _parse_dtype, _read_manifest
from ._planners import _cause, _dcp, _quiet
from ._tree import _backend_of, _flatten, _offsets


def info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``: ``step``, ``metadata`` and per leaf path its kind,
    global shape, dtype, mesh and spec (as saved).

    Example:
        >>> checkpoint.info("ckpt/step_100")["step"]  # doctest: +SKIP
        100
    """
    path = Path(os.fspath(path))
    where = f"info('{path}')"
    return _read_manifest(_resolve(path, where), where)


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
    path = Path(os.fspath(path))
    where = f"load('{path}')"
    leaves, treedef = _flatten(like, where)
    backend = _backend_of(leaves, where)
    ckpt = _resolve(path, where)
    saved = _read_manifest(ckpt, where)["leaves"]

    names = [n for n, _ in leaves]
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

    dcp, _, load_planner, index_cls = _dcp()
    requests: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    for name, leaf in leaves:
        entry = saved[name]
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
            continue
        if kind not in ("array", "tensor"):
            raise CheckpointError(
                f"{where}: leaf '{name}' was saved as the value {entry.get('value')!r}, but `like` has a "
                f"{type(leaf).__name__} there; pass a Python {type(entry.get('value')).__name__}."
            )
        shape, dtype = tuple(entry["shape"]), _parse_dtype(entry["dtype"], where)
        if tuple(leaf.shape) != shape or leaf.dtype != dtype:
            raise CheckpointError(
                f"{where}: leaf '{name}' was saved with shape {shape} and dtype {dtype}, but `like` has shape "
                f"{tuple(leaf.shape)} and dtype {leaf.dtype}; build `like` with the saved shapes and dtypes."
            )
        if isinstance(leaf, Array):
            dev = _real(next(iter(leaf.shards.values())).device, leaf)
            blocks = {}
            for c in leaf.shards:
                off, sizes = _offsets(leaf, c)
                if off not in blocks:
                    blocks[off] = torch.empty(sizes, dtype=dtype, device=dev)
            requests[name] = blocks
        else:
            requests[name] = {(0,) * len(shape): torch.empty(shape, dtype=dtype, device=_real(leaf.device, None))}

    if requests:
        try:
            meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure to read the metadata means a damaged checkpoint
            raise CheckpointError(
                f"{where}: cannot read the DCP metadata '{ckpt / '.metadata'}' ({type(e).__name__}: {e}); "
                f"the checkpoint is damaged."
            ) from None
        for name, blocks in requests.items():
            _check_data(ckpt, meta, name, saved[name], where, index_cls)
            wanted = [(off, tuple(t.shape)) for off, t in blocks.items()]
            verify_checksums(ckpt, meta, index_cls, name, saved[name], wanted, where)
        try:
            with _quiet():
                reader = dcp.FileSystemReader(str(ckpt))
                dcp.load(requests, storage_reader=reader, planner=load_planner(), no_dist=backend != "dist")
        except (Exception, dcp.CheckpointException) as e:  # DCP wraps a failed read in CheckpointException
            raise CheckpointError(
                f"{where}: reading the tensor data failed ({_cause(e)}); the checkpoint is damaged."
            ) from e

    out = []
    for name, leaf in leaves:
        if isinstance(leaf, Array):
            blocks = requests[name]
            views = ((c, blocks[_offsets(leaf, c)[0]]) for c in leaf.shards)
            shards = {c: t.view(t.shape) for c, t in views}  # one tensor object per device, as device_put
            out.append(Array(leaf.mesh, leaf.spec, leaf.shape, leaf.dtype, shards))
        elif isinstance(leaf, torch.Tensor):
            out.append(next(iter(requests[name].values())))
        else:
            out.append(saved[name]["value"])
    return optree.tree_unflatten(treedef, out)


def _real(dev: torch.device, a: Array | None) -> torch.device:
    """Where a loaded block goes: ``dev``, unless ``like`` was made of meta tensors."""
    if dev.type != "meta":
        return dev
    if a is not None and a.mesh.backend == "dist":
        from .._backend import dist as dist_backend

        return dist_backend.tensor_device() or torch.device("cpu")
    return torch.device("cpu")
