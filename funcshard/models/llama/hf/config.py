"""A Hugging Face Llama ``config.json`` <-> funcshard's :class:`~funcshard.models.llama.Config`.

Both styles of transformers are read: 4 (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and 5
(``rope_parameters``, ``dtype``), and :func:`config_to_hf` writes both. What funcshard's Llama cannot
represent is a :class:`~funcshard.ConfigError` naming the field: another ``model_type`` or architecture,
attention or MLP biases, an activation other than SiLU, a ``head_dim`` other than ``hidden_size /
num_attention_heads``, RoPE scaling of any type but ``default`` and Llama 3.1's ``llama3``
(:class:`~funcshard.models.rope_scaling.RopeScaling`).

Example:
    >>> from funcshard.models.llama import Config
    >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> config_to_hf(cfg)["rope_parameters"]
    {'rope_type': 'default', 'rope_theta': 10000.0}
    >>> config_from_hf(config_to_hf(cfg)) == cfg
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ....extend import ConfigError, FuncshardError
from ...rope_scaling import RopeScaling
from ..config import Config

__all__ = ["HF_DTYPES", "config_from_hf", "config_to_hf", "model_folder", "read_config", "read_json"]

HF_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}  # config.json's names


def _field(hf: Mapping[str, Any], name: str, where: str, default: Any = None, kind: type = int) -> Any:
    """``hf[name]`` checked to be a ``kind`` (an int > 0, a float >= 0, a bool), or ``default`` when absent or
    null (as transformers reads ``"num_key_value_heads": null``: as many as the query heads)."""
    value = hf.get(name)
    value = default if value is None else value
    if value is None:
        raise ConfigError(f"from_hf: {where} has no field '{name}'; a Llama config.json needs it.")
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, want = number and isinstance(value, int) and value > 0, "a positive integer"
    else:
        ok, want = number and value >= 0, "a number >= 0"
    if not ok:
        raise ConfigError(f"from_hf: {where} field '{name}' must be {want}, found {value!r}.")
    return kind(value)


def _rope(hf: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling of transformers 4 (``rope_theta``, ``rope_scaling``) or 5 (``rope_parameters``);
    ConfigError for any RoPE scaling but Llama 3.1's (``"llama3"``)."""
    theta, scaling = hf.get("rope_theta", 10000.0), None
    for field in ("rope_scaling", "rope_parameters"):
        rp = hf.get(field)
        if rp is None:
            continue
        if not isinstance(rp, Mapping):
            raise ConfigError(f"from_hf: {where} field '{field}' must be an object or null, found {rp!r}.")
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind == "llama3":
            # transformers takes the context length for the pre-training one when the field is absent
            rp = {"original_max_position_embeddings": hf.get("max_position_embeddings", 2048), **rp}
            try:
                scaling = RopeScaling.from_dict(rp)
            except ConfigError as e:
                raise ConfigError(
                    f"from_hf: {where} field '{field}' asks for RoPE scaling of type 'llama3', whose fields do not "
                    f"fit: {e}"
                ) from None
        elif kind != "default":
            raise ConfigError(
                f"from_hf: {where} field '{field}' asks for RoPE scaling of type {kind!r}; funcshard's Llama has "
                f"plain RoPE (type 'default') and Llama 3.1's ('llama3') only; use a model with one of those."
            )
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(
                f"from_hf: {where} field '{field}' has partial_rotary_factor={rp['partial_rotary_factor']}; "
                f"funcshard's Llama rotates whole heads (1.0)."
            )
        theta = rp.get("rope_theta", theta)
    return _field({"rope_theta": theta}, "rope_theta", where, kind=float), scaling


def config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> Config:
    """The funcshard :class:`Config` of a Hugging Face Llama ``config.json`` (transformers 4 or 5 style).

    Args:
        hf: the parsed ``config.json``.
        where: how errors name the file.

    Returns:
        The :class:`Config`; ``max_seq_len`` is ``max_position_embeddings``, ``init_std`` ``initializer_range``.

    Raises:
        ConfigError: a field missing or of the wrong type, or a model funcshard's Llama cannot represent
            (naming the field).

    Example:
        >>> hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        ...       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
        >>> config_from_hf(hf).n_kv_heads
        2
        >>> config_from_hf({**hf, "attention_bias": True})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: from_hf: config.json field 'attention_bias' is true; ...
    """
    if not isinstance(hf, Mapping):
        raise ConfigError(f"from_hf: {where} must hold a JSON object, found {type(hf).__name__}.")
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(
            f"from_hf: {where} field 'model_type' is {model_type!r}; funcshard reads Llama models ('llama') only."
        )
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise ConfigError(
            f"from_hf: {where} field 'architectures' is {archs!r}; funcshard reads 'LlamaForCausalLM' folders."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"from_hf: {where} field '{flag}' is true; funcshard's Llama has no biases there.")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"from_hf: {where} field 'hidden_act' is {hf['hidden_act']!r}; funcshard's Llama uses SwiGLU ('silu')."
        )
    dim, n_heads = _field(hf, "hidden_size", where), _field(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        raise ConfigError(
            f"from_hf: {where} field 'head_dim' is {head_dim}, but funcshard's Llama has head_dim = hidden_size / "
            f"num_attention_heads = {dim} / {n_heads}; a model with another head_dim cannot be represented."
        )
    theta, scaling = _rope(hf, where)
    try:
        return Config(
            vocab_size=_field(hf, "vocab_size", where),
            dim=dim,
            n_layers=_field(hf, "num_hidden_layers", where),
            n_heads=n_heads,
            n_kv_heads=_field(hf, "num_key_value_heads", where, n_heads),
            ffn_dim=_field(hf, "intermediate_size", where),
            max_seq_len=_field(hf, "max_position_embeddings", where, 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=_field(hf, "rms_norm_eps", where, 1e-6, float),
            tie_embeddings=_field(hf, "tie_word_embeddings", where, False, bool),
            init_std=_field(hf, "initializer_range", where, 0.02, float),
        )
    except ConfigError:
        raise
    except FuncshardError as e:  # the Config's own checks (head dim even, heads divisible)
        raise ConfigError(f"from_hf: {where}: {e}") from None


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` for transformers' ``LlamaForCausalLM`` (read by transformers 4 and 5).

    Example:
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> hf = config_to_hf(cfg)
        >>> hf["architectures"], hf["num_key_value_heads"], hf["torch_dtype"]
        (['LlamaForCausalLM'], 2, 'float32')
        >>> config_from_hf(hf) == cfg
        True
    """
    if dtype not in HF_DTYPES:
        raise ConfigError(
            f"to_hf: dtype {dtype} cannot be written; use torch.float32, torch.float16 or torch.bfloat16."
        )
    scaling = {} if cfg.rope_scaling is None else dataclasses.asdict(cfg.rope_scaling)
    kind = "default" if cfg.rope_scaling is None else "llama3"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4
        "rope_scaling": None if cfg.rope_scaling is None else {"rope_type": kind, **scaling},
        "rope_parameters": {"rope_type": kind, "rope_theta": cfg.rope_theta, **scaling},  # transformers 5
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": HF_DTYPES[dtype],  # transformers 4
        "dtype": HF_DTYPES[dtype],  # transformers 5
    }


def model_folder(path: str | os.PathLike[str], who: str) -> Path:
    """``path`` as a folder that exists; ConfigError (prefixed ``who``) otherwise.

    Example:
        >>> model_folder(".", "from_hf").is_dir()
        True
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ConfigError(f"{who}: '{folder}' {what}; give the folder of a Hugging Face Llama (config.json + weights).")
    return folder


def read_json(file: Path, who: str) -> Any:
    """The JSON in ``file``; ConfigError (prefixed ``who``) naming the file when it is missing or not JSON.

    Example:
        >>> read_json(Path("/no/config.json"), "from_hf")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: from_hf: '/no/config.json' is missing; ...
    """
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{who}: '{file}' is missing; a Hugging Face model folder has one.") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{who}: '{file}' is not readable JSON ({e}).") from None


def read_config(path: str | os.PathLike[str]) -> Config:
    """The :class:`Config` of the Hugging Face Llama folder ``path`` (its ``config.json`` only; no weights read).

    Raises:
        ConfigError: no such folder, no readable ``config.json``, or a model funcshard cannot represent.

    Example:
        >>> read_config("/no/such/folder")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: from_hf: '/no/such/folder' does not exist; ...
    """
    file = model_folder(path, "from_hf") / "config.json"
    return config_from_hf(read_json(file, "from_hf"), f"'{file}'")
