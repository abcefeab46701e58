"""Hugging Face Llama folders in and out: :func:`from_hf` reads one, :func:`to_hf` writes one.

A folder is ``config.json`` and the weights as safetensors: one ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (its ``weight_map``). The format is read and written here, with no
dependency (:mod:`funcshard.checkpoint.safetensors`); tensors are read one at a time (a buffer the size
of one tensor beside the parameters), in F32, F16, BF16 or F64, and ``config.json`` is mapped by
:mod:`funcshard.models.llama.hf.config`. ``from_hf(path, mesh=...)`` gives ``fs.Array``s, each process reading
only its own blocks (:mod:`funcshard.models.llama.hf.sharded`).

The layouts agree without any permutation: funcshard's RoPE rotates halves (as transformers' ``rotate_half``),
q/k/v heads are contiguous blocks of ``head_dim`` rows in both, and weights are ``F.linear``'s
``[out_features, in_features]`` in both. funcshard stacks the layers on a leading dim
(``params["layers"]["wq"][i]`` is ``model.layers.{i}.self_attn.q_proj.weight``); SwiGLU's ``w1``, ``w3``,
``w2`` are ``gate_proj``, ``up_proj``, ``down_proj``.

Llama 3.1's RoPE scaling (``rope_type: "llama3"``) is read and written (``Config.rope_scaling``). What funcshard's
Llama cannot represent (biases, other RoPE scalings, another architecture...) is refused with a
:class:`~funcshard.ConfigError` naming the field of ``config.json`` or the tensor.

Example:
    >>> import tempfile, torch, funcshard as fs
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> params = llama.init(fs.random.key(0), cfg)
    >>> folder = tempfile.mkdtemp()
    >>> to_hf(params, cfg, folder)
    >>> cfg2, params2 = from_hf(folder)
    >>> cfg2 == cfg, torch.equal(params2["layers"]["wq"], params["layers"]["wq"])
    (True, True)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ....checkpoint.safetensors import read_tensor, write_file
from ....checkpoint.sharded_read import read_headers
from ....extend import Array, ConfigError, device_get, get_backend
from ..config import Config
from ..sharding import param_shapes
from .config import config_to_hf, model_folder, read_config
from .sharded import read_sharded

__all__ = ["check_tensors", "from_hf", "hf_names", "read_headers", "read_tensors", "to_hf", "write_folder"]

PyTree = Any
PathLike = str | os.PathLike[str]

_TOP = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w1": "mlp.gate_proj.weight",
    "w3": "mlp.up_proj.weight",
    "w2": "mlp.down_proj.weight",
}
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # buffers some old checkpoints hold
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def hf_names(cfg: Config) -> list[tuple[str, str, int | None]]:
    """``(hf_name, leaf, layer)`` for every tensor of the model, in the order ``to_hf`` writes them.

    Example:
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> hf_names(cfg)[1]
        ('model.layers.0.input_layernorm.weight', 'attn_norm', 0)
    """
    out: list[tuple[str, str, int | None]] = [(_TOP["embed"], "embed", None)]
    for i in range(cfg.n_layers):
        out.extend((f"model.layers.{i}.{name}", leaf, i) for leaf, name in _LAYER.items())
    out.append((_TOP["norm"], "norm", None))
    if not cfg.tie_embeddings:
        out.append((_TOP["head"], "head", None))
    return out


# ---------------------------------------------------------------------------------------------- from_hf


def _check_tensors(cfg: Config, where: dict[str, Path], headers: dict[Path, Any], folder: Path) -> None:
    """ConfigError for a tensor missing, of the wrong shape, or one the model has no place for."""
    shapes = param_shapes(cfg)
    wanted = {}
    for name, leaf, layer in hf_names(cfg):
        wanted[name] = shapes["layers"][leaf][1:] if layer is not None else shapes[leaf]
    spare = {_TOP["head"]} if cfg.tie_embeddings else set()  # tied: the head is the embedding (as transformers does)
    check_tensors(wanted, where, headers, folder, "Llama", spare)


def check_tensors(
    wanted: dict[str, torch.Size],
    where: dict[str, Path],
    headers: dict[Path, Any],
    folder: Path,
    model: str,
    spare: Iterable[str] = (),
) -> None:
    """ConfigError for a tensor of ``wanted`` (name -> shape) missing from the weights (``where``: name -> file,
    ``headers``: file -> its header), of another shape, or a tensor ``wanted`` has no place for (but the buffers
    some old checkpoints hold and the names in ``spare``), naming the ``model``.

    Example:
        >>> check_tensors({}, {"x": Path("m.safetensors")}, {}, Path("."), "Llama")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: from_hf: '.' holds a tensor funcshard's Llama has no place for: 'x' ...
    """
    for name, shape in wanted.items():
        if name not in where:
            raise ConfigError(
                f"from_hf: tensor '{name}' (shape {list(shape)}) is missing from the weights in '{folder}'."
            )
        file = where[name]
        entry = headers[file][0].get(name)
        if entry is None:
            raise ConfigError(f"from_hf: tensor '{name}' is missing from '{file}' (the index names that file).")
        if list(entry["shape"]) != list(shape):
            raise ConfigError(
                f"from_hf: tensor '{name}' in '{file}' has shape {entry['shape']}, expected {list(shape)} from "
                f"config.json; the weights do not belong to this config."
            )
    spare = set(spare)
    extra = [n for n in where if n not in wanted and not _IGNORED.fullmatch(n) and n not in spare]
    if extra:
        why = "a bias" if any(n.endswith(".bias") for n in extra) else "a tensor"
        raise ConfigError(
            f"from_hf: '{folder}' holds {why} funcshard's {model} has no place for: '{extra[0]}' ({len(extra)} "
            f"such); config.json and the weights disagree, or the model is not a plain {model}."
        )


def read_tensors(
    names: Iterable[str],
    where: dict[str, Path],
    headers: dict[Path, tuple[dict[str, Any], int]],
    place: Callable[[str, torch.Tensor], None],
) -> None:
    """Read the tensors ``names`` one at a time, file by file in file order, handing each to ``place(name, t)``
    (in its dtype on disk): memory of one tensor beside what ``place`` keeps.

    Example:
        >>> read_tensors([], {}, {}, print)  # nothing to read
    """
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name], []).append(name)
    for file, group in by_file.items():
        entries, data_start = headers[file]
        with open(file, "rb") as f:
            for name in sorted(group, key=lambda n: entries[n]["data_offsets"][0]):  # in file order
                place(name, read_tensor(f, file, name, entries[name], data_start))


def from_hf(
    path: PathLike, *, dtype: torch.dtype | None = torch.float32, mesh: Any = None, specs: Any = None
) -> tuple[Config, PyTree]:
    """Read a local Hugging Face Llama folder: ``config.json`` and safetensors weights (sharded or not).

    Without a mesh, tensors are read one at a time into the stacked parameter tree of full tensors (memory: the
    parameters and one tensor), with the layout of :func:`~funcshard.models.llama.init`. With a ``mesh``, the
    tree is of ``fs.Array``s laid out by ``specs`` (default ``llama.param_specs(cfg, mesh)``), and each process
    reads only the bytes of its own devices' blocks, one tensor's slice at a time through a memory map (memory:
    this process's shards and one tensor's mapped pages); every process of a ``"dist"`` mesh calls it.

    Args:
        path: the folder (``config.json``, ``model.safetensors`` or ``model.safetensors.index.json`` + shards).
        dtype: the parameters' dtype (default float32, the master weights for training); ``None`` keeps the
            dtype on disk.
        mesh: an ``fs.Mesh`` to lay the parameters out over (None: full tensors).
        specs: their spec tree on ``mesh`` (a prefix is allowed); None: ``llama.param_specs(cfg, mesh)``.

    Returns:
        ``(cfg, params)``: the :class:`Config` and the parameter tree (full tensors, or ``fs.Array``s with a mesh).

    Raises:
        ConfigError: no such folder, no ``config.json`` or no weights, a model funcshard cannot represent
            (naming the field), a tensor missing or of the wrong shape (naming it, expected vs found), a
            truncated or corrupt safetensors file.
        ShardingError: a spec the mesh cannot lay a parameter out by.

    Example:
        >>> cfg, params = from_hf("path/to/Llama-3.2-1B")  # doctest: +SKIP
        >>> params["layers"]["wq"].shape  # doctest: +SKIP
        torch.Size([16, 2048, 2048])
        >>> cfg, params = from_hf("path/to/Llama-3.2-1B", mesh=fs.make_mesh({"fsdp": 8}))  # doctest: +SKIP
    """
    folder = model_folder(path, "from_hf")
    cfg = read_config(folder)
    where, headers = read_headers(folder)
    _check_tensors(cfg, where, headers, folder)
    if mesh is not None:  # each process reads its own blocks only
        names: dict[str, list[tuple[str, int | None]]] = {}
        for name, leaf, layer in hf_names(cfg):
            names.setdefault(leaf if layer is None else f"layers/{leaf}", []).append((name, layer))
        return cfg, read_sharded(cfg, names, where, headers, mesh, specs, dtype)
    shapes = param_shapes(cfg)
    out: dict[str, Any] = {"layers": {}}
    spot = {name: (leaf, layer) for name, leaf, layer in hf_names(cfg)}

    def place(name: str, t: torch.Tensor) -> None:
        leaf, layer = spot[name]
        if layer is None:
            out[leaf] = t.to(dtype) if dtype is not None else t
            return
        if leaf not in out["layers"]:
            out["layers"][leaf] = torch.empty(shapes["layers"][leaf], dtype=dtype or t.dtype)
        out["layers"][leaf][layer].copy_(t)

    read_tensors(spot, where, headers, place)
    tree = {"embed": out["embed"], "layers": {k: out["layers"][k] for k in _LAYER}, "norm": out["norm"]}
    if not cfg.tie_embeddings:
        tree["head"] = out["head"]
    return cfg, tree


# ---------------------------------------------------------------------------------------------- to_hf


def _check_params(params: PyTree, cfg: Config) -> None:
    """ConfigError naming the leaf whose shape or presence differs from ``param_shapes(cfg)``."""
    shapes = param_shapes(cfg)
    if not isinstance(params, Mapping) or not isinstance(params.get("layers"), Mapping):
        raise ConfigError(
            f"to_hf: params must be the tree of llama.init ({{'embed', 'layers', ...}}), found {type(params).__name__}."
        )
    for top, val in shapes.items():
        subs = val.items() if isinstance(val, dict) else [(None, val)]
        for sub, shape in subs:
            path = top if sub is None else f"{top}/{sub}"
            leaf = params.get(top) if sub is None else params["layers"].get(sub)
            if leaf is None:
                raise ConfigError(f"to_hf: params have no leaf '{path}' (expected shape {list(shape)} for this cfg).")
            if tuple(leaf.shape) != tuple(shape):
                raise ConfigError(
                    f"to_hf: params leaf '{path}' has shape {list(leaf.shape)}, expected {list(shape)} for this cfg."
                )
    extra = [k for k in params if k not in shapes] + [f"layers/{k}" for k in params["layers"] if k not in _LAYER]
    if extra:
        tied = " (cfg.tie_embeddings is True: the head is the embedding)" if extra[0] == "head" else ""
        raise ConfigError(f"to_hf: params have a leaf '{extra[0]}' the config has no place for{tied}.")


def _shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped in order into files of at most ``max_bytes`` (a larger tensor alone in its file)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if groups[-1] and used + n > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += n
    return groups


def to_hf(
    params: PyTree,
    cfg: Config,
    path: PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5_000_000_000,
) -> None:
    """Write ``params`` as a Hugging Face Llama folder that ``LlamaForCausalLM.from_pretrained(path)`` loads.

    Writes ``config.json`` and the weights: ``model.safetensors``, or, above ``max_shard_bytes``, shards
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``. Weight files an earlier save
    left in the folder (``model*.safetensors``, the index) are replaced, as ``save_pretrained`` does. With
    ``fs.Array`` leaves on a ``"dist"`` mesh every process must call it (``fs.device_get`` gathers); process 0
    writes and every process returns once the folder is complete (each may read it at once), raising process
    0's error where its write failed. Plain tensors under torch.distributed: process 0 writes, the others
    return at once (call it on every process, or on process 0 alone as with ``save_pretrained``).

    Args:
        params: the parameter tree of :func:`~funcshard.models.llama.init` / :func:`from_hf`: full tensors, or
            ``fs.Array`` leaves (gathered with ``fs.device_get``).
        cfg: the model config.
        path: the folder (created if needed).
        dtype: the dtype on disk: float32, float16 or bfloat16; ``None``: that of ``params["embed"]``.
        max_shard_bytes: the largest weight file before the weights are split into shards.

    Raises:
        ConfigError: a leaf missing or of the wrong shape for ``cfg`` (naming it), a dtype that cannot be written.

    Example:
        >>> import tempfile, funcshard as fs
        >>> from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> folder = tempfile.mkdtemp()
        >>> to_hf(llama.init(fs.random.key(0), cfg), cfg, folder, dtype=torch.bfloat16, max_shard_bytes=40_000)
        >>> sorted(p.name for p in Path(folder).iterdir())[:3]
        ['config.json', 'model-00001-of-00007.safetensors', 'model-00002-of-00007.safetensors']
    """
    _check_params(params, cfg)
    write_folder(
        params,
        path,
        dtype,
        lambda dtype: config_to_hf(cfg, dtype),  # ConfigError for a dtype it cannot write
        lambda full: _table(full, cfg),
        max_shard_bytes,
    )


def write_folder(
    params: PyTree,
    path: PathLike,
    dtype: torch.dtype | None,
    config: Callable[[torch.dtype], dict[str, Any]],
    table: Callable[[PyTree], dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]]],
    max_shard_bytes: int,
) -> None:
    """:func:`to_hf`'s folder for any model: ``params`` gathered (``fs.device_get``), process 0 writes the weights
    ``table(full)`` (hf name -> ``(shape, getter)``, in order) in ``dtype`` (None: ``full["embed"]``'s) and
    ``config(dtype)`` as ``config.json``; under ``"dist"`` every process returns once the folder is complete.

    Example:
        >>> # write_folder(params, path, None, lambda dtype: {...}, lambda full: {"w": (shape, lambda: full["w"])}, 5e9)
    """
    leaves = [v for k, v in params.items() if k != "layers"] + list(params["layers"].values())
    meshes = [a.mesh for a in leaves if isinstance(a, Array) and a.mesh.is_multiprocess]
    together = bool(meshes)  # every process calls
    full = device_get(params)
    dtype = full["embed"].dtype if dtype is None else dtype
    hf = config(dtype)
    procs = meshes[0].backend_impl if together else get_backend()  # (no such array: the backend the job runs on)
    folder = Path(path).expanduser()
    err: BaseException | None = None
    if (procs.process_index() if procs.multiprocess else int(os.environ.get("RANK", "0"))) == 0:
        try:
            _write_folder(folder, table(full), dtype, hf, max_shard_bytes)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other processes hear of it
            err = e
    if together:  # a collective: no process returns before the folder is complete
        msg = procs.broadcast_object(None if err is None else f"{type(err).__name__}: {err}")
        if msg is not None and err is None:
            raise ConfigError(f"to_hf: process 0 could not write '{folder}' ({msg}).")
    if err is not None:
        raise err


def _table(full: PyTree, cfg: Config) -> dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]]:
    """The Llama's tensors by hf name: ``(shape, getter)`` of each, in the order ``to_hf`` writes them."""
    shapes = param_shapes(cfg)
    table = {}  # hf name -> (shape, getter)
    for name, leaf, layer in hf_names(cfg):
        if layer is None:
            table[name] = (shapes[leaf], lambda leaf=leaf: full[leaf])
        else:
            table[name] = (shapes["layers"][leaf][1:], lambda leaf=leaf, i=layer: full["layers"][leaf][i])
    return table


def _write_folder(
    folder: Path,
    table: dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]],
    dtype: torch.dtype,
    hf: dict[str, Any],
    max_shard_bytes: int,
) -> None:
    """``to_hf``'s files: the weights of ``table`` (in ``dtype``, sharded above ``max_shard_bytes``), the index,
    and ``config.json`` (``hf``) last."""
    folder.mkdir(parents=True, exist_ok=True)
    groups = _shards(((n, s.numel() * dtype.itemsize) for n, (s, _) in table.items()), max_shard_bytes)
    for old in folder.iterdir():  # an earlier save's weights would shadow or mix with these
        if old.name in ("model.safetensors", "model.safetensors.index.json") or _SHARD.fullmatch(old.name):
            old.unlink()
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)]
    )
    total = 0
    for fname, names in zip(files, groups, strict=True):
        entries = [(n, table[n][0]) for n in names]
        total += write_file(folder / fname, entries, dtype, lambda n: table[n][1]())
    if len(groups) > 1:
        weight_map = {n: fname for fname, names in zip(files, groups, strict=True) for n in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
