"""``from_hf(path, mesh=...)``: a Hugging Face folder read straight into ``fs.Array``s, each process reading only
the blocks its devices hold.

For every parameter and every device this process runs, the device's block (``shard_slices`` of the spec) is read
from the safetensors file through a memory map of that one tensor's bytes (``safetensors.read_block``), one HF
tensor at a time; a block shared by several local devices (a replicated one, or under ``"sim"``) is read once.
A stacked layer parameter's block is read layer by layer (``model.layers.{i}...`` for each ``i`` of its layer
range). So a process's memory grows by its own shards and one tensor's mapped pages, not the model.

Example:
    >>> import tempfile, funcshard as fs
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> folder = tempfile.mkdtemp()
    >>> llama.to_hf(llama.init(fs.random.key(0), cfg), cfg, folder)
    >>> mesh = fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim")
    >>> _, params = llama.from_hf(folder, mesh=mesh)
    >>> params["layers"]["wq"].spec, params["layers"]["wq"].shards[(0, 0)].shape
    (P(None, ('tp', 'fsdp'), None), torch.Size([2, 16, 64]))
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ....extend import Array, ConfigError, P, check_spec, shard_slices
from ..config import Config
from ..sharding import param_shapes, param_specs
from .safetensors import read_block

__all__ = ["read_sharded"]

Headers = dict[Path, tuple[dict[str, Any], int]]


def _spec_at(specs: Any, path: tuple[str, ...]) -> P:
    """The spec of the leaf at ``path`` in a spec tree that may be a prefix (one ``P`` for a whole subtree)."""
    node = specs
    for key in path:
        if isinstance(node, P):
            return node
        if not isinstance(node, Mapping) or key not in node:
            raise ConfigError(f"from_hf: the spec tree has no entry for '{'/'.join(path)}'; give one per parameter.")
        node = node[key]
    if not isinstance(node, P):
        raise ConfigError(f"from_hf: the spec of '{'/'.join(path)}' is a {type(node).__name__}, not a P.")
    return node


def read_sharded(
    cfg: Config,
    names: dict[str, list[tuple[str, int | None]]],
    where: dict[str, Path],
    headers: Headers,
    mesh: Any,
    specs: Any,
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """The parameter tree of ``fs.Array``s laid out by ``specs`` (default ``param_specs(cfg, mesh)``) over ``mesh``.

    Args:
        cfg: the model's config.
        names: per leaf (``"embed"``, ``"layers/wq"``, ...) its HF tensor names with their layer (None: not stacked).
        where: HF tensor name -> its safetensors file.
        headers: per file, ``read_header``'s ``(entries, data_start)``.
        mesh: the mesh.
        specs: the spec tree (a prefix is allowed), or None.
        dtype: the parameters' dtype (None: the dtype on disk).

    Returns:
        The tree of :func:`~funcshard.models.llama.init`'s structure, of ``fs.Array``s.
    """
    specs = param_specs(cfg, mesh) if specs is None else specs
    shapes = param_shapes(cfg)
    out: dict[str, Any] = {"layers": {}}
    for leaf, tensors in names.items():
        path = tuple(leaf.split("/"))
        shape = tuple(shapes["layers"][path[1]] if path[0] == "layers" else shapes[leaf])
        spec = _spec_at(specs, path)
        check_spec(spec, shape, mesh, path=leaf, fn="from_hf")
        array = _read_array(leaf, tensors, where, headers, mesh, spec, shape, dtype)
        if path[0] == "layers":
            out["layers"][path[1]] = array
        else:
            out[leaf] = array
    return out


def _read_array(
    leaf: str,
    tensors: list[tuple[str, int | None]],
    where: dict[str, Path],
    headers: Headers,
    mesh: Any,
    spec: P,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
) -> Array:
    """One parameter as an ``fs.Array``: this process's blocks, each read once."""
    first = tensors[0][0]
    entries, _ = headers[where[first]]
    disk = _disk_dtype(entries[first]["dtype"])
    dtype = dtype or disk
    device = mesh.local_device()
    blocks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
    shards = {}
    for coords in mesh.local_device_coords():
        index = shard_slices(shape, spec, mesh.shape, coords)
        key = tuple((s.start, s.stop) for s in index)
        if key not in blocks:
            block = _read_block(tensors, where, headers, index, dtype)
            blocks[key] = block if device is None else block.to(device)
        t = blocks[key]
        shards[tuple(coords.values())] = t.view(t.shape)  # one tensor object per device, as device_put gives
    return Array(mesh, spec, shape, dtype, shards)


def _disk_dtype(name: str) -> torch.dtype:
    from .safetensors import DTYPES

    return DTYPES.get(name, torch.float32)  # (an unknown one is refused by read_block, naming the tensor)


def _read_block(
    tensors: list[tuple[str, int | None]],
    where: dict[str, Path],
    headers: Headers,
    index: tuple[slice, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The block ``index`` of a parameter: of its one HF tensor, or layer by layer of a stacked one."""
    name, layer = tensors[0]
    if layer is None:
        entries, start = headers[where[name]]
        return read_block(where[name], name, entries[name], start, index).to(dtype)
    by_layer = {lay: n for n, lay in tensors}
    rows = range(index[0].start, index[0].stop)
    out = torch.empty((len(rows), *(s.stop - s.start for s in index[1:])), dtype=dtype)
    for j, i in enumerate(rows):  # [L/pp, ...]: one layer's block at a time
        n = by_layer[i]
        entries, start = headers[where[n]]
        out[j].copy_(read_block(where[n], n, entries[n], start, index[1:]))
    return out
