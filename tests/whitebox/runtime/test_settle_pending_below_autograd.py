"""``settle`` (``_src/collectives/vma.py``) waits for a pending collective below its Python autograd kernel (issue #11).

Under ``dist``'s overlap, each gradient the backward hands back from a bucket is its own pending view
(``AsyncCollectiveTensor``), settled once the gradients are stacked (``models.stacked.Unstack``): 72 waits a step of
the 13.2M Llama. ``AsyncCollectiveTensor.wait`` goes through the ``wait_tensor`` op's Python autograd kernel
(~12 Python calls) even where no gradient flows; ``settle`` calls the op below autograd there (a result that
requires grad, with grad mode on, still waits through autograd). The same tensors, the same numbers.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from _llama_dp import llama_step

import funcshard as fs
from funcshard._src.collectives import vma as base
from funcshard.models import llama

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _body(mesh: fs.Mesh) -> dict[str, Any]:
    import torch.distributed._functional_collectives as funcol

    step, params, tok, tgt = llama_step(mesh, CFG)
    sharded = fs.device_put(params, mesh, llama.param_specs(CFG, mesh))
    real_wait, real_settle = funcol.wait_tensor, base.settle
    python_waits: list[int] = []
    settled: list[int] = []

    def counting_wait(t: torch.Tensor) -> torch.Tensor:
        python_waits.append(1)
        return real_wait(t)

    def counting_settle(t: Any) -> Any:
        if type(t).__name__ == "AsyncCollectiveTensor":
            settled.append(1)
        return real_settle(t)

    funcol.wait_tensor = counting_wait
    base.settle = counting_settle  # (the modules that imported it by name keep the real one: counted by them below)
    try:
        loss, grads = step(sharded, tok, tgt)
    finally:
        funcol.wait_tensor, base.settle = real_wait, real_settle
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, CFG))(params)
    got = optree.tree_leaves(fs.device_get(grads))
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, optree.tree_leaves(ref_grads)))
    # a pending result that requires grad, with grad mode on: waited for through autograd (its node kept)
    x = torch.ones(3, requires_grad=True)
    pending = funcol.AsyncCollectiveTensor(x * 2)
    kept = base.settle(pending)
    kept.sum().backward()
    return {
        "python_waits": len(python_waits),
        "close": close and torch.allclose(fs.device_get(loss), ref_loss, rtol=1e-5),
        "grad_through": torch.equal(x.grad, torch.full((3,), 2.0)),
    }


def test_settle_waits_below_autograd(run: Any, backend: str) -> None:
    for r in run(_body, {"dp": 2}):
        assert r["close"] and r["grad_through"], r
        # the backward's pending gradients (dist: one per leaf of each bucket, 21 here) settled without the Python
        # wait; before, every one of them went through it (the one left: the loss, read where it requires grad)
        assert r["python_waits"] <= 1, r
