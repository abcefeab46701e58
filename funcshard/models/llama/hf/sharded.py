"""``from_hf(path, mesh=...)``: a Hugging Face folder read straight into ``fs.Array``s, each process reading only
the blocks its devices hold.

For every parameter and every device this process runs, the device's block (``shard_slices`` of the spec) is read
from the safetensors file through a memory map of that one tensor's bytes (``safetensors.read_block``), one HF
tensor at a time (:mod:`funcshard.checkpoint.sharded_read`, shared with the Mixtral and ``fs.nn``); a block
shared by several local devices (a replicated one, or under ``"sim"``) is read once.
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

from pathlib import Path
from typing import Any

import torch

from ....checkpoint.sharded_read import Headers, read_array, spec_at
from ..config import Config
from ..sharding import param_shapes, param_specs

__all__ = ["read_sharded"]


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

    Example:
        >>> # read_sharded(cfg, {"embed": [("model.embed_tokens.weight", None)], ...}, where, headers, mesh, None, None)
    """
    specs = param_specs(cfg, mesh) if specs is None else specs
    shapes = param_shapes(cfg)
    out: dict[str, Any] = {"layers": {}}
    for leaf, tensors in names.items():
        path = tuple(leaf.split("/"))
        shape = tuple(shapes["layers"][path[1]] if path[0] == "layers" else shapes[leaf])
        by_layer = {layer: name for name, layer in tensors}
        stacked = tensors[0][1] is not None
        array = read_array(
            mesh,
            spec_at(specs, path),
            shape,
            dtype,
            1 if stacked else 0,
            lambda lead, by_layer=by_layer: (by_layer[lead[0] if lead else None], ()),
            where,
            headers,
            path=leaf,
        )
        if path[0] == "layers":
            out["layers"][path[1]] = array
        else:
            out[leaf] = array
    return out
