"""The train job's step, built once from its flags: the model of the command line, the optimiser, and ONE
``shard_map`` of ``llama.value_and_grad`` and the update (``train`` runs it, ``plan`` and the preflight lower it).

Example:
    >>> from funcshard.job.cli import train_parser
    >>> args = train_parser().parse_args(["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
    ...                                   "--ffn", "128", "--seq", "32"])
    >>> step = build_step(args, model_config(args), fs.make_mesh({"dp": 2}, backend="abstract"))
    >>> step.batch_spec
    P('dp', None)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, NamedTuple

import torch

import funcshard as fs
from funcshard import P, optim
from funcshard.models import llama, mixtral

from . import bridge, init_from
from .cli import UsageError

__all__ = ["TrainStep", "build_step", "check_args", "model_config", "model_module", "optimizer"]

DATA_AXES = ("dp", "fsdp", "ep")  # the mesh axes the batch is split over


def model_config(args: argparse.Namespace) -> llama.Config:
    """The model of the command line (byte-level: vocabulary 256): a Llama, or with ``--model mixtral`` a Mixtral.

    Args:
        args: parsed ``funcshard train`` options (``--dim``, ``--layers``, ``--heads``, ``--kv-heads``, ``--ffn``,
            ``--seq``, ``--sp``; ``--model``, ``--experts``, ``--top-k``, ``--aux-loss-coef``).

    Returns:
        The ``llama.Config`` (or ``mixtral.Config``), with ``sequence_parallel`` set by ``--sp``.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> args = train_parser().parse_args(["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        ...                                   "--ffn", "128", "--seq", "32", "--sp"])
        >>> cfg = model_config(args)
        >>> cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.max_seq_len, cfg.sequence_parallel
        (256, 64, 2, 32, True)
    """
    moe = getattr(args, "model", "llama") == "mixtral"
    family = mixtral.Config if moe else llama.Config
    extra = (
        {"n_experts": args.experts, "experts_per_token": args.top_k, "router_aux_loss_coef": args.aux_loss_coef}
        if moe
        else {}
    )
    cfg = family(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
        pp_schedule=getattr(args, "schedule", "1f1b"),
        pp_microbatches=getattr(args, "microbatches", None),
        remat=getattr(args, "remat", "none"),
        precision=_precision(args),
        **extra,
    )
    cfg = dataclasses.replace(cfg, sequence_parallel=True) if args.sp else cfg
    return init_from.model_config(args, cfg) if getattr(args, "init_from", None) else cfg  # a Hugging Face folder's


def model_module(cfg: llama.Config) -> Any:
    """The model package of ``cfg``: :mod:`funcshard.models.mixtral` for a ``mixtral.Config``, else
    :mod:`funcshard.models.llama` (both have ``init``, ``param_specs``, ``batch_spec``, ``loss``,
    ``value_and_grad``, ``forward``).

    Example:
        >>> model_module(mixtral.Config.preset("debug")).__name__
        'funcshard.models.mixtral'
    """
    return mixtral if isinstance(cfg, mixtral.Config) else llama


def _precision(args: argparse.Namespace) -> fs.Precision | None:
    """``--dtype`` / ``--reduce-dtype`` as a policy: float32 master weights and moments, the compute dtype asked
    for, the loss and logits in float32; ``None`` for a plain float32 run."""
    dtype, reduce = getattr(args, "dtype", "fp32"), getattr(args, "reduce_dtype", "fp32")
    if dtype == "fp32" and reduce == "fp32":
        return None
    return fs.Precision(torch.float32, dtype, reduce, torch.float32)


def check_args(args: argparse.Namespace, mesh: fs.Mesh, cfg: llama.Config) -> int:
    """Sizes the mesh cannot use -> UsageError; returns the warmup steps."""
    data = math.prod(mesh.shape.get(a, 1) for a in DATA_AXES)
    names = " x ".join(a for a in DATA_AXES if a in mesh.shape) or "dp x fsdp"
    if args.batch % data:
        raise UsageError(f"--batch {args.batch} is not divisible by the data-parallel size ({names} = {data}).")
    accum = getattr(args, "grad_accum", 1)
    if args.batch % (data * accum):
        raise UsageError(
            f"--grad-accum {accum} splits --batch {args.batch} into {accum} microbatches, each divisible by the "
            f"data-parallel size {data}: use a --batch that is a multiple of {data * accum}."
        )
    pp = mesh.shape.get("pp", 1)
    if pp > 1 and (args.batch // data) % cfg.microbatches(pp):
        raise UsageError(
            f"--batch {args.batch} gives {args.batch // data} sequences per pipeline ({names} = {data}), not "
            f"divisible by --microbatches {cfg.microbatches(pp)}; use a --batch that is a multiple of "
            f"{data * cfg.microbatches(pp)}."
        )
    tp = mesh.shape.get("tp", 1)
    if args.sp and args.seq % tp:
        raise UsageError(f"--sp needs --seq divisible by tp={tp}; found --seq {args.seq}.")
    warmup = min(20, args.steps // 10) if args.warmup is None else args.warmup
    if warmup >= args.steps:
        raise UsageError(f"--warmup {warmup} must be smaller than --steps {args.steps}.")
    return warmup


def optimizer(args: argparse.Namespace, warmup: int) -> optim.Optimizer:
    final = args.lr / 10 if args.final_lr is None else args.final_lr
    schedule = optim.warmup_cosine(args.lr, warmup, args.steps, final_lr=final)
    adamw = optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay)  # b2 as LLM recipes (Llama)
    return optim.chain(optim.clip_by_global_norm(args.clip), adamw)


class TrainStep(NamedTuple):
    """The train job's step on a mesh, and what goes with it (:func:`build_step`)."""

    step: Any  # shard_map'd (params, state, tokens, targets) -> (loss, params, state); params and state donated
    opt_init: Any  # shard_map'd params -> state
    specs: Any  # the params' specs
    state_specs: Any  # the optimiser state's specs
    batch_spec: P  # the spec of a [batch, seq] token tensor
    optimizer: optim.Optimizer


def build_step(args: argparse.Namespace, cfg: llama.Config, mesh: fs.Mesh) -> TrainStep:
    """The step ``train`` runs for ``args`` on ``mesh`` (``plan`` lowers the same one): ``llama.value_and_grad``
    (pipelined on a pp axis) and the optimiser's update (clipping, AdamW on a warmup-cosine schedule, accumulation
    with ``--grad-accum``) in ONE ``shard_map``, params and state donated.

    Raises:
        UsageError: sizes the mesh cannot use (batch, microbatches, sequence parallelism).
        fs.ShardingError: an axis the model cannot use.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> args = train_parser().parse_args(["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        ...                                   "--ffn", "128", "--seq", "32"])
        >>> build_step(args, model_config(args), fs.make_mesh({"tp": 2}, backend="abstract")).batch_spec
        P(None, None)
    """
    if bridge.wanted(args):  # --init-from a Hugging Face folder that is not a Llama: through fs.nn
        return bridge.build_step(args, cfg, mesh, check_args=check_args, optimizer=optimizer, make=TrainStep)
    model = model_module(cfg)
    specs = model.param_specs(cfg, mesh)  # ShardingError: an axis the model cannot use
    bs = model.batch_spec(mesh)
    warmup = check_args(args, mesh, cfg)
    opt = optimizer(args, warmup)
    accum = getattr(args, "grad_accum", 1)
    if accum > 1:  # the update every accum microbatches, on their mean gradient
        opt = optim.multi_steps(opt, accum)
    sspecs = opt.state_specs(specs)

    def step_fn(p: Any, s: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any, Any]:
        loss, grads = model.value_and_grad(p, tokens, targets, cfg)  # [], grads like p; pipelined on a pp axis
        p, s = opt.update(grads, s, p)
        return loss, p, s

    kw = {"mesh": mesh, "check_vma": args.check_vma}
    # params and state donated: the optimiser updates them in place (one copy of the state per step)
    step = fs.shard_map(step_fn, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs), donate=(0, 1), **kw)
    opt_init = fs.shard_map(opt.init, in_specs=(specs,), out_specs=sspecs, **kw)
    return TrainStep(step, opt_init, specs, sspecs, bs, opt)
