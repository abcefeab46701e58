"""What ``bench/vs_peers.py`` adds to the ``nn.Module`` twin of ``bench/_memory_peers.py``: funcshard's weights
loaded into it (so both sides start from the same numbers and their losses can be compared), and its
tensor-parallel form under DTensor's ``parallelize_module`` (torchtitan's Llama plan).

Example:
    >>> import torch, funcshard as fs
    >>> import _memory_peers as peers
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    >>> params = llama.init(fs.random.key(0), cfg)
    >>> model = load_params(peers.build(cfg), params)
    >>> t = torch.randint(0, 256, (2, 16))
    >>> torch.allclose(model(t), llama.forward(params, t, cfg), atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BLOCK_LEAVES", "load_params", "tp_loss", "tp_parallelize"]

#: the Llama's per-layer leaves (``params["layers"][name]``, stacked on dim 0), each a twin ``Block`` attribute
BLOCK_LEAVES = ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w1", "w2", "w3")


@torch.no_grad()
def load_params(model: nn.Module, params: dict[str, Any]) -> nn.Module:
    """Copy a full (unsharded) funcshard Llama parameter tree into the twin ``model``; returns ``model``.

    Args:
        model: a twin from ``_memory_peers.build(cfg)`` (same shapes as ``params``).
        params: ``llama.init(key, cfg)``: ``embed``, ``layers`` (leaves stacked ``[n_layers, ...]``),
            ``norm``, ``head``, all ``F.linear`` layout, as the twin's ``nn.Linear`` weights are.
    """
    model.embed.weight.copy_(params["embed"])  # [V, d]
    model.norm.weight.copy_(params["norm"])  # [d]
    model.head.weight.copy_(params["head"])  # [V, d]
    for i, block in enumerate(model.layers):
        for name in BLOCK_LEAVES:
            mod = getattr(block, name)
            mod.weight.copy_(params["layers"][name][i])
    return model


def tp_parallelize(model: nn.Module, world: int) -> nn.Module:
    """The twin made tensor-parallel over all ``world`` ranks with DTensor (torch's ``parallelize_module``):
    q/k/v and the MLP's gate/up column-wise, the attention output and the MLP's down projection row-wise
    (Megatron's two all-reduces per block), the embedding row-wise over the vocabulary, the head column-wise
    with its logits left sharded over the vocabulary for :func:`tp_loss` (``loss_parallel``). Norms stay
    plain replicated tensors. Each block then holds ``heads / world`` heads (its ``view`` uses them).

    Args:
        model: the twin (weights already loaded).
        world: the number of ranks (the default process group's size); divides the head counts.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(
        model,
        mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate()),  # [V/tp, d] table, output all-reduced
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # logits [b, s, V/tp]
        },
    )
    plan = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")}
    plan |= {n: RowwiseParallel() for n in ("wo", "w2")}
    for block in model.layers:
        parallelize_module(block, mesh, plan)
        block.n_heads //= world  # the local heads of the column-parallel q / k / v
        block.n_kv //= world
    return model


def tp_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of the tensor-parallel twin, the vocabulary never gathered
    (``loss_parallel``); call ``.backward()`` on it inside the same ``loss_parallel()`` context."""
    logits = model(tokens)  # [b, s, V/tp] (a DTensor sharded on its last dim)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
