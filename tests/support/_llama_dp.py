"""The small Llama's data-parallel loss-and-gradient step that the dp gradient-path tests share."""

from __future__ import annotations

from typing import Any

import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def llama_step(mesh: fs.Mesh, cfg: llama.Config = CFG) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """(shard_map'd ``llama.value_and_grad`` over ``mesh``, params, tokens, targets) of ``cfg``, seed 0."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    targets = tokens.roll(-1, dims=1)
    params = llama.init(fs.random.key(0), cfg)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    return f, params, tokens, targets
