"""The Mixtral's loss and gradients in one call, pipelined over a ``pp`` axis by the config's schedule.

As the Llama's (:mod:`funcshard.models.llama.pipelined`): the embedding is the first stage's ``first_fn``, the
decoder layers the stages, final norm, head and loss the last stage's ``loss_fn``, run by
:func:`funcshard.pipeline.run`. The router statistics of a microbatch travel with its activation: a stage sends one
flat vector, the hidden states followed by the ``2 E + 1`` statistics of the layers so far (in the activation's
dtype: under bf16 compute the counts are rounded to bf16), and their gradient comes back with the activation's. So
the load-balancing loss is pooled over all layers per microbatch (and over the data axes), and averaged over the
microbatches, as torchtitan and Megatron do: Hugging Face's value when ``pp_microbatches=1``.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.models import mixtral
    >>> cfg = mixtral.Config.preset("debug", pp_microbatches=1)
    >>> params, tokens = mixtral.init(fs.random.key(0), cfg), torch.randint(0, 256, (2, 8))
    >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
    >>> specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    >>> f = fs.shard_map(lambda p, t, y: value_and_grad(p, t, y, cfg), mesh=mesh,
    ...                  in_specs=(specs, bs, bs), out_specs=(P(), specs))
    >>> loss, grads = f(params, tokens, tokens)
    >>> torch.allclose(fs.device_get(loss), mixtral.loss(params, tokens, tokens, cfg), atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch

from ... import lax
from ...extend import ConfigError
from ...extend import value_and_grad as _value_and_grad
from ...ops import vocab_parallel_cross_entropy
from ...pipeline import from_chunks, run, to_chunks
from ..llama.model import embed_tokens, head_logits, run_layers
from ..plan import ParallelPlan
from ..transformer import use_params
from .config import Config
from .model import balance_loss, layout, loss, no_stats

__all__ = ["value_and_grad"]

PyTree = Any


def _pack(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """One flat activation: ``x``'s elements, then the statistics (in ``x``'s dtype)."""
    return torch.cat([x.reshape(-1), stats.to(x.dtype)])  # [b, s, d], [2E+1] -> [b*s*d + 2E+1]


def _unpack(a: torch.Tensor, b: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [b, s, d], stats [2E+1] float32)`` of a flat activation."""
    n = 2 * cfg.n_experts + 1
    return a[:-n].view(b, -1, cfg.dim), a[-n:].float()


def value_and_grad(
    params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None
) -> tuple[torch.Tensor, PyTree]:
    """``(loss, grads)`` of :func:`~funcshard.models.mixtral.loss`; with a ``pp`` axis, by the pipeline schedule
    ``cfg.pp_schedule`` over ``cfg.pp_microbatches`` microbatches (the load-balancing loss pooled per microbatch,
    averaged over them).

    Args:
        params: the parameter tree (this device's blocks of ``param_specs(cfg, mesh, plan)``).
        tokens: ``[b, s]`` token ids (this device's block of ``batch_spec(mesh, plan)``).
        targets: ``[b, s]`` target ids, -100 where no loss is wanted.
        cfg: the model config.
        plan: the parallel plan, as for :func:`~funcshard.models.mixtral.forward`.

    Returns:
        The loss (invariant over every mesh axis) and the gradients, laid out as ``params``.

    Raises:
        ConfigError: the local batch is not divisible by the number of microbatches, or a schedule the model cannot
            run.

    Example:
        >>> # inside shard_map over {"pp": 2, "ep": 2}: loss, grads = mixtral.value_and_grad(p, tokens, targets, cfg)
    """
    lay = layout(cfg, plan)
    if lay.plan.pp is None or lay.schedule is None:
        return _value_and_grad(loss)(params, tokens, targets, cfg, plan)
    plan_, sched, pp = lay.plan, lay.schedule, lay.plan.pp
    m, b = sched.n_microbatches, tokens.shape[0]
    if b % m:
        raise ConfigError(
            f"mixtral.value_and_grad: the local batch of {b} sequences (the global batch over the data-parallel axes "
            f"{list(plan_.batch_axes)}) is not divisible by pp_microbatches={m}; use a global batch that is a "
            f"multiple of {m} x the data-parallel size, or set pp_microbatches to a divisor of {b}."
        )
    toks = tokens.reshape(m, b // m, *tokens.shape[1:])  # [b, s] -> [m, b/m, s]
    tgts = targets.reshape(m, b // m, *targets.shape[1:])
    count = (targets != -100).sum()
    if plan_.data_axes:
        count = lax.psum(count, plan_.data_axes)  # [] -> [], target tokens of the global batch

    def first_fn(shared: PyTree, tok: torch.Tensor) -> torch.Tensor:
        table = use_params(shared["embed"], lay.specs["embed"], plan_, cfg.precision)  # [V/tp, d/fsdp] -> [V/tp, d]
        x = embed_tokens(table, tok, lay)  # [b/m, s] -> [b/m, s, d]
        return _pack(x, no_stats(x, cfg.n_experts))

    def stage_fn(chunk: dict[str, torch.Tensor], a: torch.Tensor) -> torch.Tensor:
        x, stats = run_layers(_unpack(a, b // m, cfg), chunk, cfg, lay)  # [b/m, s, d] -> [b/m, s, d]
        return _pack(x, stats)

    def loss_fn(shared: PyTree, a: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        y, stats = _unpack(a, b // m, cfg)
        logits = head_logits(shared, y, cfg, lay)  # [b/m, s, d] -> [b/m, s, V/tp]
        total = vocab_parallel_cross_entropy(logits, tgt, axis=plan_.tp, reduction="sum")  # [] (local tokens)
        if plan_.data_axes:
            total = lax.psum(total, plan_.data_axes)  # [] -> [], over the data-parallel shards
        lm = total * m / count.to(total.dtype).clamp(min=1)  # run() takes the mean over the m microbatches
        return lm + cfg.router_aux_loss_coef * balance_loss(stats, cfg, plan_)  # this microbatch's pooled stats

    shared = {k: v for k, v in params.items() if k != "layers"}
    stage = to_chunks(params["layers"], sched, pp)  # [L/p, ...] -> [v, L/(p v), ...]
    value, grads = run(
        sched, stage_fn, stage, toks, targets=tgts, loss_fn=loss_fn, first_fn=first_fn, shared_params=shared, axis=pp
    )
    layers = from_chunks(grads.stage, sched, pp)  # [v, L/(p v), ...] -> [L/p, ...]
    return value, {k: layers if k == "layers" else grads.shared[k] for k in params}
