"""Parameters read from safetensors files straight into ``fs.Array``s, each process reading only its own blocks.

Shared by the Llama's and the Mixtral's ``from_hf(path, mesh=...)`` and by ``fs.nn.from_pretrained``. A parameter
of global shape ``shape`` is made of Hugging Face tensors: its first ``depth`` dims are stacked (the layers, the
experts), and ``locate(lead)`` names the tensor holding the parameter's slice ``lead`` (a tuple of ``depth``
indices) with the offset of that slice inside the tensor, per remaining dim (transformers 5's fused
``gate_up_proj`` holds ``w3`` at rows ``ffn..2 ffn``). For every device this process runs, the device's block
(``shard_slices`` of the spec) is read one stacked slice at a time through a memory map of that tensor's bytes
(:func:`~funcshard.checkpoint.safetensors.read_block`); a block several local devices share is read once. So a
process's memory grows by its own shards and one tensor's mapped pages, never the model.

Example:
    >>> import tempfile, torch, funcshard as fs
    >>> from pathlib import Path
    >>> from funcshard import P
    >>> from funcshard.checkpoint.safetensors import read_header, write_file
    >>> f = Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> w = {f"l{i}": torch.arange(8.0).reshape(2, 4) + 10 * i for i in range(3)}
    >>> _ = write_file(f, [(n, t.shape) for n, t in w.items()], torch.float32, w.__getitem__)
    >>> headers = {f: read_header(f)}
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> a = read_array(mesh, P(None, None, "tp"), (3, 2, 4), None, 1, lambda lead: (f"l{lead[0]}", ()),
    ...                {n: f for n in w}, headers)
    >>> torch.equal(fs.device_get(a), torch.stack(list(w.values())))
    True
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..extend import Array, ConfigError, P, check_spec, shard_slices
from .safetensors import DTYPES, read_block, read_header

__all__ = ["Headers", "Locate", "read_array", "read_headers", "spec_at"]

Headers = dict[Path, tuple[dict[str, Any], int]]  # file -> (its header entries, where its data starts)
Locate = Callable[[tuple[int, ...]], tuple[str, tuple[int, ...]]]  # stacked index -> (tensor name, offsets)


def _weight_files(folder: Path, fn: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, from the index or the single file."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{fn}: '{index}' is not readable JSON ({e}).") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ConfigError(f"{fn}: '{index}' has no 'weight_map' of tensor names to file names.")
        return {name: folder / fname for name, fname in wm.items()}
    if single.is_file():
        return {name: single for name in read_header(single)[0]}
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pth"))
    hint = (
        f" (found {others[0]}: funcshard reads safetensors only; re-save with save_pretrained(safe_serialization=True))"
        if others
        else ""
    )
    raise ConfigError(
        f"{fn}: '{folder}' has no model.safetensors or model.safetensors.index.json{hint}; "
        f"give a folder written by save_pretrained or to_hf."
    )


def read_headers(folder: Path, fn: str = "from_hf") -> tuple[dict[str, Path], Headers]:
    """``(where, headers)`` of a Hugging Face folder's safetensors weights: tensor name -> its file, file -> its
    header (``model.safetensors``, or the files ``model.safetensors.index.json`` names).

    Raises:
        ConfigError: no weights, a file the index names missing, a corrupt header.

    Example:
        >>> read_headers(Path("/no/such/folder"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: from_hf: '/no/such/folder' has no model.safetensors ...
    """
    where = _weight_files(folder, fn)
    headers: Headers = {}
    for file in sorted(set(where.values())):
        if not file.is_file():
            raise ConfigError(f"{fn}: '{file}' is missing (named by the index of '{folder}').")
        headers[file] = read_header(file)
    return where, headers


def spec_at(specs: Any, path: tuple[str, ...], fn: str = "from_hf") -> P:
    """The spec of the leaf at ``path`` in a spec tree that may be a prefix (one ``P`` for a whole subtree).

    Raises:
        ConfigError: the tree has no entry for ``path``, or a non-``P`` there.

    Example:
        >>> spec_at({"layers": P(None, "tp")}, ("layers", "wq"))
        P(None, 'tp')
    """
    node = specs
    for key in path:
        if isinstance(node, P):
            return node
        if not isinstance(node, Mapping) or key not in node:
            raise ConfigError(f"{fn}: the spec tree has no entry for '{'/'.join(path)}'; give one per parameter.")
        node = node[key]
    if not isinstance(node, P):
        raise ConfigError(f"{fn}: the spec of '{'/'.join(path)}' is a {type(node).__name__}, not a P.")
    return node


def read_array(
    mesh: Any,
    spec: P,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    depth: int,
    locate: Locate,
    where: Mapping[str, Path],
    headers: Headers,
    *,
    path: str = "",
    fn: str = "from_hf",
) -> Array:
    """One parameter as an ``fs.Array`` laid out by ``spec`` over ``mesh``: this process's blocks, each read once.

    Args:
        mesh: the mesh.
        spec: the parameter's spec (checked against ``shape`` and ``mesh``).
        shape: its global shape.
        dtype: its dtype (None: the dtype on disk).
        depth: how many leading dims are stacked from separate tensors (0: one tensor holds it all).
        locate: ``lead -> (tensor name, offsets)`` (module docstring); ``offsets`` may be ``()`` (all zero).
        where: tensor name -> its safetensors file.
        headers: per file, ``read_header``'s ``(entries, data_start)``.
        path: the parameter's path (for messages).
        fn: the caller's name (for messages).

    Returns:
        The ``fs.Array``.

    Raises:
        ShardingError: a spec the mesh cannot lay ``shape`` out by.
        ConfigError: a tensor that cannot be read (naming it and its file).

    Example:
        >>> # read_array(mesh, P("fsdp"), (256, 64), None, 0, lambda lead: ("model.embed_tokens.weight", ()),
        >>> #            where, headers, path="embed")
    """
    check_spec(spec, shape, mesh, path=path, fn=fn)
    first = locate((0,) * depth)[0]
    dtype = dtype or DTYPES.get(headers[where[first]][0][first]["dtype"], torch.float32)  # (unknown: refused below)
    device = mesh.local_device()
    blocks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
    shards = {}
    for coords in mesh.local_device_coords():
        index = shard_slices(shape, spec, mesh.shape, coords)
        key = tuple((s.start, s.stop) for s in index)
        if key not in blocks:
            block = _read_block(index, dtype, depth, locate, where, headers)
            blocks[key] = block if device is None else block.to(device)
        t = blocks[key]
        shards[tuple(coords.values())] = t.view(t.shape)  # one tensor object per device, as device_put gives
    return Array(mesh, spec, shape, dtype, shards)


def _read_block(
    index: tuple[slice, ...],
    dtype: torch.dtype,
    depth: int,
    locate: Locate,
    where: Mapping[str, Path],
    headers: Headers,
) -> torch.Tensor:
    """The block ``index`` of a parameter, one stacked slice (one tensor's block) at a time."""
    out = torch.empty(tuple(s.stop - s.start for s in index), dtype=dtype)
    lead = [range(s.start, s.stop) for s in index[:depth]]
    for at in itertools.product(*lead):  # [..lead.., rest]: one tensor's block at a time
        name, offsets = locate(tuple(at))
        shift = offsets or (0,) * (len(index) - depth)
        rest = tuple(slice(s.start + o, s.stop + o) for s, o in zip(index[depth:], shift, strict=True))
        entries, start = headers[where[name]]
        local = tuple(i - s.start for i, s in zip(at, index[:depth], strict=True))
        out[local].copy_(read_block(where[name], name, entries[name], start, rest))
    return out
