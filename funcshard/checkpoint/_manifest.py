"""The manifest ``funcshard.json``: its format, writing and reading it, and checking a checkpoint against it.

The manifest records the format version, step, user metadata, and per leaf path its kind ("array" |
"tensor" | "value"), global shape, dtype, mesh, spec and block offsets; Python scalars live here by value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..extend import FuncshardError, P

MANIFEST = "funcshard.json"
FORMAT = "funcshard.checkpoint"
VERSION = 1
VALUE_TYPES = (bool, int, float, str)


class CheckpointError(FuncshardError):
    """A checkpoint that is missing, damaged, or does not fit the tree it is loaded into; a tree that cannot
    be saved; or a save whose writes failed (the cause is chained, and the previous checkpoint is kept).

    The message names the checkpoint path, the leaf path, and what was expected and found.

    Example:
        >>> import torch
        >>> from funcshard import checkpoint
        >>> try:
        ...     checkpoint.load("no/such/ckpt", {"w": torch.zeros(2)})
        ... except CheckpointError as e:
        ...     print(e)
        load('no/such/ckpt'): there is no checkpoint at 'no/such/ckpt' (no such directory).
    """


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_json(spec: P) -> list[Any]:
    return [list(e) if isinstance(e, (tuple, list)) else e for e in spec.entries]


def parse_dtype(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r} in the manifest.")
    return dt


def manifest_text(manifest: dict[str, Any]) -> str:
    """JSON with one line per leaf, for a reader with ``less``."""
    head = {k: v for k, v in manifest.items() if k != "leaves"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    leaves = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in manifest["leaves"].items()]
    return "{\n" + "\n".join(lines) + '\n  "leaves": {\n' + ",\n".join(leaves) + "\n  }\n}\n"


def read_manifest(ckpt: Path, where: str) -> dict[str, Any]:
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


def check_data(ckpt: Path, meta: Any, name: str, entry: dict[str, Any], where: str, index_cls: Any) -> None:
    """The DCP metadata agrees with the manifest for leaf ``name`` and every block's bytes are on disk."""
    md = meta.state_dict_metadata.get(name)
    chunks = getattr(md, "chunks", None)
    if chunks is None:
        raise CheckpointError(f"{where}: leaf '{name}' is in {MANIFEST} but has no tensor data in .metadata.")
    if list(md.size) != entry["shape"] or dtype_name(md.properties.dtype) != entry["dtype"]:
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
