"""The sharded half of the MoE models' Hugging Face comparisons (the Mixtral's and the Qwen3-MoE's): the
``mixtral`` step and forward on a mesh, checked against the reference loss, gradients and logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import funcshard as fs
from funcshard import P
from funcshard.models import mixtral


def check_sharded(
    mesh: fs.Mesh,
    cfg: mixtral.Config,
    params: Any,
    data: tuple[torch.Tensor, torch.Tensor],
    ref: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    compare: Callable[..., None],
    check_vma: bool,
) -> str:
    """``mixtral.value_and_grad`` and ``mixtral.forward`` on ``mesh`` against ``ref = (logits, loss, grads)``
    (``compare(loss, grads, ref_loss, ref_grads, what)`` checks the first two); ``data = (tokens, targets)``."""
    tokens, targets = data
    ref_logits, ref_loss, ref_grads = ref
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    kw = {"mesh": mesh, "check_vma": check_vma}
    step = fs.shard_map(
        lambda p, t, y: mixtral.value_and_grad(p, t, y, cfg), in_specs=(specs, bs, bs), out_specs=(P(), specs), **kw
    )
    sharded = fs.device_put(params, mesh, specs)
    loss, grads = fs.device_get(step(sharded, tokens, targets))
    compare(loss, grads, ref_loss, ref_grads, str(mesh.shape))
    vocab = P(*bs.entries, "tp" if "tp" in mesh.shape else None)  # [b, s, V/tp]
    fwd = fs.shard_map(lambda p, t: mixtral.forward(p, t, cfg), in_specs=(specs, bs), out_specs=vocab, **kw)
    torch.testing.assert_close(fs.device_get(fwd(sharded, tokens)), ref_logits, rtol=1e-4, atol=1e-5)
    return "ok"
