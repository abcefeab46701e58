"""Checkpoints of trees of ``fs.Array`` through torch.distributed.checkpoint (DCP), resharded on load.

A checkpoint is a directory; every tensor leaf is one DCP tensor of its *global* shape, named by its pytree
path (``"params/layers/wq"``) and stored as the distinct blocks of its layout (a block replicated over an
axis is written once). So the checkpoint is a standard DCP checkpoint (``dcp_to_torch_save`` turns it into
a dict of full tensors) and ``load`` can lay it out over any mesh and specs: DCP reads, for each block a
process needs, only the saved blocks that overlap it.

On disk::

    <path>/.metadata            DCP metadata: each leaf's global shape, dtype and blocks (offsets, sizes),
                                and where each block's bytes are
    <path>/__<rank>_0.distcp    DCP data: the blocks this process wrote (one file per process; fsync'd)
    <path>/funcshard.json       the manifest: format version, step, user metadata, and per leaf path its
                                kind ("array" | "tensor" | "value"), global shape, dtype, mesh, spec and
                                block offsets; Python scalars (int, float, bool, str) live here by value

A save writes into ``<path>.tmp-<uuid>``, fsyncs, then swaps it in: the previous checkpoint is renamed to
``<path>.old``, the new one to ``<path>``, and ``.old`` is deleted. A crash before the swap leaves the
previous checkpoint at ``<path>`` untouched; a crash inside the swap leaves it at ``<path>.old``, where
``load(path)`` finds it. Under ``"dist"`` every process writes its own blocks and only rank 0 swaps, after a
barrier; ``path`` must be on a filesystem every process sees.

Example:
    >>> import tempfile, torch, funcshard as fs
    >>> from funcshard import P, checkpoint
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> w = fs.device_put(torch.arange(16.0).reshape(4, 4), mesh, P("dp", "tp"))
    >>> d = tempfile.mkdtemp()
    >>> _ = checkpoint.save(f"{d}/ckpt", {"w": w, "step": 7})
    >>> like = {"w": fs.device_put(torch.zeros(4, 4), fs.make_mesh({"tp": 4}, backend="sim"), P(None, "tp")),
    ...         "step": 0}
    >>> out = checkpoint.load(f"{d}/ckpt", like)
    >>> out["step"], out["w"].spec, torch.equal(fs.device_get(out["w"]), torch.arange(16.0).reshape(4, 4))
    (7, P(None, 'tp'), True)
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optree
import torch

from ._array import Array
from ._spec import P, shard_slices
from .pytree import tree_path

__all__ = ["CheckpointError", "info", "latest", "list_steps", "load", "save", "step_path"]

PyTree = Any
MANIFEST = "funcshard.json"
FORMAT = "funcshard.checkpoint"
VERSION = 1
_VALUE_TYPES = (bool, int, float, str)


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit the tree it is loaded into; a tree that cannot
    be saved; or a save whose writes failed (the cause is chained, and the previous checkpoint is kept).

    The message names the checkpoint path, the leaf path, and what was expected and found.
    """


# -- the tree ---------------------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, Array)


def _flatten(tree: PyTree, where: str) -> tuple[list[tuple[str, Any]], Any]:
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, is_leaf=_is_array)
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for p, leaf in zip(paths, leaves, strict=True):
        name = tree_path(p) or "."
        if name in seen:
            raise CheckpointError(
                f"{where}: two leaves have the path '{name}' (e.g. a key 'a/b' beside a nested 'a' -> 'b'); "
                f"leaf paths name the tensors in the checkpoint, so rename one key."
            )
        seen.add(name)
        out.append((name, leaf))
    return out, treedef


def _backend_of(leaves: list[tuple[str, Any]], where: str) -> str:
    """``"dist"`` when the arrays are on a dist mesh (or, with no arrays, when torch.distributed is up)."""
    backends = {leaf.mesh.backend for _, leaf in leaves if isinstance(leaf, Array)}
    if len(backends) > 1:
        raise CheckpointError(f"{where}: the tree mixes 'sim' and 'dist' arrays; put every array on one backend.")
    if backends:
        return backends.pop()
    from ._backend import dist as dist_backend

    return "dist" if dist_backend.initialized() else "sim"


def _offsets(a: Array, coords: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the block the device at ``coords`` holds."""
    sl = shard_slices(a.shape, a.spec, a.mesh.shape, dict(zip(a.mesh.axis_names, coords, strict=True)))
    return tuple(s.start for s in sl), tuple(s.stop - s.start for s in sl)


def _all_offsets(a: Array) -> list[list[int]]:
    every = {_offsets(a, tuple(c.values()))[0] for c in a.mesh.device_coords()}
    return [list(o) for o in sorted(every)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _spec_json(spec: P) -> list[Any]:
    return [list(e) if isinstance(e, (tuple, list)) else e for e in spec.entries]


# -- DCP glue (imported lazily: torch.distributed.checkpoint takes a second or two to import) -------------


@functools.cache
def _dcp() -> Any:
    """The DCP module and this module's two planners, built on first use."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        LoadPlan,
        ReadItem,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SavePlanner(dcp.DefaultSavePlanner):
        """Writes the blocks of ``{fqn: (global_shape, {offsets: block})}``, each as one DCP chunk."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for fqn, (shape, blocks) in self.state_dict.items():
                for off, t in blocks.items():
                    chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape)
                    items.append(
                        WriteItem(
                            index=MetadataIndex(fqn, torch.Size(off)),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(chunk, TensorProperties(dtype=t.dtype), torch.Size(shape)),
                        )
                    )
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
            blocks = self.state_dict[write_item.index.fqn][1]
            return blocks[tuple(write_item.index.offset)].detach()

    class LoadPlanner(dcp.DefaultLoadPlanner):
        """Fills the blocks of ``{fqn: {offsets: empty block}}`` from the overlapping saved chunks."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

        def create_local_plan(self) -> LoadPlan:
            items: list[ReadItem] = []
            for fqn, blocks in self.state_dict.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in blocks.items()]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return LoadPlan(items)

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            t = self.state_dict[read_item.dest_index.fqn][tuple(read_item.dest_index.offset)]
            for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                t = t.narrow(d, o, n)  # the part of the destination block this saved chunk fills
            return t

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            pass  # resolve_tensor returned a view: the reader already copied into the block

    return dcp, SavePlanner, LoadPlanner, MetadataIndex


def _cause(e: BaseException) -> str:
    """The first failure inside DCP's ``CheckpointException`` (whose own text is only a traceback dump)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = min(failures.items(), key=lambda kv: kv[0])
        return f"rank {rank}: {type(inner).__name__}: {_first_line(inner)}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in a single process (our ``"sim"`` case, on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
        yield


# -- files ------------------------------------------------------------------------------------------------


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _is_checkpoint(d: Path) -> bool:
    return d.is_dir() and (d / MANIFEST).is_file()


def _check_replaceable(path: Path) -> None:
    if path.exists() and not _is_checkpoint(path) and not (path.is_dir() and not any(path.iterdir())):
        raise CheckpointError(
            f"save('{path}'): refusing to replace it: it exists and is not a funcshard checkpoint (no {MANIFEST}); "
            f"pick another path or remove it yourself."
        )


def _swap_in(tmp: Path, path: Path) -> None:
    """Make the finished ``tmp`` the checkpoint at ``path``; the previous one stays readable throughout."""
    old = _old(path)
    if old.exists() and path.exists():
        shutil.rmtree(old)  # left by an earlier save that died after its swap: ``path`` is newer
    moved = path.exists()
    if moved:
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if moved:
            os.rename(old, path)
        raise
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _manifest_text(manifest: dict[str, Any]) -> str:
    """JSON with one line per leaf, for a reader with ``less``."""
    head = {k: v for k, v in manifest.items() if k != "leaves"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    leaves = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in manifest["leaves"].items()]
    return "{\n" + "\n".join(lines) + '\n  "leaves": {\n' + ",\n".join(leaves) + "\n  }\n}\n"


# -- save -------------------------------------------------------------------------------------------------


def save(path: str | os.PathLike[str], tree: PyTree, *, step: int | None = None, metadata: Any = None) -> str:
    """Write ``tree`` to the checkpoint directory ``path``, atomically (a crash keeps the previous one).

    Every process calls it with its part of the tree. Each ``fs.Array`` leaf is written as the distinct
    blocks of its layout (under ``"dist"`` each process writes its own; a replicated block once); plain
    tensors and Python scalars (int, float, bool, str) are saved whole as extras (under ``"dist"``, rank
    0's). ``None`` leaves are empty subtrees, as in optree.

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is replaced).
        tree: a pytree of ``fs.Array``, ``torch.Tensor`` and Python scalars.
        step: an optional step number, recorded in the manifest (see :func:`info`).
        metadata: optional JSON-serialisable data recorded in the manifest.

    Returns:
        ``path`` as a string.

    Raises:
        CheckpointError: a leaf of another type, two leaves with one path, metadata that is not JSON, or a
            ``path`` that exists and is not a checkpoint.

    Example:
        >>> checkpoint.save("ckpt/step_100", {"params": params, "opt": opt_state}, step=100)  # doctest: +SKIP
    """
    path = Path(os.fspath(path))
    where = f"save('{path}')"
    leaves, treedef = _flatten(tree, where)
    backend = _backend_of(leaves, where)
    distributed = backend == "dist"
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointError(f"{where}: step must be an int or None, found {step!r}.")
    try:
        user_meta = json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: metadata must be JSON-serialisable ({e}).") from None
    _check_replaceable(path)

    from ._backend import dist as dist_backend

    rank0 = not distributed or dist_backend.process_rank() == 0
    entries: dict[str, dict[str, Any]] = {}
    state: dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]]] = {}
    for name, leaf in leaves:
        if isinstance(leaf, Array):
            blocks: dict[tuple[int, ...], torch.Tensor] = {}
            for c, t in leaf.shards.items():
                off, sizes = _offsets(leaf, c)
                if tuple(t.shape) != sizes:
                    raise CheckpointError(
                        f"{where}: leaf '{name}': the shard of device {c} has shape {tuple(t.shape)}, but spec "
                        f"{leaf.spec!r} of shape {leaf.shape} on mesh {leaf.mesh.shape} gives blocks of {sizes}."
                    )
                blocks.setdefault(off, t)
            state[name] = (leaf.shape, blocks)
            entries[name] = {
                "kind": "array",
                "shape": list(leaf.shape),
                "dtype": _dtype_name(leaf.dtype),
                "mesh": leaf.mesh.shape,
                "backend": leaf.mesh.backend,
                "spec": _spec_json(leaf.spec),
                "blocks": _all_offsets(leaf),
            }
        elif isinstance(leaf, torch.Tensor):
            if rank0:
                state[name] = (tuple(leaf.shape), {(0,) * leaf.dim(): leaf})
            entries[name] = {"kind": "tensor", "shape": list(leaf.shape), "dtype": _dtype_name(leaf.dtype)}
        elif isinstance(leaf, _VALUE_TYPES):
            entries[name] = {"kind": "value", "value": leaf}
        else:
            raise CheckpointError(
                f"{where}: leaf '{name}' is a {type(leaf).__name__}; a checkpoint holds fs.Array, torch.Tensor "
                f"and int / float / bool / str leaves (convert it, e.g. with torch.as_tensor)."
            )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "metadata": user_meta,
        "treedef": str(treedef),
        "leaves": entries,
    }

    uid = uuid.uuid4().hex[:12]
    if distributed:
        uid = dist_backend.broadcast_object(uid)  # every process writes into rank 0's temp dir
    tmp = path.with_name(f"{path.name}.tmp-{uid}")
    dcp, save_planner, _, _ = _dcp()
    try:
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True, thread_count=1)
        with _quiet():
            dcp.save(state, storage_writer=writer, planner=save_planner(), no_dist=not distributed)
    except BaseException as e:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, dcp.CheckpointException):  # a BaseException that names only the failing ranks
            raise CheckpointError(
                f"{where}: writing the blocks failed ({_cause(e)}); the previous checkpoint is untouched."
            ) from e
        raise
    if distributed:
        dist_backend.barrier()  # every process has written and fsync'd its blocks
    err: BaseException | None = None
    if rank0:
        try:
            with open(tmp / MANIFEST, "w") as f:
                f.write(_manifest_text(manifest))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _swap_in(tmp, path)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
            shutil.rmtree(tmp, ignore_errors=True)
            err = e
    if distributed:
        msg = dist_backend.broadcast_object(None if err is None else f"{type(err).__name__}: {err}")
        if msg is not None and err is None:
            raise CheckpointError(f"{where}: rank 0 could not put the checkpoint in place ({msg}); nothing changed.")
    if err is not None:
        raise err
    return str(path)


# -- load -------------------------------------------------------------------------------------------------


def _resolve(path: Path, where: str) -> Path:
    if path.is_dir():
        return path
    if _is_checkpoint(_old(path)):
        return _old(path)  # a save died between its two renames: the previous checkpoint is here
    raise CheckpointError(f"{where}: there is no checkpoint at '{path}' (no such directory).")


def _read_manifest(ckpt: Path, where: str) -> dict[str, Any]:
    f = ckpt / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{where}: '{ckpt}' has no {MANIFEST}: it is not a funcshard checkpoint, or it is damaged."
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}: '{f}' is damaged: {e}.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "leaves" not in manifest:
        raise CheckpointError(f"{where}: '{f}' is not a {FORMAT} manifest.")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{where}: '{f}' has format version {manifest['version']}; this funcshard reads up to {VERSION}."
        )
    return manifest


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


def _parse_dtype(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r} in the manifest.")
    return dt


def _check_data(ckpt: Path, meta: Any, name: str, entry: dict[str, Any], where: str, index_cls: Any) -> None:
    """The DCP metadata agrees with the manifest for leaf ``name`` and every block's bytes are on disk."""
    md = meta.state_dict_metadata.get(name)
    chunks = getattr(md, "chunks", None)
    if chunks is None:
        raise CheckpointError(f"{where}: leaf '{name}' is in {MANIFEST} but has no tensor data in .metadata.")
    if list(md.size) != entry["shape"] or _dtype_name(md.properties.dtype) != entry["dtype"]:
        raise CheckpointError(
            f"{where}: leaf '{name}': .metadata says shape {tuple(md.size)} {md.properties.dtype}, {MANIFEST} "
            f"says {tuple(entry['shape'])} {entry['dtype']}; the checkpoint is damaged."
        )
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(md.size):
        raise CheckpointError(
            f"{where}: leaf '{name}': its saved blocks cover {covered} of {math.prod(md.size)} elements; the "
            f"checkpoint is incomplete."
        )
    for c in chunks:
        loc = meta.storage_data.get(index_cls(name, c.offsets))
        rel = getattr(loc, "relative_path", None)
        if rel is None:
            continue  # not a filesystem checkpoint: DCP's reader checks it
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointError(
                f"{where}: leaf '{name}': block at {tuple(c.offsets)} is in '{rel}', which is missing."
            )
        need, have = loc.offset + loc.length, f.stat().st_size
        if have < need:
            raise CheckpointError(
                f"{where}: leaf '{name}': '{rel}' is truncated ({have} bytes; its block at {tuple(c.offsets)} "
                f"ends at byte {need})."
            )


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
        CheckpointError: no checkpoint at ``path``; a damaged one (missing or truncated files); a leaf of
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
        for name in requests:
            _check_data(ckpt, meta, name, saved[name], where, index_cls)
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
        from ._backend import dist as dist_backend

        return dist_backend.tensor_device() or torch.device("cpu")
    return torch.device("cpu")


# -- step directories -------------------------------------------------------------------------------------

_STEP = re.compile(r"step_(\d+)")


def step_path(root: str | os.PathLike[str], step: int) -> str:
    """``<root>/step_<step, 8 digits>``: where a training job keeps the checkpoint of ``step``.

    Example:
        >>> step_path("ckpt", 100)
        'ckpt/step_00000100'
    """
    return os.path.join(os.fspath(root), f"step_{step:08d}")


def list_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints ``<root>/step_N`` (ascending); ``[]`` when there are none."""
    root = Path(os.fspath(root))
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP.fullmatch(d.name)
        if m and _is_checkpoint(d):
            found.append(int(m.group(1)))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> str | None:
    """The path of the newest complete checkpoint under ``root`` (see :func:`step_path`), or None.

    Example:
        >>> if (p := checkpoint.latest("ckpt")) is not None:  # doctest: +SKIP
        ...     state = checkpoint.load(p, like=state)
    """
    steps = list_steps(root)
    return step_path(root, steps[-1]) if steps else None
