"""Autoregressive decoding with a KV cache, for any decoder-only model (model-agnostic).

A model hands :func:`decode` a :class:`Decoder`: its embedding, one step function per layer and its head, each
already holding its (gathered) weights. :func:`decode` owns the rest: the left-padded batch, the preallocated
cache ``[layers, batch, kv_heads(/tp), max_len, head_dim]`` in the compute dtype, the positions, the prefill,
then one token per step, sampling (:mod:`funcshard.models.sampling`) and stop tokens. A layer's step is
usually ``x + attention_step(norm(x), ...)`` then the model's own feed-forward (SwiGLU for the Llama, the MoE
layer for Mixtral).

Prompts of different lengths share one batch, left-padded as Hugging Face pads for generation: row ``r`` holds
``S - len_r`` pad ids, then its prompt, so every row's next token sits at the same cache slot. The pads are
masked out as keys, and RoPE positions count from each row's first real token (slot ``j`` of row ``r`` is at
position ``j - pad_r``), so a padded row computes what it would alone. Inside ``shard_map`` the cache holds this
device's kv heads (``tp``) and rows (``dp``); the loop runs once per call, not a ``shard_map`` per token.

Example:
    >>> tokens, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    >>> tokens.tolist(), mask.tolist()
    ([[5, 6, 7], [0, 0, 8]], [[True, True, True], [False, False, True]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..extend import ConfigError, one_op
from ..ops import column_parallel_linear, row_parallel_linear
from .plan import ParallelPlan
from .rope_scaling import RopeScaling
from .sampling import SamplingOptions, next_token
from .transformer import rms_norm

__all__ = [
    "Decoder",
    "KVCache",
    "LayerKV",
    "Position",
    "attention_step",
    "block_step",
    "check_prompts",
    "decode",
    "init_cache",
    "left_pad",
]


class KVCache(NamedTuple):
    """The keys and values of every layer: ``k`` and ``v``, each ``[layers, batch, kv_heads, max_len, head_dim]``
    (this device's rows and kv heads inside ``shard_map``). A pytree (a named tuple)."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class LayerKV:
    """One layer's views of the cache, ``[batch, kv_heads, max_len, head_dim]`` each, written in place."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class Position:
    """Where a step's ``s`` tokens go: cache slots ``[slot, slot + s)``, their RoPE angles ``cos`` / ``sin``
    (``[b, s, 1, head_dim/2]`` float32, each row at its own positions) and the keys each query may see,
    ``mask [b, 1, s, slot + s]`` (bool)."""

    slot: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor


#: one layer's step: ``(x [b, s, d], its cache, where) -> [b, s, d]``
LayerStep = Callable[[torch.Tensor, LayerKV, Position], torch.Tensor]


@dataclass(frozen=True)
class Decoder:
    """What a model supplies to :func:`decode`, weights already bound (gathered over ``fsdp``).

    Attributes:
        embed: ``ids [b, s] -> [b, s, d]`` (vocab-parallel over ``axis``).
        layers: one step function per layer (:data:`LayerStep`).
        head: ``x [b, d] -> logits [b, V]`` (``[b, V/tp]`` vocab-parallel).
        vocab: the full vocabulary size.
        kv_heads: this device's kv heads (``n_kv_heads / tp``; 1 where tp exceeds ``n_kv_heads``: the kv heads
            replicated, each device caching the one its query heads group with).
        head_dim: the attention head size.
        dtype: the compute dtype (the cache's).
        rope_theta: the RoPE base.
        rope_scaling: Llama 3.1's RoPE scaling, or None.
        axis: the mesh axis the vocabulary and heads are split over (``tp``), or None.
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    layers: Sequence[LayerStep]
    head: Callable[[torch.Tensor], torch.Tensor]
    vocab: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    axis: str | None = None


def init_cache(
    n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> KVCache:
    """A zeroed cache ``[n_layers, batch, kv_heads, max_len, head_dim]`` (keys and values).

    Example:
        >>> init_cache(2, 3, 4, 16, 8).k.shape
        torch.Size([2, 3, 4, 16, 8])
    """
    shape = (n_layers, batch, kv_heads, max_len, head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)``, each ``[b, width]``: the prompts right-aligned after ``pad_id``s; ``mask`` is True at
    the prompts' tokens. ``width``: default the longest prompt.

    Example:
        >>> left_pad([[1, 2]], pad_id=9, width=3)[0]
        tensor([[9, 1, 2]])
    """
    width = max((len(p) for p in prompts), default=0) if width is None else width
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for r, p in enumerate(prompts):
        if len(p):
            tokens[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = True
    return tokens, mask


def _rope_table(n: int, hd: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos`` / ``sin`` at positions ``0 .. n-1``: ``[n, hd/2]`` float32 each (the values
    :func:`funcshard.models.transformer.rope` computes)."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd/2]
    if scaling is not None:
        inv = scaling.inv_freq(inv)  # [hd/2]
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv  # [n, 1] * [hd/2] -> [n, hd/2]
    return ang.cos(), ang.sin()


@one_op  # plain local math: one dispatch through the vma mode
def rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [b, s, heads, hd]`` with per-row angles ``cos`` / ``sin [b, s, 1, hd/2]``
    (rotate-half form, in float32 at least, as :func:`funcshard.models.transformer.rope`).

    Example:
        >>> x = torch.randn(1, 2, 3, 4)
        >>> torch.equal(rope_at(x, torch.ones(1, 2, 1, 2), torch.zeros(1, 2, 1, 2)), x)  # angle 0
        True
    """
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@one_op  # local math; the cache and the mask ride in objects the vma mode does not look into (written in place)
def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, at: Position) -> torch.Tensor:
    """Write ``k`` / ``v [b, kvh, s, hd]`` at the slots of ``at``, then attend ``q [b, h, s, hd]`` to the cache's
    first ``slot + s`` keys under ``at.mask``: ``[b, h, s, hd]``."""
    end = at.slot + q.shape[2]
    kv.k[:, :, at.slot : end] = k  # [b, kvh, s, hd] into [b, kvh, max_len, hd], in place
    kv.v[:, :, at.slot : end] = v
    keys, values = kv.k[:, :, :end], kv.v[:, :, :end]  # [b, kvh, slot + s, hd] views
    # [b, h, s, hd] @ [b, kvh, hd, slot+s] -> softmax -> @ [b, kvh, slot+s, hd] -> [b, h, s, hd]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=at.mask, enable_gqa=q.shape[1] != k.shape[1])


def attention_step(
    h: torch.Tensor,
    p: dict[str, torch.Tensor],
    plan: ParallelPlan,
    kv: LayerKV,
    at: Position,
    *,
    head_dim: int,
    norm_eps: float = 1e-5,
) -> torch.Tensor:
    """Attention of the normed ``h [b, s, d]`` with a KV cache: column-parallel q/k/v (each head's q and k
    RMSNormed where ``p`` has ``q_norm`` / ``k_norm``, Qwen3), RoPE at ``at``'s
    positions, the new keys and values written into ``kv``, attention over the cache, row-parallel output.

    Args:
        h: ``[b, s, d]`` the normed hidden states of the step's tokens.
        p: the layer's ``wq``, ``wk``, ``wv``, ``wo`` (local blocks over ``plan.tp``), and ``q_norm`` / ``k_norm``
            ``[head_dim]`` where the model has them.
        plan: the parallel plan (only ``tp`` is read).
        kv: the layer's cache views.
        at: the step's slots, angles and mask.
        head_dim: the attention head size.
        norm_eps: the q/k norms' epsilon.

    Returns:
        ``[b, s, d]``, the attention block's output (to add to the residual), invariant over ``tp``.

    Example:
        >>> d, hd = 16, 4
        >>> p = {n: torch.randn(d, d) / 4 for n in ("wq", "wk", "wv", "wo")}
        >>> cache = init_cache(1, 2, 4, 8, hd)
        >>> at = Position(0, torch.ones(2, 3, 1, 2), torch.zeros(2, 3, 1, 2), torch.ones(2, 1, 3, 3, dtype=torch.bool))
        >>> kv = LayerKV(cache.k[0], cache.v[0])
        >>> attention_step(torch.randn(2, 3, d), p, ParallelPlan(), kv, at, head_dim=hd).shape
        torch.Size([2, 3, 16])
    """
    qkv = column_parallel_linear(h, [p["wq"], p["wk"], p["wv"]], axis=plan.tp)  # [b, s, d] -> 3 x [b, s, h*hd(/tp)]
    b, s = h.shape[:2]
    q, k, v = (t.view(b, s, t.shape[-1] // head_dim, head_dim) for t in qkv)  # -> [b, s, heads(/tp), hd]
    if "q_norm" in p:  # Qwen3: each head's q and k RMSNormed before RoPE
        q, k = rms_norm(q, p["q_norm"], norm_eps), rms_norm(k, p["k_norm"], norm_eps)  # [b, s, heads(/tp), hd]
    q, k = rope_at(q, at.cos, at.sin), rope_at(k, at.cos, at.sin)
    o = _cached_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv, at)  # [b, h(/tp), s, hd]
    o = o.transpose(1, 2).reshape(b, s, o.shape[1] * o.shape[3])  # -> [b, s, h*hd(/tp)] (b may be 0: no -1)
    return row_parallel_linear(o, p["wo"], axis=plan.tp)  # [b, s, h*hd/tp] @ [h*hd/tp, d] -> [b, s, d] (psum)


def block_step(
    p: dict[str, torch.Tensor],
    plan: ParallelPlan,
    ffn: Callable[[torch.Tensor], torch.Tensor],
    *,
    head_dim: int,
    norm_eps: float,
) -> LayerStep:
    """A pre-norm decoder layer's step on its (gathered) parameters ``p``: ``x + attention(norm(x))`` with the
    cache, then ``x + ffn(norm(x))``; ``ffn`` is the model's feed-forward on the normed ``[b, s, d]``.

    Example:
        >>> # step = block_step(layer_params, plan, lambda h: swiglu(h, layer_params), head_dim=64, norm_eps=1e-5)
    """

    def step(x: torch.Tensor, kv: LayerKV, at: Position) -> torch.Tensor:
        h = rms_norm(x, p["attn_norm"], norm_eps)  # [b, s, d]
        x = x + attention_step(h, p, plan, kv, at, head_dim=head_dim, norm_eps=norm_eps)  # [b, s, d]
        return x + ffn(rms_norm(x, p["mlp_norm"], norm_eps))  # [b, s, d] -> [b, s, d]

    return step


class _Positions:
    """The angles and masks of every step, from the left padding: slot ``j`` of row ``r`` is at position
    ``j - pad_r``; pads are never keys (each pad query sees itself only, so no row of scores is all masked)."""

    def __init__(self, model: Decoder, mask: torch.Tensor, max_len: int) -> None:
        b, width = mask.shape
        self.pad = (width - mask.sum(-1)).unsqueeze(-1)  # [b, 1]
        self.cos, self.sin = _rope_table(max_len, model.head_dim, model.rope_theta, model.rope_scaling)
        self.keys = torch.ones(b, max_len, dtype=torch.bool)  # [b, max_len]: the slots that are keys
        self.keys[:, :width] = mask
        self.width = width

    def prefill(self) -> Position:
        s = self.width
        slots = torch.arange(s)
        causal = slots[None, :] <= slots[:, None]  # [s(q), s(k)]
        seen = causal & (self.keys[:, None, :s] | torch.eye(s, dtype=torch.bool))  # [b, s, s]
        return self._at(0, slots.unsqueeze(0), seen.unsqueeze(1))

    def step(self, slot: int) -> Position:
        return self._at(slot, torch.tensor([[slot]]), self.keys[:, None, None, : slot + 1])  # mask [b, 1, 1, slot+1]

    def _at(self, slot: int, slots: torch.Tensor, mask: torch.Tensor) -> Position:
        pos = (slots - self.pad).clamp(min=0)  # [b, s]: each row's RoPE positions
        return Position(slot, self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2), mask)  # [b, s, 1, hd/2]


def _forward(model: Decoder, ids: torch.Tensor, caches: list[LayerKV], at: Position) -> torch.Tensor:
    """The logits of the last of ``ids [b, s]``: ``[b, V(/tp)]``, the cache filled at ``at``'s slots."""
    x = model.embed(ids)  # [b, s] -> [b, s, d]
    for step, kv in zip(model.layers, caches, strict=True):
        x = step(x, kv, at)  # [b, s, d] -> [b, s, d]
    return model.head(x[:, -1])  # [b, d] -> [b, V(/tp)]


def decode(
    model: Decoder,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_new_tokens: int,
    opts: SamplingOptions,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    rows: Sequence[int] | range | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """Prefill ``tokens`` then generate ``max_new_tokens`` tokens a step, with a KV cache.

    Args:
        model: the model's embedding, layer steps and head.
        tokens: ``[b, S]`` left-padded prompts (:func:`left_pad`); every row has at least one real token.
        mask: ``[b, S]`` True at the prompts' tokens.
        max_new_tokens: tokens to generate (>= 1).
        opts: greedy or sampled (:class:`~funcshard.models.sampling.SamplingOptions`).
        stop_tokens: a row that emits one of them emits ``pad_id`` afterwards; the loop ends early when every
            row has stopped.
        pad_id: the id of padding (before short prompts, after stopped rows).
        rows: the global indices of these rows (for their random draws); default ``range(b)``.

    Returns:
        ``(ids, cache)``: ``[b, S + max_new_tokens]`` (the prompts as given, then the new tokens) and the cache.

    Example:
        >>> # ids, cache = decode(llama_decoder, *left_pad(prompts, 0), max_new_tokens=20, opts=SamplingOptions())
    """
    b, width = tokens.shape
    max_len = width + max_new_tokens - 1  # the last token is returned, never fed
    cache = init_cache(len(model.layers), b, model.kv_heads, max_len, model.head_dim, model.dtype)
    caches = [LayerKV(cache.k[i], cache.v[i]) for i in range(len(model.layers))]  # views, made once
    where = _Positions(model, mask, max_len)
    stop = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long)
    finished = torch.zeros(b, dtype=torch.bool)
    out: list[torch.Tensor] = []
    logits = _forward(model, tokens, caches, where.prefill())  # [b, S] -> [b, V(/tp)]
    for i in range(max_new_tokens):
        nxt = next_token(logits, opts, step=i, rows=rows, axis=model.axis, vocab=model.vocab)  # [b]
        if len(stop):
            nxt = torch.where(finished, pad_id, nxt)  # a stopped row emits padding
            finished = finished | torch.isin(nxt, stop)
        out.append(nxt)
        if i + 1 == max_new_tokens or (len(stop) and bool(finished.all())):
            break
        logits = _forward(model, nxt.unsqueeze(1), caches, where.step(width + i))  # [b, 1] -> [b, V(/tp)]
    new = torch.stack(out, dim=1)  # [b, n]
    if new.shape[1] < max_new_tokens:  # every row stopped early
        new = F.pad(new, (0, max_new_tokens - new.shape[1]), value=pad_id)
    return torch.cat([tokens, new], dim=1), cache


def check_prompts(prompts: Any, vocab: int, fn: str) -> list[list[int]]:
    """``prompts`` as a list of non-empty lists of ids in ``[0, vocab)``: a list of id lists or a ``[b, s]``
    tensor (every row full). Raises ConfigError naming ``fn``, the row and what is wrong.

    Example:
        >>> check_prompts(torch.tensor([[1, 2]]), 4, "generate")
        [[1, 2]]
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point:
            raise ConfigError(f"{fn}: a prompts tensor must be [batch, seq] integer ids, found {prompts.dtype} "
                              f"{tuple(prompts.shape)}.")  # fmt: skip
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(f"{fn}: prompts must be a non-empty list of token-id lists, found {type(prompts).__name__}.")
    out = []
    for r, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise ConfigError(f"{fn}: prompt {r} is empty; every prompt needs at least one token (e.g. a BOS id).")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"{fn}: prompt {r} holds ids {bad[:5]} outside the vocabulary [0, {vocab}).")
        out.append(ids)
    return out
