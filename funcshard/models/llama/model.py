"""The Llama as pure functions: ``init``, ``forward`` and ``loss`` over a parameter tree.

Called on full tensors they are the plain single-device model. Called inside ``shard_map`` with
``in_specs=(param_specs(cfg, mesh, plan), batch_spec(mesh, plan), batch_spec(mesh, plan))`` they run the
sharded model for the parallel plan (:class:`~funcshard.models.ParallelPlan`; by default each role played
by the mesh axis of its own name, ``dp``, ``fsdp``, ``tp``, ``cp``): parameters are gathered layer by layer
over ``fsdp`` (ZeRO-3), replicated ones are marked varying over ``dp`` and ``cp`` (their gradients are
summed), the attention and MLP are Megatron column/row-parallel over ``tp`` (with sequence parallelism
under ``plan.sp``), a ``cp`` axis splits the sequence (ring attention in the zigzag layout by default, the
tokens and targets moved into it and ``forward``'s logits back; RoPE at each device's positions),
logits stay vocab-parallel and the loss never gathers the vocabulary. Correct with ``check_vma`` on or off.

The model is written once: each op takes its axis from the plan, ``None`` (the role is off) meaning plain
local math, and each decoder layer is :func:`funcshard.models.transformer.transformer_block`. The plan and
the specs derived from it are computed once per (config, plan, mesh) and cached, not per call.

Attention is called in one place, :func:`funcshard.models.transformer.causal_attention` inside each block (ring
attention over ``cp``, plain local attention without it), and :func:`layer` is one decoder layer on its own
parameters (a pipeline stage runs a slice of them).

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> params = llama.init(fs.random.key(0), cfg)
    >>> tokens = torch.randint(0, 256, (2, 16))
    >>> llama.forward(params, tokens, cfg).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ... import lax
from ... import random as fsr
from ...extend import ConfigError, P, axis_index_int, is_spec, maybe_current, psum_pending, settle, shard_shape
from ...ops import column_parallel_linear, vocab_parallel_cross_entropy, vocab_parallel_embedding
from ...ops.fsdp import reshard_after_forward
from ...pipeline import Schedule
from ..plan import ParallelPlan
from ..stacked import unstack
from ..transformer import from_cp_layout, rms_norm, to_cp_layout, transformer_block, use_params
from .config import Config
from .sharding import kv_shared, model_plan, param_shapes, pipeline_schedule, specs_for

__all__ = [
    "Layout",
    "build_layout",
    "draw_params",
    "embed_tokens",
    "forward",
    "head_logits",
    "init",
    "layer",
    "layout",
    "lm_loss",
    "loss",
    "loss_on",
    "run_layers",
]

PyTree = Any


@dataclass(frozen=True)
class Layout:
    """What the model derives from a plan, once: the plan, the parameters' specs, one layer's specs, and the
    pipeline schedule (None without a ``pp`` axis).

    A model built on the Llama's (the Mixtral, :mod:`funcshard.models.mixtral`) gives its own decoder ``layer``
    (the signature of :func:`layer`), ``aux_init`` and ``aux_loss``: then the layers carry ``(x, aux)`` instead of
    ``x``, from ``(embedded x, aux_init(x))`` (a 1-dim float tensor: the router statistics of a mixture of
    experts), each layer mapping it to the next; :func:`_forward` returns ``(logits, aux)`` and :func:`loss_on`
    adds ``aux_loss(aux, plan)`` to the cross-entropy. ``None``: the Llama's layer, no carry.
    """

    plan: ParallelPlan
    specs: dict[str, Any]
    layer_specs: dict[str, P]
    mesh: Any
    schedule: Schedule | None = None
    layer: Callable[..., Any] | None = None
    aux_init: Callable[[torch.Tensor], torch.Tensor] | None = None
    aux_loss: Callable[[torch.Tensor, ParallelPlan], torch.Tensor] | None = None  # the loss's term of the aux
    experts: frozenset[str] = frozenset()  # the layer leaves of a MoE layer (``use_params(experts=...)``)


@functools.lru_cache(maxsize=64)
def _layout_on(cfg: Config, plan: ParallelPlan | None, mesh: Any) -> Layout:
    return build_layout(cfg, plan, mesh, model_plan, specs_for)


def build_layout(
    cfg: Config,
    plan: ParallelPlan | None,
    mesh: Any,
    plan_fn: Callable[[Config, Any, ParallelPlan | None], ParallelPlan],
    specs_fn: Callable[[Config, ParallelPlan, Any], dict[str, Any]],
    **model: Any,
) -> Layout:
    """The layout of a model on ``mesh`` (None: outside ``shard_map``, the unsharded model), its plan checked by
    ``plan_fn`` (``model_plan``) and its specs from ``specs_fn`` (``specs_for``); ``model``: the :class:`Layout`
    fields of a model built on the Llama's (``layer``, ``aux_init``, ``experts``)."""
    if mesh is None:  # outside shard_map: the unsharded model
        if plan is not None and plan.roles:
            raise ConfigError(
                f"{cfg.MODEL}: the plan {plan.roles} names mesh axes, but the model is called outside shard_map; call "
                f"it inside fs.shard_map over that mesh, or pass plan=None for the unsharded model."
            )
        plan = ParallelPlan()
    else:
        plan = plan_fn(cfg, mesh, plan)
    specs = specs_fn(cfg, plan, mesh)
    layer_specs = {k: P(*v.entries[1:]) for k, v in specs["layers"].items()}  # without the stacked layer dim
    schedule = pipeline_schedule(cfg, plan) if plan.pp is not None else None
    return Layout(plan, specs, layer_specs, mesh, schedule, **model)


def layout(cfg: Config, plan: ParallelPlan | None) -> Layout:
    """The (cached) layout for the running ``shard_map``'s mesh, or the unsharded one outside."""
    ctx = maybe_current()
    return _layout_on(cfg, plan, None if ctx is None else ctx.mesh)


def layer(
    x: torch.Tensor,
    p: dict[str, torch.Tensor],
    cfg: Config,
    plan: ParallelPlan,
    gather: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """One decoder layer on its (gathered) parameters; ``x`` is ``[b, s, d]`` (``[b, s/tp, d]`` under SP).

    Args:
        x: ``[b, s, d]`` hidden states (``[b, s/tp, d]`` under sequence parallelism).
        p: one layer's parameters: ``params["layers"]`` indexed at the layer (gathered over ``fsdp``).
        cfg: the model config.
        plan: the parallel plan (``ParallelPlan()`` outside ``shard_map``).

    Returns:
        The layer's output, the shape of ``x``.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard.models import ParallelPlan, llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params = llama.init(fs.random.key(0), cfg)
        >>> p0 = {k: v[0] for k, v in params["layers"].items()}  # layer 0
        >>> layer(torch.randn(2, 16, 64), p0, cfg, ParallelPlan()).shape
        torch.Size([2, 16, 64])
    """
    return transformer_block(  # SwiGLU (the default mlp)
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
    )  # [b, s(/tp), d] -> [b, s(/tp), d]


def embed_tokens(table: torch.Tensor, tokens: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The hidden states of ``tokens [b, s]``: ``[b, s(/tp), d]`` (split by sequence under SP), from the
    embedding ``table`` as :func:`~funcshard.models.transformer.use_params` gives it (``[V/tp, d]``). With a
    ``cp`` axis the tokens come in contiguous blocks and the hidden states leave in the plan's ``cp_layout``
    (zigzag by default: :func:`~funcshard.models.transformer.to_cp_layout`)."""
    plan = lay.plan
    tokens = to_cp_layout(tokens, plan)  # [b, s/cp] contiguous -> [b, s/cp] zigzag (all-gathered ids, sliced)
    return vocab_parallel_embedding(tokens, table, axis=plan.tp, scatter_dim=1 if plan.sp else None)


def run_layers(x: Any, layers: dict[str, torch.Tensor], cfg: Config, lay: Layout) -> Any:
    """The decoder layers stacked on the leading dim of ``layers``' leaves, in order, on ``x [b, s(/tp), d]``
    (on the carry ``(x, aux)`` with ``lay.aux_init``)."""
    return _run_layers(x, layers, cfg, lay)[0]


def _run_layers(
    x: Any, layers: dict[str, torch.Tensor], cfg: Config, lay: Layout
) -> tuple[Any, reshard_after_forward | None]:
    """:func:`run_layers`, and the last layer's reshard scope (None when the layers keep their weights)."""
    block = layer if lay.layer is None else lay.layer  # the Llama's decoder layer, or the model's own
    # [n, ...] -> n x [...]; the gradients stacked back into kept buffers (no fresh 52 MB per step at 13.2M
    # params), except in a pipeline stage (its microbatches' gradients are accumulated by the runtime)
    split = unstack if lay.plan.pp is None else torch.unbind
    stacked = {k: split(v) for k, v in layers.items()}
    n = len(next(iter(stacked.values())))
    reshard = cfg.reshard_after_forward and lay.plan.fsdp is not None
    if reshard and cfg.remat != "none":
        for i in range(n):  # gathered inside the layer's remat region: freed after its forward, gathered again
            p = {k: v[i] for k, v in stacked.items()}
            gather = functools.partial(
                use_params, specs=lay.layer_specs, plan=lay.plan, precision=cfg.precision, experts=lay.experts
            )
            x = block(x, p, cfg, lay.plan, gather=gather)
        return x, None

    def fetch(i: int) -> Callable[[], dict[str, torch.Tensor]]:  # layer i's gathers issued now (dist: in flight)
        p = {k: v[i] for k, v in stacked.items()}
        return use_params(p, lay.layer_specs, lay.plan, cfg.precision, prefetch=True, experts=lay.experts)

    nxt, scope = fetch(0), None
    for i in range(n):
        p = nxt()
        if i + 1 < n:  # FSDP2's prefetch: the next layer's weights travel while this layer computes
            nxt = fetch(i + 1)
        if not reshard:
            x = block(x, p, cfg, lay.plan)
            continue
        # without remat: the saved gathered weights are dropped after the forward and gathered again (the same
        # bucketed gather) for the layer's backward, the previous layer's regather prefetched meanwhile
        # (derive=False: the layer reads its weights through views only, no saved cast or concatenation of them,
        # fp32 and bf16, with or without tp: so no dispatch mode over its ~150 ops, ~40 ms a step at 13.2M params)
        with reshard_after_forward(p, functools.partial(fetch, i), after=scope, derive=False) as scope:
            x = block(x, p, cfg, lay.plan)
        p = None  # [.., s, ..] freed here: the next layer's gather is in flight
    return x, scope


def head_logits(
    params: PyTree,
    x: torch.Tensor,
    cfg: Config,
    lay: Layout,
    table: torch.Tensor | None = None,
    *,
    ready: bool = False,
) -> torch.Tensor:
    """Final norm and output head on ``x [b, s(/tp), d]``: vocab-parallel logits ``[b, s, V/tp]``. ``params``
    holds ``norm`` and ``head`` (``embed`` with tied embeddings; ``table``: that one already gathered);
    ``ready``: they are already as ``use_params`` gives them (gathered, varying over the replica axes)."""
    plan, specs = lay.plan, lay.specs
    norm = params["norm"] if ready else use_params(params["norm"], specs["norm"], plan, cfg.precision)  # [d]
    if plan.sp_axis is not None:  # a replicated weight meets sequence shards: its gradient is summed over tp
        norm = lax.pvary(norm, plan.sp_axis)
    h = rms_norm(x, norm, cfg.norm_eps)  # [b, s(/tp), d]
    name = "embed" if cfg.tie_embeddings else "head"
    if table is not None:
        head = table
    else:
        head = params[name] if ready else use_params(params[name], specs[name], plan, cfg.precision)  # [V/tp, d]
    gather = 1 if plan.sp else None
    return column_parallel_linear(h, head, axis=plan.tp, gather_dim=gather)  # [b, s(/tp), d] @ [d, V/tp]


def _stages_in_turn(params: PyTree, x: torch.Tensor, cfg: Config, lay: Layout) -> torch.Tensor:
    """The layers on a ``pp`` axis without a schedule (``forward`` / ``loss``): each stage's block of layers
    (natural order) in turn, the activation passed on with a ``ppermute``, the last stage's output summed
    over ``pp`` (the others add zeros) so every stage has it. Differentiable, with no overlap."""
    pp = lay.plan.pp
    if pp is None:
        raise ConfigError("llama: the layers run in stages only on a mesh with a pp axis.")
    p, me = lax.axis_size(pp), axis_index_int(pp)
    x = lax.pvary(x, pp)  # [b, s, d]: each stage's copy; the gradient sums the one that is used
    for r in range(p):
        if me == r:
            x = run_layers(x, params["layers"], cfg, lay)  # layers [r L/p, (r+1) L/p)
        if r + 1 < p:
            x = lax.ppermute(x, pp, [(r, r + 1)])  # [b, s, d] -> [b, s, d], to the next stage
    # x * 0, not zeros: every stage keeps its chain of ppermutes in the graph, so all make the same backward
    if me != p - 1:
        x = x * 0 if isinstance(x, torch.Tensor) else optree.tree_map(lambda t: t * 0, x)  # (a carry: (x, aux))
    return lax.psum(x, pp)  # [b, s, d] -> [b, s, d], from the last stage


def _carry(x: torch.Tensor, lay: Layout) -> Any:
    """What the layers carry from the embedded ``x``: ``x``, or ``(x, aux_init(x))`` with ``lay.aux_init``."""
    return x if lay.aux_init is None else (x, lay.aux_init(x))


def _done(logits: torch.Tensor, carry: Any, lay: Layout) -> Any:
    """``_forward``'s result: the logits, or ``(logits, aux)`` with ``lay.aux_init``."""
    return logits if lay.aux_init is None else (logits, carry[1])


def _hidden(carry: Any, lay: Layout, ordered: bool = False) -> torch.Tensor:
    """The hidden states of the layers' carry; ``ordered``: back in contiguous blocks over ``cp`` (from the plan's
    ``cp_layout``; under SP, where they are split over ``tp`` too, the logits are put back instead)."""
    h = carry if lay.aux_init is None else carry[0]
    return from_cp_layout(h, lay.plan) if ordered and not lay.plan.sp else h  # [b, s/cp, d] -> [b, s/cp, d]


def _forward(params: PyTree, tokens: torch.Tensor, cfg: Config, lay: Layout, ordered: bool = True) -> Any:
    """The logits of ``tokens``; ``(logits, aux)`` when the layout's layers carry an ``aux`` (``lay.aux_init``).
    ``ordered``: the logits in the tokens' contiguous blocks over ``cp`` (else in the plan's ``cp_layout``, the
    targets' of :func:`lm_loss`)."""
    out = _forward_in_layout(params, tokens, cfg, lay, ordered)
    if not (ordered and lay.plan.sp):
        return out
    logits, rest = (out, None) if lay.aux_init is None else out
    logits = from_cp_layout(logits, lay.plan)  # [b, s/cp, V/tp] -> [b, s/cp, V/tp] (SP: not the hidden states)
    return logits if lay.aux_init is None else (logits, rest)


def _forward_in_layout(params: PyTree, tokens: torch.Tensor, cfg: Config, lay: Layout, ordered: bool) -> Any:
    """:func:`_forward`'s body: the logits, the hidden states put back in order before the head (``ordered``)."""
    plan = lay.plan
    if plan.pp is None and plan.fsdp is None:
        # nothing to gather: embed, norm and head are only made varying over the replica axes, in ONE bucket
        # (one gradient all-reduce at the end of the backward, where the embedding's gradient is ready, as DDP's
        # last bucket) instead of one each
        names = ("embed", "norm") if cfg.tie_embeddings else ("embed", "norm", "head")
        top = use_params({k: params[k] for k in names}, {k: lay.specs[k] for k in names}, plan, cfg.precision)
        x = embed_tokens(top["embed"], tokens, lay)  # [b, s] -> [b, s(/tp), d]
        c = run_layers(_carry(x, lay), params["layers"], cfg, lay)
        tied = top["embed"] if cfg.tie_embeddings else None
        return _done(head_logits(top, _hidden(c, lay, ordered), cfg, lay, tied, ready=True), c, lay)  # [b,s,V/tp]
    table = use_params(params["embed"], lay.specs["embed"], plan, cfg.precision)  # [V/tp, d/fsdp] -> [V/tp, d]
    if plan.pp is not None:
        x = embed_tokens(table, tokens, lay)  # [b, s] -> [b, s(/tp), d]
        c = _stages_in_turn(params, _carry(x, lay), cfg, lay)
        tied = table if cfg.tie_embeddings else None
        return _done(head_logits(params, _hidden(c, lay, ordered), cfg, lay, tied), c, lay)  # -> [b, s, V/tp]
    # fsdp: the norm and the head in ONE gather, at the start beside the embedding's (not waited for after the
    # layers): one all-gather and one reduce-scatter for both, the reduce-scatter issued as soon as the head's
    # backward is done (FSDP2's root group would add the embedding, whose gradient is the backward's last: the
    # head's full-size gradient would wait in memory until the step's end, +1 MiB on bench/memory.py's keep row)
    names = ("norm",) if cfg.tie_embeddings else ("norm", "head")
    top = use_params({k: params[k] for k in names}, {k: lay.specs[k] for k in names}, plan, cfg.precision)
    x = embed_tokens(table, tokens, lay)  # [b, s] -> [b, s(/tp), d]
    c, last = _run_layers(_carry(x, lay), params["layers"], cfg, lay)
    tied = table if cfg.tie_embeddings else None
    logits = head_logits(top, _hidden(c, lay, ordered), cfg, lay, tied, ready=True)  # [b, s(/tp), d] -> [b, s, V/tp]
    # the last layer's regather issued as the backward starts: it travels during the head's backward
    return _done(logits if last is None else last.regather_at(logits), c, lay)


def forward(params: PyTree, tokens: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None) -> torch.Tensor:
    """Logits of ``tokens [b, s]``: ``[b, s, vocab]``, or inside ``shard_map`` this device's
    ``[b/data, s, vocab/tp]`` block (vocab-parallel; feed it to :func:`loss`'s cross-entropy).

    Args:
        params: the parameter tree of :func:`init` (this device's blocks inside ``shard_map``).
        tokens: ``[b, s]`` token ids (``[b/data, s/cp]`` inside ``shard_map``).
        cfg: the model config.
        plan: the parallel plan the specs were made with (:func:`~funcshard.models.plan_from_mesh`);
            ``None``: each role played by the mesh axis of its own name (or, outside ``shard_map``, none).

    Returns:
        The logits, ``[b, s, vocab]`` (a vocab-parallel block inside ``shard_map``).

    Raises:
        ShardingError, ConfigError: a plan or mesh the model cannot use (see ``llama.param_specs``).

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params, tokens = llama.init(fs.random.key(0), cfg), torch.arange(32).reshape(2, 16)
        >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
        >>> specs = llama.param_specs(cfg, mesh)
        >>> f = fs.shard_map(lambda p, t: forward(p, t, cfg), mesh=mesh,
        ...                  in_specs=(specs, llama.batch_spec(mesh)), out_specs=P(None, None, "tp"))
        >>> torch.allclose(fs.device_get(f(fs.device_put(params, mesh, specs), tokens)),
        ...                forward(params, tokens, cfg), atol=1e-5)
        True
    """
    logits = _forward(params, tokens, cfg, layout(cfg, plan))  # [b, s, V(/tp)]
    return logits if cfg.precision is None else cfg.precision.cast_to_output(logits)


def loss(
    params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None
) -> torch.Tensor:
    """Mean token cross-entropy over the whole global batch (targets of -100 are skipped); inside
    ``shard_map`` the result is invariant over every mesh axis.

    Args:
        params: the parameter tree of :func:`init` (this device's blocks inside ``shard_map``).
        tokens: ``[b, s]`` input token ids.
        targets: ``[b, s]`` target token ids, -100 where no loss is wanted.
        cfg: the model config.
        plan: the parallel plan, as for :func:`forward`.

    Returns:
        A 0-dim float tensor: the mean loss per target token.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params, tokens = llama.init(fs.random.key(0), cfg), torch.arange(32).reshape(2, 16)
        >>> value = loss(params, tokens, tokens.roll(-1, dims=1), cfg).item()
        >>> abs(value - 5.545) < 0.2  # about ln(256) = 5.545 at init
        True
    """
    return loss_on(params, tokens, targets, cfg, layout(cfg, plan))


def loss_on(params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, lay: Layout) -> torch.Tensor:
    """:func:`loss` on a layout: the mean cross-entropy, plus ``lay.aux_loss`` of the layers' aux when the layout
    has one (the Mixtral's load-balancing loss)."""
    mean, aux = lm_loss(params, tokens, targets, cfg, lay)
    return mean if lay.aux_loss is None else mean + lay.aux_loss(aux, lay.plan)


def lm_loss(params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config, lay: Layout) -> tuple[Any, Any]:
    """:func:`loss` on a layout: ``(mean cross-entropy, aux)``, ``aux`` what the layers carry besides the hidden
    states (``lay.aux_init``; None for the Llama)."""
    data = lay.plan.data_axes
    targets = to_cp_layout(targets, lay.plan)  # [b, s/cp]: in the layout the logits come in (zigzag: permuted)
    count = (targets != -100).sum().to(torch.float32)  # [] (local tokens; the cross-entropy is float32)
    if data:  # the global count depends on the targets only: summed while the forward computes (dist)
        count = psum_pending(count, data)  # [] -> [], over the data-parallel shards
    out = _forward(params, tokens, cfg, lay, ordered=False)  # [b, s(/cp), V/tp] in cp_layout (and the layers' aux)
    logits, aux = (out, None) if lay.aux_init is None else out
    total = vocab_parallel_cross_entropy(logits, targets, axis=lay.plan.tp, reduction="sum")  # [] (local tokens)
    if data:  # the pending count waited for here, with no dispatch through it
        count = settle(count)
    mean = total / count.clamp(min=1)  # [] (this shard's part of the global mean)
    if data:  # read only after the backward (fs.value_and_grad): no wait for the other shards in the forward
        mean = psum_pending(mean, data)  # [] -> [], over the data-parallel shards
    return mean, aux


def init(key: torch.Tensor, cfg: Config, plan: ParallelPlan | None = None) -> PyTree:
    """Parameters drawn with ``fs.random`` from ``key``: normal(0, init_std) weights (output projections
    scaled by ``1/sqrt(2 n_layers)``), unit norms. Inside ``shard_map`` each device draws only its blocks
    of ``param_specs(cfg, mesh, plan)``, bitwise equal to the same blocks of the unsharded init.

    Args:
        key: an ``fs.random`` key (``fs.random.key(seed)``).
        cfg: the model config.
        plan: the parallel plan, as for :func:`forward`.

    Returns:
        The parameter tree, shaped as ``param_shapes(cfg)`` (local blocks inside ``shard_map``).

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params = init(fs.random.key(0), cfg)
        >>> params["layers"]["wq"].shape  # [n_layers, n_heads * head_dim, dim]
        torch.Size([2, 64, 64])
        >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
        >>> sharded = fs.shard_map(lambda k: init(k, cfg), mesh=mesh, in_specs=(P(),),
        ...                        out_specs=llama.param_specs(cfg, mesh))(fs.random.key(0))
        >>> torch.equal(fs.device_get(sharded)["layers"]["wq"], params["layers"]["wq"])
        True
    """
    return draw_params(key, cfg, param_shapes(cfg), layout(cfg, plan))


def _local_shape(shape: torch.Size, spec: P, lay: Layout) -> tuple[int, ...]:
    """This device's block of ``shape`` laid out by ``spec`` inside ``shard_map``: ``torch.tensor_split``'s block
    where an axis does not divide its dim (a layer stack on ``pp``), read from the device's index over that axis."""
    mesh = lay.mesh.shape
    dims = zip(shape, spec.dim_axes(len(shape)))
    uneven = [a for s, axes in dims if s % math.prod(mesh[a] for a in axes) for a in axes]
    ctx = maybe_current()
    if not uneven or ctx is None:
        return shard_shape(shape, spec, mesh)
    coords = {a: ctx.device.index((a,)) if a in uneven else 0 for a in spec.axes}  # (abstract: noted as read)
    return shard_shape(shape, spec, mesh, coords)  # an even dim's block has one size whatever the index


def draw_params(key: torch.Tensor, cfg: Config, shapes: PyTree, lay: Layout) -> PyTree:
    """:func:`init`'s draw of a parameter tree of ``shapes`` (``torch.Size`` leaves) laid out by ``lay``: norms
    (leaves named ``*norm``) ones, the rest normal(0, ``init_std``), ``wo`` and ``w2`` scaled by
    ``1/sqrt(2 n_layers)``, leaf ``i`` from ``fold_in(key, i)``; this device's blocks inside ``shard_map``."""
    paths, leaves, treedef = optree.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, torch.Size))
    sharded = lay.mesh is not None
    dtype = torch.float32 if cfg.precision is None else cfg.precision.param_dtype
    flat_specs = optree.tree_leaves(lay.specs, is_leaf=is_spec) if sharded else [None] * len(leaves)
    out = []
    for i, (path, shape, spec) in enumerate(zip(paths, leaves, flat_specs, strict=True)):
        name = path[-1]
        if name.endswith("norm"):
            out.append(torch.ones(_local_shape(shape, spec, lay) if sharded else shape, dtype=dtype))
            continue
        std = cfg.init_std / (math.sqrt(2 * cfg.n_layers) if name in ("wo", "w2") else 1.0)
        # drawn in float32 (the stream of the unsharded init), then kept in the parameters' dtype
        out.append((fsr.normal(fsr.fold_in(key, i), tuple(shape), spec=spec) * std).to(dtype))
    return optree.tree_unflatten(treedef, out)
