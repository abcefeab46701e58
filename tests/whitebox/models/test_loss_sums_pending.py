"""The Llama loss's data-parallel sums off the forward's critical path (issue #11).

``llama.loss`` sums the token count over the data axes before the forward (it depends on the targets only) and
its mean after it, both with ``lax.psum_pending``: under ``dist`` each is issued and returns at once (a pending
result), the count waited for after the forward, the mean after the backward (``fs.value_and_grad`` seeds a
pending value with 1). So no rank waits for the others in the forward, as with DDP. The gradients are bitwise
those of the one synchronous all-reduce of ``(total, count)`` it replaced (the seed reaches each shard's
``total / count`` as before); the value is ``sum(total_i / count)`` instead of ``sum(total_i) / count``: within
one float32 ulp per data shard.
"""

from __future__ import annotations

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P, lax
from funcshard.models import llama
from funcshard.models.llama import model as llama_model
from funcshard.ops import vocab_parallel_cross_entropy

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _one_sum_loss(params, tokens, targets, cfg):
    """The loss as it was before: one synchronous all-reduce of (total, count) after the forward."""
    lay = llama_model.layout(cfg, None)
    logits = llama_model._forward(params, tokens, cfg, lay)  # [b, s, V]
    total = vocab_parallel_cross_entropy(logits, targets, axis=lay.plan.tp, reduction="sum")  # []
    count = (targets != -100).sum().to(total.dtype)
    both = lax.psum(torch.stack((total, count)), lay.plan.data_axes)  # [2] -> [2]
    return both[0] / both[1].clamp(min=1)


def _body(mesh: fs.Mesh) -> dict:
    from funcshard._src.runtime.backends import dist as dist_backend

    params = llama.init(fs.random.key(0), CFG)
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
    tgt = tok.roll(-1, 1)
    tgt[0, :5] = -100  # shards with different token counts
    specs, bs = llama.param_specs(CFG, mesh), llama.batch_spec(mesh)
    issued: list = []
    seen: list = []  # at each layer's start: the loss sums (0-dim) issued so far
    plain_layer = llama_model.layer

    def layer(x, p, *a, **kw):
        seen.append(len(issued))
        return plain_layer(x, p, *a, **kw)

    step = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, CFG), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    old = fs.shard_map(
        lambda p, t, y: fs.value_and_grad(_one_sum_loss)(p, t, y, CFG),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
    )
    plain = fs.shard_map(lambda p, t, y: llama.loss(p, t, y, CFG), mesh=mesh, in_specs=(specs, bs, bs), out_specs=P())
    sharded = fs.device_put(params, mesh, specs)
    if mesh.backend == "dist":
        dist_backend.issued_hook = lambda t: issued.append(t) if t.dim() == 0 else None
    llama_model.layer = layer
    try:
        loss, grads = step(sharded, tok, tgt)
    finally:
        llama_model.layer = plain_layer
        dist_backend.issued_hook = None
    pending = [type(t).__name__ == "AsyncCollectiveTensor" for t in issued]
    old_loss, old_grads = old(sharded, tok, tgt)
    loss, old_loss = fs.device_get(loss), fs.device_get(old_loss)
    grads, old_grads = fs.device_get(grads), fs.device_get(old_grads)
    same_grads = all(
        torch.equal(a, b) for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(old_grads), strict=True)
    )
    ulp = (torch.nextafter(old_loss, torch.tensor(float("inf"))) - old_loss).item()
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, CFG))(params)
    close = torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(ref_grads), strict=True)
    )
    # the loss alone (no value_and_grad), with and without autograd: a plain tensor out of shard_map
    with torch.no_grad():
        alone_no_grad = fs.device_get(plain(sharded, tok, tgt))
    alone = fs.device_get(plain(sharded, tok, tgt))
    return {
        "seen": seen,
        "pending": pending,
        "same_grads": same_grads,
        "loss_diff_ulps": abs((loss - old_loss).item()) / ulp,
        "close": close,
        "plain_out": type(loss) is torch.Tensor and type(alone) is torch.Tensor,
        "alone_equal": torch.equal(alone.detach(), loss) and torch.equal(alone_no_grad, loss),
    }


def test_loss_sums_leave_the_forward_and_keep_the_gradients(run, backend) -> None:
    for r in run(_body, {"dp": 2}):
        assert r["close"] and r["plain_out"] and r["alone_equal"], r
        assert r["same_grads"], r  # bitwise the one-all-reduce loss's gradients
        assert r["loss_diff_ulps"] <= 1, r  # sum(total_i / count) vs sum(total_i) / count, 2 shards
        if backend == "dist":
            # the count's sum issued before the first layer, the mean's after the forward; both returned pending
            assert r["seen"] == [1, 1] and r["pending"] == [True, True], r
        else:
            assert r["pending"] == [], r  # sim: synchronous
