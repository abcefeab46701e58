"""The Llama's loss and gradients in one call, pipelined over a ``pp`` axis by the config's schedule.

On a mesh with a ``pp`` axis the local batch is cut into ``cfg.pp_microbatches`` microbatches and run by
:func:`funcshard.pipeline.run` with ``cfg.pp_schedule``: the embedding is the first stage's ``first_fn``,
the decoder layers are the stages (this stage's ``torch.tensor_split`` block of the layers, moved to the
schedule's chunks by :func:`funcshard.pipeline.to_chunks`: the virtual stages split the layers as
``torch.tensor_split`` does, earlier ones one layer more, any layer count from ``pp`` up), and the final
norm, head and cross-entropy are the last stage's ``loss_fn``. Embedding, norm and head are replicated over
``pp``; their gradients (zero on the stages that do not use them) are summed over ``pp``, so tied embeddings
get the embedding's and the head's parts. dp, fsdp, tp (+SP) and cp work inside every stage as in
:func:`~funcshard.models.llama.loss`. Without a ``pp`` axis this is ``fs.value_and_grad(llama.loss)``.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    >>> params, tokens = llama.init(fs.random.key(0), cfg), torch.randint(0, 64, (4, 8))
    >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
    >>> specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    >>> f = fs.shard_map(lambda p, t, y: value_and_grad(p, t, y, cfg), mesh=mesh,
    ...                  in_specs=(specs, bs, bs), out_specs=(P(), specs))
    >>> loss, grads = f(params, tokens, tokens)
    >>> ref = llama.loss(params, tokens, tokens, cfg)
    >>> torch.allclose(fs.device_get(loss), ref), grads["layers"]["wq"].spec
    (True, P('pp', None, None))
"""

from __future__ import annotations

from typing import Any

import torch

from ... import lax
from ...extend import ConfigError, axis_index_int, split_sizes
from ...extend import value_and_grad as _value_and_grad
from ...ops import vocab_parallel_cross_entropy
from ...pipeline import from_chunks, run, to_chunks
from ..plan import ParallelPlan
from ..transformer import to_cp_layout, use_params
from .config import Config
from .model import Layout, embed_tokens, head_logits, layout, loss, run_layers

__all__ = ["pipelined", "value_and_grad"]

PyTree = Any


def value_and_grad(
    params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None
) -> tuple[torch.Tensor, PyTree]:
    """``(loss, grads)`` of :func:`~funcshard.models.llama.loss`; with a ``pp`` axis, by the pipeline schedule
    ``cfg.pp_schedule`` over ``cfg.pp_microbatches`` microbatches of the local batch.

    Args:
        params: the parameter tree (this device's blocks of ``param_specs(cfg, mesh, plan)``).
        tokens: ``[b, s]`` token ids (this device's block of ``batch_spec(mesh, plan)``).
        targets: ``[b, s]`` target ids, -100 where no loss is wanted.
        cfg: the model config.
        plan: the parallel plan, as for :func:`~funcshard.models.llama.forward`.

    Returns:
        The mean loss (invariant over every mesh axis) and the gradients, laid out as ``params``.

    Raises:
        ConfigError: the local batch is not divisible by the number of microbatches, or a schedule the
            model cannot run (see ``llama.sharding.pipeline_schedule``).

    Example:
        >>> # inside shard_map over {"pp": 2, "dp": 2}: loss, grads = llama.value_and_grad(p, tokens, targets, cfg)
    """
    lay = layout(cfg, plan)
    if lay.plan.pp is None or lay.schedule is None:
        return _value_and_grad(loss)(params, tokens, targets, cfg, plan)
    return pipelined(params, tokens, targets, cfg, lay)


def _pack(x: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """The activation between stages: ``x``, or with an aux one flat vector, ``x``'s elements then the aux's (in
    ``x``'s dtype)."""
    return x if aux is None else torch.cat([x.reshape(-1), aux.to(x.dtype)])  # -> [b*s*d + n]


def pipelined(
    params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, lay: Layout
) -> tuple[torch.Tensor, PyTree]:
    """:func:`value_and_grad` on a layout with a ``pp`` axis: the schedule run by :func:`funcshard.pipeline.run`.
    With the layout's aux (the Mixtral's router statistics), a stage sends one flat vector, the hidden states
    followed by the aux of the layers so far (in the activation's dtype), whose gradient comes back with the
    activation's; the last stage adds ``lay.aux_loss`` of its microbatch's aux, so that term is averaged over the
    microbatches."""
    plan_, sched, pp = lay.plan, lay.schedule, lay.plan.pp
    m, b = sched.n_microbatches, tokens.shape[0]
    if b % m:
        raise ConfigError(
            f"{cfg.MODEL}.value_and_grad: the local batch of {b} sequences (the global batch over the data-parallel "
            f"axes {list(plan_.batch_axes)}) is not divisible by pp_microbatches={m}; use a global batch that "
            f"is a multiple of {m} x the data-parallel size, or set pp_microbatches to a divisor of {b}."
        )
    targets = to_cp_layout(targets, plan_)  # [b, s/cp]: the layout embed_tokens gives the tokens (zigzag: permuted)
    toks = tokens.reshape(m, b // m, *tokens.shape[1:])  # [b, s] -> [m, b/m, s]
    tgts = targets.reshape(m, b // m, *targets.shape[1:])
    count = (targets != -100).sum()
    if plan_.data_axes:
        count = lax.psum(count, plan_.data_axes)  # [] -> [], target tokens of the global batch
    like = None if lay.aux_init is None else lay.aux_init(tokens)  # [n]: the aux's size and dtype
    seq = tokens.shape[1]  # the hidden states' local length: s/cp, split again over tp under SP (tensor_split's)
    if plan_.sp_axis is not None:
        seq = split_sizes(seq, lax.axis_size(plan_.sp_axis))[axis_index_int(plan_.sp_axis)]  # tensor_split's

    def unpack(a: torch.Tensor) -> Any:  # the carry of the flat activation
        if like is None:
            return a
        n = like.numel()
        return a[:-n].view(b // m, seq, cfg.dim), a[-n:].to(like.dtype)  # [b/m, s(/tp), d] (b/m may be 0), [n]

    def first_fn(shared: PyTree, tok: torch.Tensor) -> torch.Tensor:
        table = use_params(shared["embed"], lay.specs["embed"], plan_, cfg.precision)  # [V/tp, d/fsdp] -> [V/tp, d]
        x = embed_tokens(table, tok, lay)  # [b/m, s] -> [b/m, s(/tp), d]
        return _pack(x, None if like is None else torch.zeros_like(like))

    def stage_fn(chunk: dict[str, torch.Tensor], a: torch.Tensor) -> torch.Tensor:
        c = run_layers(unpack(a), chunk, cfg, lay)  # [b/m, s(/tp), d] -> [b/m, s(/tp), d]
        return c if like is None else _pack(*c)

    def loss_fn(shared: PyTree, a: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        y, aux = (a, None) if like is None else unpack(a)
        logits = head_logits(shared, y, cfg, lay)  # [b/m, s(/tp), d] -> [b/m, s, V/tp]
        total = vocab_parallel_cross_entropy(logits, tgt, axis=plan_.tp, reduction="sum")  # [] (local tokens)
        if plan_.data_axes:
            total = lax.psum(total, plan_.data_axes)  # [] -> [], over the data-parallel shards
        lm = total * m / count.to(total.dtype).clamp(min=1)  # run() takes the mean over the m microbatches
        return lm if lay.aux_loss is None else lm + lay.aux_loss(aux, plan_)  # this microbatch's aux term

    shared = {k: v for k, v in params.items() if k != "layers"}
    n = cfg.n_layers
    stage = to_chunks(params["layers"], sched, pp, n_layers=n)  # [L/p, ...] -> [this stage's chunks' layers, ...]
    value, grads = run(
        sched,
        stage_fn,
        stage,
        toks,
        targets=tgts,
        loss_fn=loss_fn,
        first_fn=first_fn,
        shared_params=shared,
        axis=pp,
        n_layers=n,
    )
    layers = from_chunks(grads.stage, sched, pp, n_layers=n)  # [chunks' layers, ...] -> [L/p, ...]
    return value, {k: layers if k == "layers" else grads.shared[k] for k in params}
