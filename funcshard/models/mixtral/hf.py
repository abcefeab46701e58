"""Hugging Face Mixtral folders in and out: :func:`from_hf` reads one, :func:`to_hf` writes one.

The Llama's reader and writer (:mod:`funcshard.models.llama.hf`: safetensors with no dependency, sharded or not,
tensors read one at a time; ``config.json`` of transformers 4 and 5) with the experts' tensors. Two layouts of the
experts are read: the original Mixtral checkpoints' (and what ``save_pretrained`` of transformers 4 and 5 writes),
one tensor per expert ``model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`` (``w1`` gate ``[f, d]``, ``w3`` up
``[f, d]``, ``w2`` down ``[d, f]``) and the router ``block_sparse_moe.gate.weight [E, d]``; and transformers 5's
fused in-memory names, ``mlp.experts.gate_up_proj [E, 2f, d]`` (gate rows first), ``mlp.experts.down_proj
[E, d, f]`` and ``mlp.gate.weight``. :func:`to_hf` writes the original layout, which both versions load.

Qwen3-MoE folders (``model_type`` ``"qwen3_moe"``, ``Qwen3MoeForCausalLM``) are read too: the same model with each
head's queries and keys RMSNormed (``self_attn.q_norm`` / ``k_norm``: ``Config(qk_norm=True)``), a head size of its
own (``head_dim``: ``Config(head_size=...)``), the routing weights renormalised or not (``norm_topk_prob``), the
experts' hidden size ``moe_intermediate_size`` and the experts named ``mlp.experts.{j}.gate_proj`` / ``up_proj`` /
``down_proj`` (router ``mlp.gate.weight``). Only all-sparse models: a layer with a dense MLP (``mlp_only_layers``,
``decoder_sparse_step`` above 1) is a :class:`~funcshard.ConfigError`. :func:`to_hf` writes a Qwen3-MoE folder for a
config with ``qk_norm``, a Mixtral folder otherwise.

funcshard stacks the layers and experts: ``params["layers"]["w1"][i, j]`` is expert ``j``'s ``w1`` of layer ``i``.
What funcshard's Mixtral cannot represent (a sliding window shorter than the context, router jitter, biases, another
architecture) is refused with a :class:`~funcshard.ConfigError` naming the field or the tensor.

Example:
    >>> import tempfile, torch, funcshard as fs
    >>> from funcshard.models import mixtral
    >>> cfg = mixtral.Config.preset("debug")
    >>> params = mixtral.init(fs.random.key(0), cfg)
    >>> folder = tempfile.mkdtemp()
    >>> to_hf(params, cfg, folder)
    >>> cfg2, params2 = from_hf(folder)
    >>> cfg2 == cfg, torch.equal(params2["layers"]["w2"], params["layers"]["w2"])
    (True, True)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...checkpoint.sharded_read import Headers, read_array, spec_at
from ...extend import ConfigError, FuncshardError
from ..llama.hf import config as llama_config
from ..llama.hf import convert as llama_convert
from .config import Config
from .sharding import param_shapes, param_specs

__all__ = ["config_from_hf", "config_to_hf", "from_hf", "hf_names", "read_config", "to_hf"]

PyTree = Any
PathLike = str | os.PathLike[str]

_FUSED = "model.layers.{i}.mlp.experts.gate_up_proj"  # transformers 5's in-memory layout of the experts
_ATTENTION = {k: v for k, v in llama_convert._LAYER.items() if k not in ("w1", "w3", "w2")}
_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}  # Qwen3
_QWEN3_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # mlp.experts.{j}.<name>.weight
QWEN3 = ("qwen3_moe", "Qwen3MoeForCausalLM")


def config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> Config:
    """The funcshard :class:`Config` of a Hugging Face Mixtral ``config.json`` (transformers 4 or 5 style).

    Raises:
        ConfigError: a field missing or of the wrong type, or a model funcshard's Mixtral cannot represent.

    Example:
        >>> hf = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        ...       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "num_local_experts": 4}
        >>> cfg = config_from_hf(hf)
        >>> cfg.n_experts, cfg.experts_per_token, cfg.router_aux_loss_coef, cfg.rope_theta
        (4, 2, 0.001, 1000000.0)
    """
    if not isinstance(hf, Mapping):
        raise ConfigError(f"from_hf: {where} must hold a JSON object, found {type(hf).__name__}.")
    if hf.get("model_type") == QWEN3[0]:
        return _qwen3_config(hf, where)
    if hf.get("model_type", "mixtral") != "mixtral" or "MixtralForCausalLM" not in (
        hf.get("architectures") or ["MixtralForCausalLM"]
    ):
        raise ConfigError(
            f"from_hf: {where} is a {hf.get('model_type')!r} model ({hf.get('architectures')}); "
            f"mixtral.from_hf reads Mixtral ('mixtral', MixtralForCausalLM) and Qwen3-MoE ('qwen3_moe', "
            f"Qwen3MoeForCausalLM) folders; use llama.from_hf for a Llama."
        )
    window = hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", 4096 * 32):
        raise ConfigError(
            f"from_hf: {where} field 'sliding_window' is {window}; funcshard's Mixtral attends to the whole context "
            f"(sliding_window null, or at least max_position_embeddings)."
        )
    if hf.get("router_jitter_noise", 0.0):
        raise ConfigError(
            f"from_hf: {where} field 'router_jitter_noise' is {hf['router_jitter_noise']}; funcshard's Mixtral "
            f"routes without jitter (0.0)."
        )
    base = {**hf, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    base.setdefault("rope_theta", 1e6)  # MixtralConfig's default base
    base.setdefault("rms_norm_eps", 1e-5)
    llama = llama_config.config_from_hf(base, where)
    field = llama_config._field
    try:
        return Config(
            **{f.name: getattr(llama, f.name) for f in dataclasses.fields(llama)},
            n_experts=field(hf, "num_local_experts", where, 8),
            experts_per_token=field(hf, "num_experts_per_tok", where, 2),
            router_aux_loss_coef=field(hf, "router_aux_loss_coef", where, 0.001, float),
        )
    except ConfigError:
        raise
    except FuncshardError as e:
        raise ConfigError(f"from_hf: {where}: {e}") from None


def _qwen3_config(hf: Mapping[str, Any], where: str) -> Config:
    """The :class:`Config` of a Qwen3-MoE ``config.json``: all layers sparse, q/k norms, its own head size."""
    if QWEN3[1] not in (hf.get("architectures") or [QWEN3[1]]):
        raise ConfigError(f"from_hf: {where} is a qwen3_moe config of {hf.get('architectures')}; need {QWEN3[1]}.")
    field = llama_config._field
    n_layers = field(hf, "num_hidden_layers", where)
    step, only = field(hf, "decoder_sparse_step", where, 1), hf.get("mlp_only_layers") or []
    dense = [i for i in range(n_layers) if i in only or (i + 1) % step]
    if dense:
        raise ConfigError(
            f"from_hf: {where}: layers {dense} have a dense MLP (mlp_only_layers={list(only)}, decoder_sparse_step="
            f"{step}); funcshard's mixture-of-experts models are sparse in every layer (mlp_only_layers [] and "
            f"decoder_sparse_step 1)."
        )
    if hf.get("use_sliding_window"):
        raise ConfigError(
            f"from_hf: {where} field 'use_sliding_window' is true; funcshard attends to the whole context."
        )
    dim, n_heads = field(hf, "hidden_size", where), field(hf, "num_attention_heads", where)
    head_dim = field(hf, "head_dim", where, dim // n_heads)
    base = {**hf, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "head_dim": None}
    base |= {"sliding_window": None, "intermediate_size": field(hf, "moe_intermediate_size", where)}  # per expert
    base.setdefault("rope_theta", 10000.0)  # Qwen3MoeConfig's defaults
    base.setdefault("rms_norm_eps", 1e-6)
    cfg = config_from_hf(base, where)  # as a Mixtral's, then the Qwen3 fields
    experts = field(hf, "num_experts", where, None) if "num_experts" in hf else field(hf, "num_local_experts", where)
    try:
        return dataclasses.replace(
            cfg,
            n_experts=experts,
            norm_topk_prob=field(hf, "norm_topk_prob", where, False, bool),
            head_size=None if head_dim * n_heads == dim else head_dim,
            qk_norm=True,
        )
    except FuncshardError as e:
        raise ConfigError(f"from_hf: {where}: {e}") from None


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` for transformers' ``MixtralForCausalLM`` (read by transformers 4 and 5).

    Example:
        >>> hf = config_to_hf(Config.preset("debug"))
        >>> hf["architectures"], hf["num_local_experts"], hf["num_experts_per_tok"]
        (['MixtralForCausalLM'], 4, 2)
        >>> config_from_hf(hf) == Config.preset("debug")
        True
    """
    if cfg.qk_norm:
        return _qwen3_to_hf(cfg, dtype)
    if not cfg.norm_topk_prob or cfg.head_size is not None:
        raise ConfigError(
            "to_hf: a Mixtral renormalises its top-k routing weights and has head_dim = dim / n_heads; a config with "
            "norm_topk_prob=False or a head_size is written as a Qwen3-MoE (qk_norm=True) or not at all."
        )
    hf = llama_config.config_to_hf(cfg, dtype)
    for flag in ("mlp_bias", "attention_bias"):
        hf.pop(flag)
    return {
        **hf,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def _qwen3_to_hf(cfg: Config, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` (``qk_norm``) for transformers' ``Qwen3MoeForCausalLM``."""
    hf = llama_config.config_to_hf(cfg, dtype)
    hf.pop("mlp_bias")
    return {
        **hf,
        "architectures": [QWEN3[1]],
        "model_type": QWEN3[0],
        "head_dim": cfg.head_dim,
        "moe_intermediate_size": cfg.ffn_dim,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def hf_names(cfg: Config, *, fused: bool = False) -> list[tuple[str, str, tuple[int, ...] | None]]:
    """``(hf_name, leaf, index)`` for every tensor of the model (``index``: ``(layer,)`` or ``(layer, expert)`` into
    the stacked leaf; None for embedding, final norm and head), in the order :func:`to_hf` writes them. ``fused``:
    transformers 5's in-memory names (``gate_up_proj`` stands for the leaf ``"w1"`` and ``w3`` beside it).

    Example:
        >>> [n for n in hf_names(Config.preset("debug")) if ".0.block" in n[0]][:2]
        [('model.layers.0.block_sparse_moe.gate.weight', 'router', (0,)), \
('model.layers.0.block_sparse_moe.experts.0.w1.weight', 'w1', (0, 0))]
    """
    out: list[tuple[str, str, tuple[int, ...] | None]] = [(llama_convert._TOP["embed"], "embed", None)]
    attention = _ATTENTION | (_QK_NORMS if cfg.qk_norm else {})
    for i in range(cfg.n_layers):
        out.extend((f"model.layers.{i}.{name}", leaf, (i,)) for leaf, name in attention.items())
        if fused:
            out.append((f"model.layers.{i}.mlp.gate.weight", "router", (i,)))
            out.append((_FUSED.format(i=i), "w1", (i,)))
            out.append((f"model.layers.{i}.mlp.experts.down_proj", "w2", (i,)))
            continue
        if cfg.qk_norm:  # Qwen3-MoE's names
            out.append((f"model.layers.{i}.mlp.gate.weight", "router", (i,)))
            for j in range(cfg.n_experts):
                out.extend(
                    (f"model.layers.{i}.mlp.experts.{j}.{n}.weight", w, (i, j)) for w, n in _QWEN3_EXPERT.items()
                )
            continue
        out.append((f"model.layers.{i}.block_sparse_moe.gate.weight", "router", (i,)))
        for j in range(cfg.n_experts):
            out.extend(
                (f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight", w, (i, j)) for w in ("w1", "w2", "w3")
            )
    out.append((llama_convert._TOP["norm"], "norm", None))
    if not cfg.tie_embeddings:
        out.append((llama_convert._TOP["head"], "head", None))
    return out


def _shape(shapes: PyTree, leaf: str, index: tuple[int, ...] | None, fused: bool) -> torch.Size:
    """The shape of the hf tensor at ``leaf[index]`` (``gate_up_proj``: both halves)."""
    if index is None:
        return shapes[leaf]
    shape = shapes["layers"][leaf][len(index) :]
    return torch.Size((shape[0], 2 * shape[1], shape[2])) if fused and leaf == "w1" else shape


def read_config(path: PathLike) -> Config:
    """The :class:`Config` of the Hugging Face Mixtral or Qwen3-MoE folder ``path`` (its ``config.json`` only; no
    weights read), as ``llama``'s ``read_config``.

    Raises:
        ConfigError: no such folder, no readable ``config.json``, or a model funcshard cannot represent.

    Example:
        >>> read_config("/no/such/folder")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: from_hf: '/no/such/folder' does not exist; ...
    """
    file = llama_config.model_folder(path, "from_hf") / "config.json"
    return config_from_hf(llama_config.read_json(file, "from_hf"), f"'{file}'")


def from_hf(
    path: PathLike, *, dtype: torch.dtype | None = torch.float32, mesh: Any = None, specs: Any = None
) -> tuple[Config, PyTree]:
    """Read a local Hugging Face Mixtral folder: ``config.json`` and safetensors weights (sharded or not), the
    experts one tensor each (the original checkpoints, ``save_pretrained``) or fused (transformers 5's names).

    Without a mesh, tensors are read one at a time into the stacked tree of full tensors. With a ``mesh``, the
    tree is of ``fs.Array``s laid out by ``specs`` (default ``mixtral.param_specs(cfg, mesh)``) and each process
    reads only the bytes of its own devices' blocks, one tensor's slice at a time through a memory map, as
    ``llama.from_hf(path, mesh=...)``: an expert leaf split over ``ep`` reads only this process's experts'
    tensors, and of those only its rows / columns under ``fsdp`` / ``tp``. Every process of a ``"dist"`` mesh
    calls it.

    Args:
        path: the folder.
        dtype: the parameters' dtype (default float32); ``None`` keeps the dtype on disk.
        mesh: an ``fs.Mesh`` to lay the parameters out over (None: full tensors).
        specs: their spec tree on ``mesh`` (a prefix is allowed); None: ``mixtral.param_specs(cfg, mesh)``.

    Returns:
        ``(cfg, params)``: the :class:`Config` and the parameter tree (:func:`init`'s layout) of full tensors, or of
        ``fs.Array``s with a mesh.

    Raises:
        ConfigError: no such folder, no ``config.json`` or weights, a model funcshard cannot represent, a tensor
            missing or of the wrong shape.
        ShardingError: a spec the mesh cannot lay a parameter out by.

    Example:
        >>> cfg, params = from_hf("path/to/Mixtral-8x7B-v0.1")  # doctest: +SKIP
        >>> params["layers"]["w1"].shape  # doctest: +SKIP
        torch.Size([32, 8, 14336, 4096])
        >>> cfg, params = from_hf("path/to/Mixtral-8x7B-v0.1", mesh=fs.make_mesh({"ep": 8}))  # doctest: +SKIP
    """
    folder = llama_config.model_folder(path, "from_hf")
    cfg = read_config(folder)
    where, headers = llama_convert.read_headers(folder)
    fused = _FUSED.format(i=0) in where
    names = hf_names(cfg, fused=fused)
    shapes = param_shapes(cfg)
    spare = {llama_convert._TOP["head"]} if cfg.tie_embeddings else set()
    wanted = {n: _shape(shapes, leaf, index, fused) for n, leaf, index in names}
    family = "Qwen3-MoE" if cfg.qk_norm else "Mixtral"
    llama_convert.check_tensors(wanted, where, headers, folder, family, spare)
    if mesh is not None:  # each process reads its own blocks only
        return cfg, _read_sharded(cfg, names, where, headers, mesh, specs, dtype)
    out: dict[str, Any] = {"layers": {}}
    spot = {n: (leaf, index) for n, leaf, index in names}
    llama_convert.read_tensors(spot, where, headers, _placer(out, spot, shapes, dtype, cfg.ffn_dim))
    order = list(shapes["layers"])
    tree = {"embed": out["embed"], "layers": {k: out["layers"][k] for k in order}, "norm": out["norm"]}
    if not cfg.tie_embeddings:
        tree["head"] = out["head"]
    return cfg, tree


def _read_sharded(
    cfg: Config,
    names: list[tuple[str, str, tuple[int, ...] | None]],
    where: dict[str, Any],
    headers: Headers,
    mesh: Any,
    specs: Any,
    dtype: torch.dtype | None,
) -> PyTree:
    """The tree of ``fs.Array``s (``specs``, default ``param_specs(cfg, mesh)``), each leaf read block by block:
    a stacked leaf's slice ``[i]`` or ``[i, j]`` from its layer's (expert's) tensor; ``w3`` of a fused
    ``gate_up_proj`` from its rows ``ffn..2 ffn``."""
    specs = param_specs(cfg, mesh) if specs is None else specs
    shapes = param_shapes(cfg)
    sources: dict[str, dict[tuple[int, ...], tuple[str, tuple[int, ...]]]] = {}
    for name, leaf, index in names:
        key = leaf if index is None else f"layers/{leaf}"
        sources.setdefault(key, {})[index or ()] = (name, ())
        if name.endswith("gate_up_proj"):  # [E, 2f, d]: w1 the first f rows, w3 the next
            sources.setdefault("layers/w3", {})[index] = (name, (0, cfg.ffn_dim, 0))
    out: dict[str, Any] = {"layers": {}}
    for key, table in sources.items():
        path = tuple(key.split("/"))
        shape = tuple(shapes["layers"][path[1]] if len(path) == 2 else shapes[key])
        depth = len(next(iter(table)))
        array = read_array(mesh, spec_at(specs, path), shape, dtype, depth, table.__getitem__, where, headers, path=key)
        (out["layers"] if len(path) == 2 else out)[path[-1]] = array
    tree = {"embed": out["embed"], "layers": {k: out["layers"][k] for k in shapes["layers"]}, "norm": out["norm"]}
    if not cfg.tie_embeddings:
        tree["head"] = out["head"]
    return tree


def _placer(
    out: dict[str, Any], spot: dict[str, Any], shapes: PyTree, dtype: torch.dtype | None, ffn: int
) -> Callable[[str, torch.Tensor], None]:
    """``place(name, t)`` for :func:`~funcshard.models.llama.hf.convert.read_tensors`: each tensor copied into its
    slot of the stacked tree ``out`` (``gate_up_proj`` split into ``w1`` and ``w3``)."""

    def leaf_of(leaf: str, like: torch.Tensor) -> torch.Tensor:
        if leaf not in out["layers"]:
            out["layers"][leaf] = torch.empty(shapes["layers"][leaf], dtype=dtype or like.dtype)
        return out["layers"][leaf]

    def place(name: str, t: torch.Tensor) -> None:
        leaf, index = spot[name]
        if index is None:
            out[leaf] = t.to(dtype) if dtype is not None else t
        elif name.endswith("gate_up_proj"):  # [E, 2f, d]: the gate rows first
            leaf_of("w1", t)[index].copy_(t[:, :ffn])
            leaf_of("w3", t)[index].copy_(t[:, ffn:])
        else:
            leaf_of(leaf, t)[index].copy_(t)

    return place


def to_hf(
    params: PyTree,
    cfg: Config,
    path: PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5_000_000_000,
) -> None:
    """Write ``params`` as a Hugging Face Mixtral folder that ``MixtralForCausalLM.from_pretrained(path)`` loads
    (transformers 4 and 5): ``config.json`` and the weights, one tensor per expert (the original checkpoints'
    layout), sharded above ``max_shard_bytes``. As :func:`funcshard.models.llama.to_hf` otherwise (``fs.Array``
    leaves on a ``"dist"`` mesh: every process calls it).

    Args:
        params: the parameter tree (full tensors or ``fs.Array`` leaves).
        cfg: the model config.
        path: the folder (created if needed).
        dtype: the dtype on disk; ``None``: that of ``params["embed"]``.
        max_shard_bytes: the largest weight file before the weights are split into shards.

    Raises:
        ConfigError: a leaf missing or of the wrong shape, a dtype that cannot be written.

    Example:
        >>> import tempfile, funcshard as fs
        >>> from funcshard.models import mixtral
        >>> cfg = mixtral.Config.preset("debug")
        >>> to_hf(mixtral.init(fs.random.key(0), cfg), cfg, tempfile.mkdtemp(), dtype=torch.bfloat16)
    """
    shapes = param_shapes(cfg)
    for path_, want in [(k, v) for k, v in shapes.items() if k != "layers"] + list(shapes["layers"].items()):
        leaf = params.get(path_) if path_ in params else params.get("layers", {}).get(path_)
        if leaf is None or tuple(leaf.shape) != tuple(want):
            found = "none" if leaf is None else list(leaf.shape)
            raise ConfigError(f"to_hf: params leaf '{path_}' has shape {found}, expected {list(want)} for this cfg.")
    names = hf_names(cfg)

    def table(full: PyTree) -> dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]]:
        def get(leaf: str, index: tuple[int, ...] | None) -> torch.Tensor:
            return full[leaf] if index is None else full["layers"][leaf][index]

        return {n: (_shape(shapes, leaf, i, False), lambda leaf=leaf, i=i: get(leaf, i)) for n, leaf, i in names}

    llama_convert.write_folder(params, path, dtype, lambda d: config_to_hf(cfg, d), table, max_shard_bytes)
