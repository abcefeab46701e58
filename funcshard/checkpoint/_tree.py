"""The tree being saved or loaded: its leaves by path, its backend, and the blocks of each array's layout."""

from __future__ import annotations

from typing import Any

import optree

from ..extend import Array, BackendImpl, PyTree, get_backend, shard_slices
from ..pytree import tree_path
from ._manifest import CheckpointError


def _is_array(x: Any) -> bool:
    return isinstance(x, Array)


def flatten(tree: PyTree, where: str) -> tuple[list[tuple[str, Any]], Any]:
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


def backend_of(leaves: list[tuple[str, Any]], where: str) -> BackendImpl:
    """The backend of the arrays' mesh (or, with no arrays, the one the job runs on: ``"dist"`` when
    torch.distributed is up), which answers the process questions of a save or load."""
    meshes = {leaf.mesh.backend: leaf.mesh for _, leaf in leaves if isinstance(leaf, Array)}
    if len(meshes) > 1:
        raise CheckpointError(f"{where}: the tree mixes 'sim' and 'dist' arrays; put every array on one backend.")
    if meshes:
        return next(iter(meshes.values())).backend_impl
    return get_backend()


def block_offsets(a: Array, coords: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the block the device at ``coords`` holds."""
    sl = shard_slices(a.shape, a.spec, a.mesh.shape, dict(zip(a.mesh.axis_names, coords, strict=True)))
    return tuple(s.start for s in sl), tuple(s.stop - s.start for s in sl)


def all_block_offsets(a: Array) -> list[list[int]]:
    every = {block_offsets(a, tuple(c.values()))[0] for c in a.mesh.device_coords()}
    return [list(o) for o in sorted(every)]
