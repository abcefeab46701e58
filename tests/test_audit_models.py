"""Audit of the models, ops, pipeline and checkpoints against their peers on cases the other tests leave out.

Peers: torch's ``F.scaled_dot_product_attention`` and ``F.cross_entropy`` in float64 (the ops keep float64's
precision, not float32's), transformers' ``LlamaForCausalLM`` (loss over labels with HF's ``-100`` and every
gradient, for one shared k/v head), the plain model for pipelines with odd microbatch counts and fewer
microbatches than stages, and an unsharded AdamW run for a checkpoint saved on one mesh with its optimiser
state and resumed on another.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard.ops import attention, vocab_parallel_cross_entropy

# ---------------------------------------------------------------------------------------------- float64 ops


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_with_lse_keeps_float64(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    r = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # GQA: 4 q heads, 1 kv head
    ref_grads = torch.autograd.grad((ref * r).sum(), (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / 8**0.5  # [b, 4, s, d] @ [b, 1, d, s] -> [b, 4, s, s]
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    grads = torch.autograd.grad((out * r).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def _cross_entropy_body(mesh: fs.Mesh, reduction: str) -> str:
    g = torch.Generator().manual_seed(1)
    logits = (10 * torch.randn(3, 5, 8, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 8, (3, 5), generator=g)
    labels[0, :2] = labels[2, 4] = -100  # HF's ignore index
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), logits)

    def local(x: torch.Tensor, y: torch.Tensor, w_: torch.Tensor, axis: str | None) -> tuple:
        x = x.detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, y, axis=axis, reduction=reduction)
        (grad,) = torch.autograd.grad((loss * w_).sum(), x)
        return loss, grad

    loss, grad = local(logits, labels, w, None)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    f = fs.shard_map(
        lambda x, y, w_: local(x, y, w_, "tp"),
        mesh=mesh,
        in_specs=(P(None, None, "tp"), P(), P()),
        out_specs=(P(), P(None, None, "tp")),
    )
    loss, grad = f(logits.detach(), labels, w)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(fs.device_get(loss), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fs.device_get(grad), ref_grad, rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_keeps_float64_sim(reduction: str) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _cross_entropy_body, {"tp": 2}, reduction) == ["ok"]


def test_cross_entropy_keeps_float64_dist() -> None:
    from _dist_pool import run_body

    assert run_body("dist", _cross_entropy_body, {"tp": 2}, "mean") == ["ok", "ok"]
