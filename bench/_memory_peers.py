"""The torch peers of ``bench/memory.py``: an ``nn.Module`` twin of the funcshard Llama and its training steps.

The twin has the funcshard Llama's shapes and parameter count (asserted against ``llama.Config.num_params()``):
token embedding, ``n_layers`` pre-norm blocks (RMSNorm computed in float32, grouped-query attention with
rotate-half RoPE through ``F.scaled_dot_product_attention``, SwiGLU MLP), a final RMSNorm and an untied head,
no biases. It does not load funcshard's weights: equal shapes are what matters for memory. Its peers:

- ``module``: ``loss.backward()`` on the plain module (the baseline of ``fs.value_and_grad(llama.loss)``);
- ``module_ckpt``: each block under ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
  (the baseline of ``Config(remat="full")``);
- ``module_bf16``: the plain module under ``torch.autocast("cpu", torch.bfloat16)``: float32 weights, bfloat16
  matmuls (the single-device baseline of ``Config(precision="bf16")``);
- on 4 gloo processes: ``ddp4`` (``DistributedDataParallel``), ``fsdp2_*`` (``fully_shard`` on every block and
  the root, with or without ``reshard_after_forward``, with per-block checkpointing, and with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``).

Example:
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> model = build(cfg)
    >>> sum(p.numel() for p in model.parameters()) == cfg.num_params()
    True
    >>> model(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Block", "Llama", "RMSNorm", "build", "module_loss"]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics in float32, the result in ``x``'s dtype times the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (rotate-half) of ``x [b, s, heads, hd]`` at positions ``0 .. s-1``, computed in float32."""
    s, hd = x.shape[1], x.shape[-1]
    freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd/2]
    ang = torch.outer(torch.arange(s, dtype=torch.float32), freq)  # [s, hd/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [s, 1, hd/2], broadcast over b and heads
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class Block(nn.Module):
    """One pre-norm decoder block: GQA attention with RoPE, then a SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        self.n_heads, self.n_kv, self.hd, self.theta = cfg.n_heads, cfg.n_kv_heads, hd, cfg.rope_theta
        self.attn_norm, self.mlp_norm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.w1 = nn.Linear(d, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(d, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, d, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.n_heads, self.hd)  # [b, s, d] @ [d, h*hd] -> [b, s, h, hd]
        k = self.wk(h).view(b, s, self.n_kv, self.hd)  # [b, s, d] @ [d, kv*hd] -> [b, s, kv, hd]
        v = self.wv(h).view(b, s, self.n_kv, self.hd)
        q, k = _rotate(q, self.theta), _rotate(k, self.theta)
        rep = self.n_heads // self.n_kv  # each kv head serves `rep` query heads
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)  # [b, kv, s, hd] -> [b, h, s, hd]
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)  # [b, h, s, hd]
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))  # [b, s, h*hd] @ [h*hd, d] -> [b, s, d]
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))  # [b, s, f] @ [f, d] -> [b, s, d]


class Llama(nn.Module):
    """The decoder: embedding, blocks, final norm, untied head. ``ckpt=True``: every block under
    ``torch.utils.checkpoint`` (non-reentrant), recomputed in the backward from its input."""

    def __init__(self, cfg: Any, *, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        std = cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 2:  # weights as funcshard draws them: N(0, std), output projections scaled down
                scale = math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, std=std / scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # [b, s] -> [b, s, d]
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(self.norm(x))  # [b, s, d] @ [d, V] -> [b, s, V]


def build(cfg: Any, *, ckpt: bool = False) -> Llama:
    """The twin of the funcshard Llama of ``cfg`` (float32); its parameter count is ``cfg.num_params()``."""
    if cfg.tie_embeddings:
        raise ValueError("the nn.Module twin has an untied head; use a Config with tie_embeddings=False")
    model = Llama(cfg, ckpt=ckpt)
    n = sum(p.numel() for p in model.parameters())
    assert n == cfg.num_params(), f"the nn.Module twin has {n:,} parameters, the funcshard Llama {cfg.num_params():,}"
    return model


def module_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of ``model(tokens)`` against ``targets``, in float32."""
    logits = model(tokens)  # [b, s, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
