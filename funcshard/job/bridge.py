"""``train --init-from PATH`` on any Hugging Face causal LM whose config has a tensor-parallel plan (Qwen3, Mistral,
...): the model runs through ``fs.nn.parallelize`` instead of funcshard's own Llama.

A Llama folder keeps the native path (``llama.from_hf``); any other ``...ForCausalLM`` folder is built with
transformers (``AutoModelForCausalLM``) on the meta device and its weights read shard by shard, each process only
its own (``fs.nn.empty_pretrained`` / ``load_pretrained``), laid out by its own ``config.base_model_tp_plan`` over
``tp``, its batch over ``dp`` / ``fsdp`` and its parameters sharded over ``fsdp``, the head's vocabulary split over
``tp`` (the loss never gathers it). The step is the native one's: ``fs.value_and_grad`` of the global-batch mean
token loss, then clipping and AdamW, in one ``shard_map``. The model's shape fields are read into a ``llama.Config``
for the job's reports (parameter count, FLOPs, checkpoints' metadata). At the end of a run the trained weights are
written as a Hugging Face folder (``--out``/``hf``, with the tokenizer files of ``--init-from``) that
``AutoModelForCausalLM.from_pretrained`` loads.

Example:
    >>> from funcshard.job.cli import train_parser
    >>> wanted(train_parser().parse_args([]))  # no --init-from: the native Llama
    False
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

import funcshard as fs
from funcshard import P, optim
from funcshard.checkpoint.sharded_read import read_headers
from funcshard.models import llama

from .cli import UsageError

__all__ = ["build_step", "eval_and_init", "load_model", "load_weights", "read_config", "save_hf", "wanted"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _hf_config(folder: str | Path) -> dict[str, Any]:
    try:
        conf = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return conf if isinstance(conf, dict) else {}


def wanted(args: argparse.Namespace) -> bool:
    """Whether ``args`` train a Hugging Face folder through the bridge: ``--init-from`` a folder whose
    ``config.json`` names a model type other than ``llama`` (and not ``--model mixtral``: funcshard's own MoE)."""
    folder = getattr(args, "init_from", None)
    if not folder or getattr(args, "model", "llama") == "mixtral":
        return False
    model_type = _hf_config(folder).get("model_type")
    return model_type is not None and model_type != "llama"


def read_config(folder: str | Path) -> llama.Config:
    """The folder's shape as a ``llama.Config`` (for the job's reports and checks; the model itself is the folder's).

    Raises:
        UsageError: no ``config.json``, a model that is not a causal LM, or one without a tensor-parallel plan.
    """
    conf = _hf_config(folder)
    archs = conf.get("architectures") or []
    if not conf or not any(str(a).endswith("ForCausalLM") for a in archs):
        raise UsageError(
            f"--init-from '{folder}': config.json must name a '...ForCausalLM' architecture (found {archs or None})."
        )
    if not conf.get("base_model_tp_plan"):
        model = load_model(str(folder))  # the plan may come from the class's config defaults
        if not getattr(model.config, "base_model_tp_plan", None):
            raise UsageError(f"--init-from '{folder}': the model's config has no base_model_tp_plan to shard it by.")
    heads = conf.get("num_attention_heads", 1)
    dim = conf.get("hidden_size", 1)
    return llama.Config(
        vocab_size=conf["vocab_size"],
        dim=dim,
        n_layers=conf.get("num_hidden_layers", 1),
        n_heads=heads,
        n_kv_heads=conf.get("num_key_value_heads") or heads,
        ffn_dim=conf.get("intermediate_size", 4 * dim),
        max_seq_len=conf.get("max_position_embeddings", 2048),
        rope_theta=float(conf.get("rope_theta") or (conf.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        norm_eps=conf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(conf.get("tie_word_embeddings", False)),
    )


@functools.lru_cache(maxsize=2)
def load_model(folder: str) -> torch.nn.Module:
    """The folder's model, float32, in train mode, its parameters on the meta device (``fs.nn.empty_pretrained``:
    no memory; the weights are read shard by shard by ``eval_and_init``'s init), built once per folder.

    Raises:
        UsageError: transformers is missing or cannot build the folder's model.
    """
    try:
        return fs.nn.empty_pretrained(folder, dtype=torch.float32)
    except fs.FuncshardError as e:
        raise UsageError(f"--init-from '{folder}' is not a Llama: {e}") from None


def _parallelized(args: argparse.Namespace, mesh: fs.Mesh) -> tuple[dict, dict, Any, Any]:
    """``(params, specs, fn, loss)`` of the folder's model on ``mesh``: parameters only (buffers stay fixed)."""
    model = load_model(str(args.init_from))
    params, specs, fn = fs.nn.parallelize(model, mesh, loss_parallel=True)
    lay = fn.layout
    names = [n for n in params if n in lay.replicas]  # parameters (buffers have no gradient-sum axes)
    vocab_axis = lay.tp

    def loss(p: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = fn(p, tokens).logits  # [b/data, s, V/tp]
        return fs.nn.causal_lm_loss(logits, targets, vocab_axis=vocab_axis, data_axes=lay.data_axes, shift=False)

    return {n: params[n] for n in names}, {n: specs[n] for n in names}, fn, loss


def build_step(
    args: argparse.Namespace, cfg: llama.Config, mesh: fs.Mesh, *, check_args: Any, optimizer: Any, make: Any
) -> Any:
    """The train step of the bridged model (``step.build_step``'s for a non-Llama ``--init-from``), built with the
    native step's ``check_args``, ``optimizer`` and ``make`` (``step.TrainStep``), which ``step`` hands in.

    Returns:
        A ``step.TrainStep``.
    """
    _, specs, fn, loss = _parallelized(args, mesh)
    warmup = check_args(args, mesh, cfg)
    opt = optimizer(args, warmup)
    if getattr(args, "grad_accum", 1) > 1:
        opt = optim.multi_steps(opt, args.grad_accum)
    sspecs = opt.state_specs(specs)
    bs = fn.batch_spec if len(fn.batch_spec) else P(None, None)

    def step_fn(p: Any, s: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any, Any]:
        value, grads = fs.value_and_grad(loss)(p, tokens, targets)  # [], grads like p
        p, s = opt.update(grads, s, p)
        return value, p, s

    kw = {"mesh": mesh, "check_vma": args.check_vma}
    step = fs.shard_map(step_fn, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs), donate=(0, 1), **kw)
    opt_init = fs.shard_map(opt.init, in_specs=(specs,), out_specs=sspecs, **kw)
    return make(step, opt_init, specs, sspecs, bs, opt)


def eval_and_init(args: argparse.Namespace, mesh: fs.Mesh, specs: Any, batch_spec: P) -> tuple[Any, Any]:
    """``(eval_step, init)``: the held-out loss of the bridged model, and its weights as ``fs.Array``s (each process
    reading only its own shards: ``fs.nn.load_pretrained``)."""
    _, _, _, loss = _parallelized(args, mesh)
    folder = str(args.init_from)

    def eval_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return loss(p, tokens, targets)

    kw = {"mesh": mesh, "check_vma": args.check_vma}
    eval_step = fs.shard_map(eval_fn, in_specs=(specs, batch_spec, batch_spec), out_specs=P(), **kw)
    return eval_step, lambda key: load_weights(folder, mesh, specs)


def load_weights(folder: str, mesh: fs.Mesh, specs: dict[str, P]) -> dict[str, fs.Array]:
    """The folder's parameters (those ``specs`` names) as ``fs.Array``s over ``mesh``: each process reading only its
    own shards (``fs.nn.load_pretrained``), or, for a folder whose tensors transformers renames as it loads them (a
    Mixtral's per-expert tensors into its fused ``experts.gate_up_proj``), read whole by transformers and laid out.

    Raises:
        UsageError: weights that cannot be read or do not fit the model.
    """
    module = load_model(folder)
    try:
        if not _renamed(folder, module):
            return fs.nn.load_pretrained(folder, module, mesh, specs)
        import transformers

        whole = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        state = dict(whole.named_parameters())
        return fs.device_put({n: state[n].detach() for n in specs}, mesh, specs)
    except fs.FuncshardError as e:
        raise UsageError(f"--init-from: {e}") from None


def _renamed(folder: str, module: torch.nn.Module) -> bool:
    """Whether some parameter of ``module`` is under none of its names (a tied one has several) in the folder."""
    stored = set(read_headers(Path(folder))[0])
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return any(not any(n in stored for n in names) for names in groups.values())


def save_hf(params: Any, args: argparse.Namespace, out: Path) -> Path:
    """Write the trained ``params`` as a Hugging Face folder ``out`` (with ``--init-from``'s tokenizer files) that
    ``AutoModelForCausalLM.from_pretrained`` loads; returns ``out``."""
    full = fs.device_get(params)  # every process gathers (a collective under torchrun)
    if int(os.environ.get("RANK", "0")) != 0:
        return out
    trained = copy.deepcopy(load_model(str(args.init_from)))  # (its parameters meta: replaced, not copied into)
    trained.load_state_dict(full, strict=False, assign=True)  # the parameters; the buffers are the folder's
    trained.tie_weights()  # a tied head is the embedding again (assign replaced the embedding's tensor)
    trained.save_pretrained(out, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        src = Path(args.init_from) / name
        if src.is_file():
            shutil.copy(src, out / name)
    return out
