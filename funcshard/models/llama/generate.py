"""``llama.generate``: batched decoding with a KV cache, on one device or inside ``shard_map``.

The Llama supplies its embedding, one step per layer (attention with the cache, then SwiGLU) and its head to
the model-agnostic loop of :mod:`funcshard.models.decoding`; the weights are gathered over ``fsdp`` once, before
the loop. Inside ``shard_map`` the prompts are split over the data axes (``dp``, ``fsdp``; uneven splits as
``torch.tensor_split``), the kv heads and the cache over ``tp`` (column/row-parallel linears, vocab-parallel
embedding and head; where ``tp`` exceeds the kv heads, each device keeps the one kv head its query heads
group with, and its cache holds that head only); the tokens are those of the unsharded model.

Example:
    >>> import funcshard as fs
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> params = llama.init(fs.random.key(0), cfg)
    >>> ids = llama.generate(params, [[1, 2, 3], [4]], cfg, max_new_tokens=5)
    >>> ids.shape, ids[1, :2].tolist()  # [batch, longest prompt + new]; the short prompt left-padded with 0
    (torch.Size([2, 8]), [0, 0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...extend import ConfigError, axis_index_int
from ...ops import column_parallel_linear, row_parallel_linear, vocab_parallel_embedding
from ..decoding import Decoder, block_step, check_prompts, decode, left_pad
from ..plan import ParallelPlan
from ..sampling import SamplingOptions
from ..transformer import MLPS, kv_weights, rms_norm, use_params
from .config import Config
from .model import layout
from .sharding import kv_shared

__all__ = ["decode_batch", "decoder", "generate", "swiglu_ffn"]

PyTree = Any


FFN = Callable[[dict[str, torch.Tensor], ParallelPlan], Callable[[torch.Tensor], torch.Tensor]]


def swiglu_ffn(p: dict[str, torch.Tensor], plan: ParallelPlan) -> Callable[[torch.Tensor], torch.Tensor]:
    """The Llama's feed-forward on one layer's parameters ``p``: SwiGLU over column/row-parallel linears."""
    tp, swiglu = plan.tp, MLPS["swiglu"][1]

    def mlp(h: torch.Tensor) -> torch.Tensor:
        up = column_parallel_linear(h, [p["w1"], p["w3"]], axis=tp)  # [b, s, d] -> 2 x [b, s, f(/tp)]
        return row_parallel_linear(swiglu(*up), p["w2"], axis=tp)  # [b, s, f/tp] @ [f/tp, d] -> [b, s, d]

    return mlp


def decoder(params: PyTree, cfg: Config, plan: ParallelPlan, ffn: FFN = swiglu_ffn) -> Decoder:
    """The Llama's embedding, layer steps and head on ``params`` as ``use_params`` gives them (gathered);
    ``ffn(layer_params, plan)`` gives a layer's feed-forward (a model built on the Llama brings its own).

    Example:
        >>> # model = decoder(use_params(params, specs, plan, cfg.precision), cfg, plan)
    """
    tp, shared = plan.tp, kv_shared(cfg, plan)
    layers = params["layers"]
    n = next(iter(layers.values())).shape[0]
    steps = []
    for i in range(n):  # each layer's weights indexed once, not per token
        p = {k: v[i] for k, v in layers.items()}
        if shared > 1:  # wk / wv replicated over tp: this device's kv head, once (its cache holds that head only)
            p["wk"], p["wv"] = kv_weights(p["wk"], p["wv"], plan, cfg.head_dim, shared)  # [n_kv*hd, d] -> [hd, d]
        steps.append(block_step(p, plan, ffn(p, plan), head_dim=cfg.head_dim, norm_eps=cfg.norm_eps))
    table = params["embed"]  # [V/tp, d]
    head = table if cfg.tie_embeddings else params["head"]  # [V/tp, d]

    def logits(x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(rms_norm(x, params["norm"], cfg.norm_eps), head, axis=tp)  # [b, d] -> [b, V/tp]

    tp_size = plan.size("tp")
    return Decoder(
        embed=lambda ids: vocab_parallel_embedding(ids, table, axis=tp),  # [b, s] -> [b, s, d]
        layers=steps,
        head=logits,
        vocab=cfg.vocab_size,
        kv_heads=cfg.n_kv_heads // tp_size if shared == 1 else 1,  # this device's kv heads: its cache's
        head_dim=cfg.head_dim,
        dtype=layers["wk"].dtype,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        axis=tp,
    )


def local_rows(n: int, plan: ParallelPlan, axes: tuple[str, ...] | None = None) -> tuple[range, int]:
    """``(rows, block)``: the rows of a global batch of ``n`` this device decodes and the rows it returns. The
    batch is cut over the data axes (``axes``; None: the plan's, ``dp``, ``fsdp``, row-major) in blocks of
    ``block = ceil(n / size)`` rows, the last ones short (or empty): each device returns ``block`` rows, its own
    then rows of padding, so the global result holds the ``n`` rows in order, then the padding. Outside
    ``shard_map``: all rows.

    Example:
        >>> local_rows(3, ParallelPlan())
        (range(0, 3), 3)
    """
    axes = plan.data_axes if axes is None else axes
    if not axes:
        return range(n), n
    sizes = dict(plan.mesh_shape)
    size = 1
    for a in axes:
        size *= sizes[a]
    block = -(-n // size)
    r = axis_index_int(axes)
    return range(min(r * block, n), min((r + 1) * block, n)), block


def checked_layout(lay: Any, max_new_tokens: int, fn: str) -> Any:
    """The model's layout ``lay``, checked: ConfigError for a bad ``max_new_tokens`` or a ``pp`` / ``cp`` axis."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"{fn}: max_new_tokens must be a positive int, found {max_new_tokens!r}.")
    if lay.plan.pp is not None or lay.plan.cp is not None:
        raise ConfigError(
            f"{fn}: a mesh with a pp or cp axis ({lay.plan.roles}); decode on a mesh of dp / fsdp / ep / tp axes."
        )
    return lay


def generate(
    params: PyTree,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    cfg: Config,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    key: torch.Tensor | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    plan: ParallelPlan | None = None,
) -> torch.Tensor:
    """Generate ``max_new_tokens`` tokens after each prompt, with a KV cache (prefill, then a token a step).

    Rows are returned as Hugging Face's ``generate`` returns them for left-padded prompts: row ``r`` is
    ``[pad_id] * (S - len(prompts[r])) + prompts[r] + new tokens``, ``S`` the longest prompt, so the width is
    ``S + max_new_tokens`` and the new tokens start at column ``S`` in every row (the mask of the prompts'
    tokens is ``ids[:, :S] != pad`` where the pad id is not a prompt token, or derived from the lengths). A
    row that emits one of ``stop_tokens`` emits ``pad_id`` after it.

    Args:
        params: the parameter tree of :func:`~funcshard.models.llama.init` (this device's blocks inside
            ``shard_map``, laid out by ``llama.param_specs(cfg, mesh, plan)``).
        prompts: the GLOBAL batch, a list of token-id lists (any lengths >= 1) or a ``[b, s]`` id tensor; inside
            ``shard_map`` pass it by closure (or replicated, ``P()``): the batch is cut over the data axes in
            blocks of ``ceil(b / data)`` rows, each device decodes its block and returns ``ceil(b / data)``
            rows, the last blocks completed with rows of ``pad_id``: with ``out_specs=P(data axes)`` the global
            result holds the ``b`` rows in order, then that padding (take ``[:b]``), as a JAX batch is padded
            to a multiple of the data-parallel size.
        cfg: the model config.
        max_new_tokens: tokens to generate per row.
        temperature: 0: greedy (the arg-max; ties to the lowest id, as ``torch.argmax``); > 0: sampled.
        key: the ``fs.random`` key of the draws (needed when sampling): step ``i`` draws
            ``fs.random.uniform(fold_in(key, i), (batch,))``, row ``r`` its entry ``r`` (inverse-CDF sampling).
        top_k, top_p: sample from the ``top_k`` most likely tokens, then from the fewest most likely whose
            probability reaches ``top_p`` (Hugging Face's rules); None: no such cut.
        stop_tokens, pad_id: ids that end a row; the id that pads short prompts and stopped rows (HF's pad_token_id).
        plan: the parallel plan the specs were made with; ``None``: each role by the axis of its own name.

    Returns:
        ``[b, S + max_new_tokens]`` int64 ids (``[ceil(b/data), ...]``, this device's block, inside
        ``shard_map``: ``out_specs=P(data axes)``), the same on every device of ``tp``.

    Raises:
        ConfigError: empty prompts, ids out of the vocabulary, bad options, a ``pp`` / ``cp`` axis in the mesh.

    Example:
        >>> import funcshard as fs; from funcshard.models import llama
        >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
        >>> params, prompts = llama.init(fs.random.key(0), cfg), [[1, 2, 3], [4], [5, 6]]
        >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
        >>> specs = llama.param_specs(cfg, mesh)
        >>> f = fs.shard_map(lambda p: llama.generate(p, prompts, cfg, max_new_tokens=4), mesh=mesh,
        ...                  in_specs=(specs,), out_specs=fs.P("dp"))
        >>> ids = fs.device_get(f(fs.device_put(params, mesh, specs)))  # [4, 3 + 4]: 3 rows and a padding row
        >>> torch.equal(ids[:3], llama.generate(params, prompts, cfg, max_new_tokens=4))
        True
    """
    lay = checked_layout(layout(cfg, plan), max_new_tokens, "llama.generate")
    opts = {"temperature": temperature, "key": key, "top_k": top_k, "top_p": top_p}
    return decode_batch(params, prompts, cfg, lay, decoder, max_new_tokens, opts, stop_tokens, pad_id, "llama")


def decode_batch(
    params: PyTree,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    cfg: Config,
    lay: Any,
    make: Callable[[PyTree, Any, ParallelPlan], Decoder],
    max_new_tokens: int,
    sampling: dict[str, Any],
    stop_tokens: Sequence[int] | None,
    pad_id: int,
    name: str,
    data_axes: tuple[str, ...] | None = None,
) -> torch.Tensor:
    """:func:`generate`'s body for a model built on the Llama: its layout ``lay`` and its decoder ``make(gathered
    params, cfg, plan)``; the prompts split over ``data_axes`` (None: the plan's data axes)."""
    every = check_prompts(prompts, cfg.vocab_size, f"{name}.generate")
    stops = [] if stop_tokens is None else [int(t) for t in stop_tokens]
    opts = SamplingOptions(**sampling, batch=len(every))
    plan = lay.plan
    rows, block = local_rows(len(every), plan, data_axes)
    width = max(len(p) for p in every)  # the global longest prompt: every device returns the same width
    tokens, mask = left_pad([every[r] for r in rows], pad_id, width)  # [b, S]
    with torch.no_grad():
        gathered = use_params(params, lay.specs, plan, cfg.precision)  # [.., s/fsdp, ..] -> [.., s, ..], once
        ids = torch.empty(0, width + max_new_tokens, dtype=torch.long)
        if len(rows):  # (a device past the end of a short batch decodes nothing)
            model = make(gathered, cfg, plan)
            kw = {"opts": opts, "stop_tokens": stops, "pad_id": pad_id, "rows": rows}
            ids, _ = decode(model, tokens, mask, max_new_tokens=max_new_tokens, **kw)  # [b, S + new]
    if len(rows) < block:  # the padding rows of the last blocks
        ids = torch.cat([ids, torch.full((block - len(rows), ids.shape[1]), pad_id, dtype=torch.long)])
    return ids
