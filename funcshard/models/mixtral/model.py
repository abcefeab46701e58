"""The Mixtral as pure functions: ``init``, ``forward`` and ``loss`` over a parameter tree.

The Llama's model (:mod:`funcshard.models.llama.model`: embedding, stacked layers with FSDP's gathers and
prefetch, head, stages in turn on a ``pp`` axis) with each layer's MLP replaced by a sparse mixture of experts:
:func:`funcshard.models.transformer.transformer_block` with ``ffn=`` :func:`moe` (:func:`funcshard.ops.moe.moe_ffn`:
top-k routing, the tokens sent to their experts over ``ep`` by a ragged all-to-all and back, each expert's hidden dim
split over ``tp``). Each layer also returns its router statistics (:func:`funcshard.ops.moe.router_stats`): the
layers carry ``(x, stats)``, ``stats`` a ``[2 E + 1]`` float32 vector (assignments per expert, router probabilities
summed per expert, rows), summed over the layers; :func:`loss` pools them over the data axes (the whole global
batch, ``ep`` included) and adds ``router_aux_loss_coef`` times the load-balancing loss to the language-model loss,
Hugging Face's ``MixtralForCausalLM(..., output_router_logits=True).loss``.

Called on full tensors they are the plain single-device model; inside ``shard_map`` with
``in_specs=(param_specs(cfg, mesh, plan), batch_spec(mesh, plan), batch_spec(mesh, plan))`` the sharded model, as
the Llama's, with an ``ep`` axis as well.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard.models import mixtral
    >>> cfg = mixtral.Config.preset("debug")
    >>> params = mixtral.init(fs.random.key(0), cfg)
    >>> tokens = torch.randint(0, 256, (2, 16))
    >>> mixtral.forward(params, tokens, cfg).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ... import lax
from ...extend import maybe_current
from ...extend import value_and_grad as fs_value_and_grad
from ...ops.moe import balancing_loss_from_stats, moe_ffn, router_stats
from ..llama import model as llama_model
from ..llama.pipelined import pipelined
from ..llama.sharding import kv_shared
from ..plan import ParallelPlan
from ..transformer import transformer_block
from .config import Config
from .sharding import EXPERTS, model_plan, param_shapes, specs_for

__all__ = [
    "balance_loss",
    "forward",
    "init",
    "layer",
    "layout",
    "loss",
    "moe",
    "no_stats",
    "unpack_stats",
    "value_and_grad",
]

PyTree = Any


def no_stats(x: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The router statistics before the first layer: ``[2 E + 1]`` float32 zeros on ``x``'s device.

    Example:
        >>> no_stats(torch.zeros(2, 3), 4).shape
        torch.Size([9])
    """
    return torch.zeros(2 * n_experts + 1, dtype=torch.float32, device=x.device)


def unpack_stats(stats: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts [E], prob_sums [E], n_rows [])`` of a ``[2 E + 1]`` statistics vector.

    Example:
        >>> [t.tolist() for t in unpack_stats(torch.arange(5.0), 2)]
        [[0.0, 1.0], [2.0, 3.0], 4.0]
    """
    e = n_experts
    return stats[:e], stats[e : 2 * e], stats[2 * e]


def moe(h: torch.Tensor, p: dict[str, torch.Tensor], plan: ParallelPlan, *, cfg: Config) -> tuple[Any, Any]:
    """The mixture of experts on the normed hidden states ``h [b, s, d]`` (a ``transformer_block`` feed-forward):
    ``(y [b, s, d], stats [2 E + 1])``.

    The experts are split over ``plan.ep`` (``p["w1"]`` holds ``E / ep`` of them) and their hidden dim over
    ``plan.tp``; the router ``p["router"] [E, d]`` is replicated. ``stats`` are this device's router statistics
    (varying over ``tp``, where the routing runs on every ``tp`` device: :func:`balance_loss` takes their mean).

    Example:
        >>> import funcshard as fs
        >>> cfg = Config.preset("debug")
        >>> p = {k: v[0] for k, v in init(fs.random.key(0), cfg)["layers"].items()}  # layer 0
        >>> y, stats = moe(torch.randn(2, 8, 64), p, ParallelPlan(), cfg=cfg)
        >>> y.shape, stats[-1].item()  # 16 tokens routed
        (torch.Size([2, 8, 64]), 16.0)
    """
    experts = {k: p[k] for k in ("router", "w1", "w3", "w2")}
    k = cfg.experts_per_token
    y, aux = moe_ffn(h, experts, k, axis=plan.ep, tp=plan.tp, norm_topk=cfg.norm_topk_prob, return_router=True)
    st = router_stats(aux.router_logits, aux.expert_ids, cfg.n_experts)  # [E], [E], []
    return y, torch.cat([st.counts, st.prob_sums, st.n_rows.reshape(1)])  # [2 E + 1]


def layer(
    carry: tuple[torch.Tensor, torch.Tensor],
    p: dict[str, torch.Tensor],
    cfg: Config,
    plan: ParallelPlan,
    gather: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on ``carry = (x [b, s, d], stats [2 E + 1])``: attention and the mixture of experts; the
    layer's router statistics added to ``stats``.

    Args:
        carry: the hidden states and the statistics of the layers before.
        p: one layer's parameters (``params["layers"]`` at the layer; gathered over ``fsdp``, or by ``gather``).
        cfg: the model config.
        plan: the parallel plan (``ParallelPlan()`` outside ``shard_map``).
        gather: FSDP's reshard-after-forward under remat (``transformer_block(gather=...)``).

    Returns:
        ``(x, stats)`` after the layer.

    Example:
        >>> import funcshard as fs
        >>> cfg = Config.preset("debug")
        >>> p = {k: v[0] for k, v in init(fs.random.key(0), cfg)["layers"].items()}
        >>> x, stats = layer((torch.randn(2, 8, 64), no_stats(torch.zeros(1), 4)), p, cfg, ParallelPlan())
        >>> x.shape, stats[:4].sum().item()  # 16 tokens x top-2
        (torch.Size([2, 8, 64]), 32.0)
    """
    x, stats = carry
    x, st = transformer_block(
        x,
        p,
        plan,
        head_dim=cfg.head_dim,
        norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        remat=cfg.remat,
        gather=gather,
        kv_shared=kv_shared(cfg, plan),
        ffn=functools.partial(moe, cfg=cfg),
    )  # [b, s, d] -> [b, s, d], [2 E + 1]
    return x, stats + st


@functools.lru_cache(maxsize=64)
def _layout_on(cfg: Config, plan: ParallelPlan | None, mesh: Any) -> llama_model.Layout:
    aux_init = functools.partial(no_stats, n_experts=cfg.n_experts)
    aux_loss = functools.partial(_aux_term, cfg=cfg)
    model = {"layer": layer, "aux_init": aux_init, "aux_loss": aux_loss, "experts": EXPERTS}
    return llama_model.build_layout(cfg, plan, mesh, model_plan, specs_for, **model)


def _aux_term(stats: torch.Tensor, plan: ParallelPlan, *, cfg: Config) -> torch.Tensor:
    """The loss's load-balancing term: ``router_aux_loss_coef`` x :func:`balance_loss`."""
    return cfg.router_aux_loss_coef * balance_loss(stats, cfg, plan)


def layout(cfg: Config, plan: ParallelPlan | None) -> llama_model.Layout:
    """The (cached) layout of the Mixtral for the running ``shard_map``'s mesh, or the unsharded one outside: the
    Llama's :class:`~funcshard.models.llama.model.Layout` with the Mixtral's layer and statistics."""
    ctx = maybe_current()
    return _layout_on(cfg, plan, None if ctx is None else ctx.mesh)


def balance_loss(stats: torch.Tensor, cfg: Config, plan: ParallelPlan) -> torch.Tensor:
    """The load-balancing loss of this device's router statistics ``stats [2 E + 1]`` (summed over its layers),
    pooled over the data axes (``dp``, ``fsdp``, ``ep``, ``cp``: the whole global batch) and averaged over ``tp``
    (each ``tp`` device routes the same tokens): Hugging Face's ``load_balancing_loss_func`` over every layer.

    Example:
        >>> counts, probs = torch.tensor([4.0, 4.0, 4.0, 4.0]), torch.tensor([2.0, 2.0, 2.0, 2.0])
        >>> balance_loss(torch.cat([counts, probs, torch.tensor([8.0])]), Config.preset("debug"), ParallelPlan())
        tensor(2.)
    """
    if plan.tp is not None:
        stats = lax.pmean(stats, plan.tp)  # [2E+1] -> [2E+1]: the same on every tp device
    if plan.data_axes:
        stats = lax.psum(stats, plan.data_axes)  # [2E+1] -> [2E+1], over the global batch
    return balancing_loss_from_stats(*unpack_stats(stats, cfg.n_experts), cfg.n_experts)


def forward(params: PyTree, tokens: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None) -> torch.Tensor:
    """Logits of ``tokens [b, s]``: ``[b, s, vocab]``, or inside ``shard_map`` this device's
    ``[b/data, s, vocab/tp]`` block (vocab-parallel), as :func:`funcshard.models.llama.forward`.

    Args:
        params: the parameter tree of :func:`init` (this device's blocks inside ``shard_map``).
        tokens: ``[b, s]`` token ids (``[b/data, s/cp]`` inside ``shard_map``).
        cfg: the model config.
        plan: the parallel plan the specs were made with; ``None``: each role played by the mesh axis of its own
            name (or, outside ``shard_map``, none).

    Returns:
        The logits.

    Example:
        >>> import funcshard as fs
        >>> from funcshard import P
        >>> cfg = Config.preset("debug")
        >>> params, tokens = init(fs.random.key(0), cfg), torch.randint(0, 256, (4, 8))
        >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
        >>> from funcshard.models.mixtral import batch_spec, param_specs
        >>> f = fs.shard_map(lambda p, t: forward(p, t, cfg), mesh=mesh,
        ...                  in_specs=(param_specs(cfg, mesh), batch_spec(mesh)), out_specs=P(None, None, "tp"))
        >>> torch.allclose(fs.device_get(f(params, tokens)), forward(params, tokens, cfg), atol=1e-5)
        True
    """
    logits, _ = llama_model._forward(params, tokens, cfg, layout(cfg, plan))  # [b, s, V(/tp)], stats
    return logits if cfg.precision is None else cfg.precision.cast_to_output(logits)


def loss(
    params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None
) -> torch.Tensor:
    """The mean token cross-entropy over the whole global batch (targets of -100 skipped) plus
    ``cfg.router_aux_loss_coef`` times the load-balancing loss of every layer's router over every token of the
    global batch: Hugging Face's ``MixtralForCausalLM(tokens, labels=..., output_router_logits=True).loss``.
    Invariant over every mesh axis inside ``shard_map``.

    Args:
        params: the parameter tree of :func:`init` (this device's blocks inside ``shard_map``).
        tokens: ``[b, s]`` input token ids.
        targets: ``[b, s]`` target token ids, -100 where no loss is wanted.
        cfg: the model config.
        plan: the parallel plan, as for :func:`forward`.

    Returns:
        A 0-dim float tensor.

    Example:
        >>> import funcshard as fs
        >>> cfg = Config.preset("debug")
        >>> params, tokens = init(fs.random.key(0), cfg), torch.randint(0, 256, (2, 16))
        >>> value = loss(params, tokens, tokens.roll(-1, dims=1), cfg).item()
        >>> abs(value - 5.545 - 0.02 * 2) < 0.2  # about ln(256) + coef x k at init
        True
    """
    return llama_model.loss_on(params, tokens, targets, cfg, layout(cfg, plan))  # [] + coef x the stats' loss


def value_and_grad(
    params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None
) -> tuple[torch.Tensor, PyTree]:
    """``(loss, grads)`` of :func:`loss`; with a ``pp`` axis, by the pipeline schedule ``cfg.pp_schedule`` over
    ``cfg.pp_microbatches`` microbatches (:func:`funcshard.models.llama.pipelined.pipelined`): the router
    statistics of a microbatch travel with its activation from stage to stage (in the activation's dtype: under
    bf16 compute the counts are rounded to bf16), so the load-balancing loss is pooled over all layers per
    microbatch and averaged over the microbatches, as torchtitan and Megatron do, which is Hugging Face's value
    when ``pp_microbatches=1``.

    Args:
        params: the parameter tree (this device's blocks of ``param_specs(cfg, mesh, plan)``).
        tokens: ``[b, s]`` token ids (this device's block of ``batch_spec(mesh, plan)``).
        targets: ``[b, s]`` target ids, -100 where no loss is wanted.
        cfg: the model config.
        plan: the parallel plan, as for :func:`forward`.

    Returns:
        The loss (invariant over every mesh axis) and the gradients, laid out as ``params``.

    Raises:
        ConfigError: the local batch is not divisible by the number of microbatches, or a schedule the model cannot
            run.

    Example:
        >>> import funcshard as fs
        >>> from funcshard import P
        >>> from funcshard.models.mixtral import batch_spec, param_specs
        >>> cfg = Config.preset("debug", pp_microbatches=1)
        >>> params, tokens = init(fs.random.key(0), cfg), torch.randint(0, 256, (2, 8))
        >>> mesh = fs.make_mesh({"pp": 2, "ep": 2}, backend="sim")
        >>> specs, bs = param_specs(cfg, mesh), batch_spec(mesh)
        >>> f = fs.shard_map(lambda p, t, y: value_and_grad(p, t, y, cfg), mesh=mesh,
        ...                  in_specs=(specs, bs, bs), out_specs=(P(), specs))
        >>> value, grads = f(params, tokens, tokens)
        >>> torch.allclose(fs.device_get(value), loss(params, tokens, tokens, cfg), atol=1e-5)
        True
    """
    lay = layout(cfg, plan)
    if lay.plan.pp is None or lay.schedule is None:
        return fs_value_and_grad(loss)(params, tokens, targets, cfg, plan)
    return pipelined(params, tokens, targets, cfg, lay)


def init(key: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None) -> PyTree:
    """Parameters drawn with ``fs.random`` from ``key``, as :func:`funcshard.models.llama.init` draws them
    (normal(0, ``init_std``), ``wo`` and ``w2`` scaled by ``1/sqrt(2 n_layers)``, unit norms); inside
    ``shard_map`` each device draws only its blocks, bitwise equal to the same blocks of the unsharded init.

    Args:
        key: an ``fs.random`` key.
        cfg: the model config.
        plan: the parallel plan, as for :func:`forward`.

    Returns:
        The parameter tree, shaped as ``param_shapes(cfg)``.

    Example:
        >>> import funcshard as fs
        >>> params = init(fs.random.key(0), Config.preset("debug"))
        >>> params["layers"]["w1"].shape  # [n_layers, n_experts, ffn_dim, dim]
        torch.Size([2, 4, 128, 64])
    """
    return llama_model.draw_params(key, cfg, param_shapes(cfg), layout(cfg, plan))
