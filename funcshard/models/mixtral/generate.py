"""``mixtral.generate``: the Llama's batched KV-cached decoding with each layer's feed-forward the mixture of experts.

The loop, the cache, the sampling and the layout of the prompts are :func:`funcshard.models.llama.generate`'s; a
layer's feed-forward routes each new token to its top-k experts (:func:`funcshard.ops.moe.moe_ffn`). On a mesh with
an ``ep`` axis the experts stay split over it and every ``ep`` device decodes the same prompts (split over ``dp`` /
``fsdp`` only): each step's dispatch is a ragged all-to-all that every ``ep`` device takes part in, so all of them
run every step, and they stop together (the same rows stop at the same step).

Example:
    >>> import funcshard as fs
    >>> from funcshard.models import mixtral
    >>> cfg = mixtral.Config.preset("debug")
    >>> params = mixtral.init(fs.random.key(0), cfg)
    >>> mixtral.generate(params, [[1, 2, 3], [4]], cfg, max_new_tokens=5).shape  # [batch, longest prompt + new]
    torch.Size([2, 8])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import lax
from ...ops.moe import moe_ffn
from ..llama.generate import checked_layout, decode_batch, decoder
from ..plan import ParallelPlan
from .config import Config
from .model import layout

__all__ = ["generate"]

PyTree = Any


def _moe_ffn(cfg: Config) -> Callable[[dict[str, torch.Tensor], ParallelPlan], Callable[[torch.Tensor], torch.Tensor]]:
    """A layer's feed-forward for the decoder: its experts on the normed ``[b, s, d]`` (the router's statistics are
    for training's balancing loss: not kept)."""

    def ffn(p: dict[str, torch.Tensor], plan: ParallelPlan) -> Callable[[torch.Tensor], torch.Tensor]:
        experts = {k: p[k] for k in ("router", "w1", "w3", "w2")}

        def run(h: torch.Tensor) -> torch.Tensor:
            k, norm = cfg.experts_per_token, cfg.norm_topk_prob
            return moe_ffn(h, experts, k, axis=plan.ep, tp=plan.tp, norm_topk=norm)  # [b, s, d] -> [b, s, d]

        return run

    return ffn


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
    """Generate ``max_new_tokens`` tokens after each prompt with a KV cache, as
    :func:`funcshard.models.llama.generate` (the same arguments, rows and padding), on a mesh of ``dp`` / ``fsdp`` /
    ``ep`` / ``tp`` axes: the prompts split over ``dp`` and ``fsdp``, the experts over ``ep`` (every ``ep`` device
    decodes the same rows), the heads, the cache and the experts' hidden dim over ``tp``.

    Returns:
        ``[b, S + max_new_tokens]`` int64 ids (inside ``shard_map``: ``[ceil(b / (dp x fsdp)), ...]``, this device's
        block, ``out_specs=P(("dp", "fsdp"))`` or the data axes there are), the same on every ``ep`` and ``tp``
        device.

    Raises:
        ConfigError: empty prompts, ids out of the vocabulary, bad options, a ``pp`` / ``cp`` axis in the mesh.

    Example:
        >>> import funcshard as fs
        >>> from funcshard.models import mixtral
        >>> cfg = mixtral.Config.preset("debug")
        >>> params, prompts = mixtral.init(fs.random.key(0), cfg), [[1, 2, 3], [4]]
        >>> mesh = fs.make_mesh({"ep": 2, "tp": 2}, backend="sim")
        >>> specs = mixtral.param_specs(cfg, mesh)
        >>> f = fs.shard_map(lambda p: mixtral.generate(p, prompts, cfg, max_new_tokens=4), mesh=mesh,
        ...                  in_specs=(specs,), out_specs=fs.P())
        >>> torch.equal(fs.device_get(f(fs.device_put(params, mesh, specs))),
        ...             mixtral.generate(params, prompts, cfg, max_new_tokens=4))
        True
    """
    lay = checked_layout(layout(cfg, plan), max_new_tokens, "mixtral.generate")
    p = lay.plan
    data = tuple(a for a in (p.dp, p.fsdp) if a is not None)  # (ep devices decode the same rows)
    opts = {"temperature": temperature, "key": key, "top_k": top_k, "top_p": top_p}

    def make(gathered: PyTree, cfg: Config, plan: ParallelPlan) -> Any:
        return decoder(gathered, cfg, plan, _moe_ffn(cfg))

    ids = decode_batch(params, prompts, cfg, lay, make, max_new_tokens, opts, stop_tokens, pad_id, "mixtral", data)
    if p.ep is not None:  # the same ids on every ep device; the dispatch made them vary over ep: said so
        ids = lax.pmax(ids, p.ep)  # [b, S + new] -> [b, S + new]: all-reduce max over ep
    return ids
