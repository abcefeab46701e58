"""The Llama as pure functions: ``init``, ``forward`` and ``loss`` over a parameter tree.

Called on full tensors they are the plain single-device model. Called inside ``shard_map`` over a mesh with
any of the axes ``dp``, ``fsdp``, ``tp`` (with sequence parallelism when ``cfg.sequence_parallel``), with
``in_specs=(param_specs(cfg, mesh), batch_spec(mesh), batch_spec(mesh))``, they run the sharded model:
parameters are gathered layer by layer over ``fsdp`` (ZeRO-3), replicated ones are marked varying over
``dp`` and ``cp`` (their gradients are summed), the attention and MLP are Megatron column/row-parallel over
``tp``, a ``cp`` axis splits the sequence (ring attention, RoPE at each block's positions),
logits stay vocab-parallel and the loss never gathers the vocabulary. Correct with ``check_vma`` on or off.

Seams for later: :func:`attention_fn` is the one place attention is called (context parallelism plugs in
there), and :func:`layer` is one decoder layer on its own parameters (a pipeline stage runs a slice of them).

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
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.nn.functional as F

from ... import lax
from ... import random as fsr
from ..._context import maybe_current
from ..._spec import P, shard_shape
from ...ops import (
    attention,
    column_parallel_linear,
    fsdp_gather,
    ring_attention,
    row_parallel_linear,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from .config import Config
from .sharding import param_shapes, param_specs

__all__ = ["Plan", "attention_fn", "forward", "init", "layer", "loss"]

PyTree = Any


@dataclass(frozen=True)
class Plan:
    """Which parallel styles are on: read off the mesh of the running ``shard_map`` (all off outside)."""

    tp: str | None = None
    fsdp: str | None = None
    dp: str | None = None
    cp: str | None = None
    sp: bool = False
    specs: Any = None

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the tokens are split over (batch or sequence): the loss is summed over them."""
        return tuple(a for a in (self.dp, self.fsdp, self.cp) if a)

    @property
    def replica_axes(self) -> tuple[str, ...] | None:
        """The axes the parameters are replicated over while the data varies: their gradients are summed."""
        axes = tuple(a for a in (self.dp, self.cp) if a)
        return axes or None


@functools.lru_cache(maxsize=64)
def _plan_for(cfg: Config, mesh: Any) -> Plan:
    shape = mesh.shape
    tp = "tp" if "tp" in shape else None
    return Plan(
        tp=tp,
        fsdp="fsdp" if "fsdp" in shape else None,
        dp="dp" if "dp" in shape else None,
        cp="cp" if "cp" in shape else None,
        sp=bool(tp and cfg.sequence_parallel),
        specs=param_specs(cfg, mesh),
    )


def _plan(cfg: Config) -> Plan:
    ctx = maybe_current()
    return Plan() if ctx is None else _plan_for(cfg, ctx.mesh)


def _drop_leading(spec: P) -> P:
    return P(*spec.entries[1:])


def _use(p: PyTree, specs: PyTree, plan: Plan) -> PyTree:
    """Parameters as the computation needs them: gathered over fsdp, varying over dp and cp."""
    if plan.fsdp:
        return fsdp_gather(
            p, specs, axis=plan.fsdp, replicate_axis=plan.replica_axes
        )  # [.., s/fsdp, ..] -> [.., s, ..]
    if plan.replica_axes:
        return lax.pvary(p, plan.replica_axes)  # identity forward; one bucketed psum of the gradients backward
    return p


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, theta: float, offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Rotary embedding of ``x [b, s, heads, hd]`` at positions ``offset .. offset+s-1`` (rotate-half form)."""
    s, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)  # [hd/2]
    pos = torch.arange(s, dtype=torch.float32, device=x.device) + offset  # [s]: this device's positions
    ang = pos[:, None] * inv  # [s, 1] * [hd/2] -> [s, hd/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]  # [1, s, 1, hd/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Config, plan: Plan) -> torch.Tensor:
    """Causal grouped-query attention on ``[b, heads, s, hd]``; with a ``cp`` axis the sequence is split
    in contiguous blocks over it and k/v go around the ring.

    Args:
        q: ``[b, n_heads, s, hd]`` queries (``n_heads/tp`` heads and ``s/cp`` positions inside ``shard_map``).
        k: ``[b, n_kv_heads, s, hd]`` keys (grouped-query: fewer heads than ``q``).
        v: ``[b, n_kv_heads, s, hd]`` values.
        cfg: the model config.
        plan: the parallel styles in use (:class:`Plan`; ``Plan()`` outside ``shard_map``).

    Returns:
        ``[b, n_heads, s, hd]``, the attention output.

    Example:
        >>> import torch
        >>> from funcshard.models.llama import Config
        >>> cfg = Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> q, kv = torch.randn(2, 4, 16, 16), torch.randn(2, 2, 16, 16)
        >>> attention_fn(q, kv, kv, cfg, Plan()).shape
        torch.Size([2, 4, 16, 16])
    """
    if plan.cp:
        return ring_attention(q, k, v, axis=plan.cp, causal=True, layout="contiguous")  # [b, h, s/cp, hd]
    return attention(q, k, v, causal=True)  # [b, h, s, hd] -> [b, h, s, hd]


def layer(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: Config, plan: Plan) -> torch.Tensor:
    """One decoder layer on its (gathered) parameters; ``x`` is ``[b, s, d]`` (``[b, s/tp, d]`` under SP).

    Args:
        x: ``[b, s, d]`` hidden states (``[b, s/tp, d]`` under sequence parallelism).
        p: one layer's parameters: ``params["layers"]`` indexed at the layer (gathered over ``fsdp``).
        cfg: the model config.
        plan: the parallel styles in use (:class:`Plan`; ``Plan()`` outside ``shard_map``).

    Returns:
        The layer's output, the shape of ``x``.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params = llama.init(fs.random.key(0), cfg)
        >>> p0 = {k: v[0] for k, v in params["layers"].items()}  # layer 0
        >>> layer(torch.randn(2, 16, 64), p0, cfg, Plan()).shape
        torch.Size([2, 16, 64])
    """
    hd, eps = cfg.head_dim, cfg.norm_eps
    sp = 1 if plan.sp else None
    h = _rms(x, p["attn_norm"], eps)
    if plan.tp:
        q, k, v = column_parallel_linear(h, [p["wq"], p["wk"], p["wv"]], axis=plan.tp, gather_dim=sp)
    else:
        q, k, v = (F.linear(h, p[n]) for n in ("wq", "wk", "wv"))  # [b, s, d] @ [d, heads*hd] -> [b, s, heads*hd]
    b, s = q.shape[:2]
    q, k, v = (t.unflatten(-1, (-1, hd)) for t in (q, k, v))  # -> [b, s, heads(/tp), hd]
    offset = lax.axis_index(plan.cp) * s if plan.cp else 0  # this device's first position
    q, k = _rope(q, cfg.rope_theta, offset), _rope(k, cfg.rope_theta, offset)
    o = attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cfg, plan)  # [b, h, s, hd]
    o = o.transpose(1, 2).reshape(b, s, -1)  # -> [b, s, heads(/tp)*hd]
    if plan.tp:
        x = x + row_parallel_linear(o, p["wo"], axis=plan.tp, scatter_dim=sp)  # [b, s, hd*h/tp] -> [b, s(/tp), d]
    else:
        x = x + F.linear(o, p["wo"])  # [b, s, h*hd] @ [h*hd, d] -> [b, s, d]
    h = _rms(x, p["mlp_norm"], eps)
    if plan.tp:
        gate, up = column_parallel_linear(h, [p["w1"], p["w3"]], axis=plan.tp, gather_dim=sp)  # -> [b, s, f/tp]
        x = x + row_parallel_linear(F.silu(gate) * up, p["w2"], axis=plan.tp, scatter_dim=sp)  # -> [b, s(/tp), d]
    else:
        gate, up = F.linear(h, p["w1"]), F.linear(h, p["w3"])  # [b, s, d] @ [d, f] -> [b, s, f]
        x = x + F.linear(F.silu(gate) * up, p["w2"])  # [b, s, f] @ [f, d] -> [b, s, d]
    return x


def forward(params: PyTree, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits of ``tokens [b, s]``: ``[b, s, vocab]``, or inside ``shard_map`` this device's
    ``[b/data, s, vocab/tp]`` block (vocab-parallel; feed it to :func:`loss`'s cross-entropy).

    Args:
        params: the parameter tree of :func:`init` (this device's blocks inside ``shard_map``).
        tokens: ``[b, s]`` token ids (``[b/data, s/cp]`` inside ``shard_map``).
        cfg: the model config.

    Returns:
        The logits, ``[b, s, vocab]`` (a vocab-parallel block inside ``shard_map``).

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
    plan = _plan(cfg)
    specs = plan.specs
    sp = 1 if plan.sp else None
    embed = _use(params["embed"], specs and specs["embed"], plan)
    if plan.tp:
        x = vocab_parallel_embedding(tokens, embed, axis=plan.tp, scatter_dim=sp)  # [b, s] -> [b, s(/tp), d]
    else:
        x = F.embedding(tokens, embed)  # [b, s] -> [b, s, d]
    layer_specs = specs and {k: _drop_leading(v) for k, v in specs["layers"].items()}
    stacked = {k: torch.unbind(v, 0) for k, v in params["layers"].items()}  # [n, ...] -> n x [...]
    for i in range(cfg.n_layers):
        lp = _use({k: v[i] for k, v in stacked.items()}, layer_specs, plan)
        if plan.sp:  # replicated norm weights meet sequence shards: their gradients are summed over tp
            lp = {
                **lp,
                "attn_norm": lax.pvary(lp["attn_norm"], plan.tp),
                "mlp_norm": lax.pvary(lp["mlp_norm"], plan.tp),
            }
        x = layer(x, lp, cfg, plan)
    norm = _use(params["norm"], specs and specs["norm"], plan)
    if plan.sp:
        norm = lax.pvary(norm, plan.tp)
    h = _rms(x, norm, cfg.norm_eps)
    head = embed if cfg.tie_embeddings else _use(params["head"], specs and specs["head"], plan)
    if plan.tp:
        return column_parallel_linear(h, head, axis=plan.tp, gather_dim=sp)  # [b, s(/tp), d] -> [b, s, V/tp]
    return F.linear(h, head)  # [b, s, d] @ [d, V] -> [b, s, V]


def loss(params: PyTree, tokens: torch.Tensor, targets: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Mean token cross-entropy over the whole global batch (targets of -100 are skipped); inside
    ``shard_map`` the result is invariant over every mesh axis.

    Args:
        params: the parameter tree of :func:`init` (this device's blocks inside ``shard_map``).
        tokens: ``[b, s]`` input token ids.
        targets: ``[b, s]`` target token ids, -100 where no loss is wanted.
        cfg: the model config.

    Returns:
        A 0-dim float tensor: the mean loss per target token.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params, tokens = llama.init(fs.random.key(0), cfg), torch.arange(32).reshape(2, 16)
        >>> round(loss(params, tokens, tokens.roll(-1, dims=1), cfg).item(), 1)  # about ln(256) at init
        5.6
    """
    plan = _plan(cfg)
    logits = forward(params, tokens, cfg)
    if plan.tp:
        total = vocab_parallel_cross_entropy(logits, targets, axis=plan.tp, reduction="sum")  # [] (local tokens)
    else:
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    count = (targets != -100).sum().to(total.dtype)
    if plan.data_axes:
        total, count = lax.psum((total, count), plan.data_axes)  # [] -> [], over the data-parallel shards
    return total / count.clamp(min=1)


def init(key: torch.Tensor, cfg: Config) -> PyTree:
    """Parameters drawn with ``fs.random`` from ``key``: normal(0, init_std) weights (output projections
    scaled by ``1/sqrt(2 n_layers)``), unit norms. Inside ``shard_map`` each device draws only its blocks
    of ``param_specs(cfg, mesh)``, bitwise equal to the same blocks of the unsharded init.

    Args:
        key: an ``fs.random`` key (``fs.random.key(seed)``).
        cfg: the model config.

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
    ctx = maybe_current()
    shapes = param_shapes(cfg)
    specs = param_specs(cfg, ctx.mesh) if ctx is not None else None
    paths, leaves, treedef = optree.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, torch.Size))
    flat_specs = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)) if specs else [None] * len(leaves)
    out = []
    for i, (path, shape, spec) in enumerate(zip(paths, leaves, flat_specs, strict=True)):
        name = path[-1]
        if name.endswith("norm"):
            local = shape if spec is None else shard_shape(shape, spec, ctx.mesh.shape)
            out.append(torch.ones(local))
            continue
        std = cfg.init_std / (math.sqrt(2 * cfg.n_layers) if name in ("wo", "w2") else 1.0)
        out.append(fsr.normal(fsr.fold_in(key, i), tuple(shape), spec=spec) * std)
    return optree.tree_unflatten(treedef, out)
