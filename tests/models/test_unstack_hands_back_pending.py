"""``models.stacked.Unstack``'s backward hands the layers' pending bucket sums back as ONE pending strided view
per stacked leaf, not waited for (issue #11, the dp step's blocking waits).

Under ``dist``'s overlap each layer's gradient bucket is row ``i`` of one layer-major buffer, summed in place and
handed back as pending views; the stacked leaf's gradient is their strided view. Before, ``Unstack`` waited for
every row first: the first layer's bucket, issued just before, blocked the backward there (a wait DDP does not
have: its reducer waits once, after the whole backward), before the embedding's gradient and the last bucket's
sum. Now the view stays pending and ``fs.value_and_grad`` waits for it once the backward is done. The same
numbers: the Llama's dp loss and gradients bitwise with and without, ``sim`` (no pending sums: the old path) and
``dist`` (every stacked leaf's gradient pending), and equal to the unsharded step's.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from _llama_dp import llama_step

import funcshard as fs
from funcshard.models import llama, stacked

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _body(mesh: fs.Mesh) -> dict[str, Any]:
    step, params, tok, tgt = llama_step(mesh, CFG)
    sharded = fs.device_put(params, mesh, llama.param_specs(CFG, mesh))
    real = stacked._pending_rows
    made: list[int] = []

    def counting(*a: Any) -> Any:
        out = real(*a)
        if out is not None:
            made.append(1)
        return out

    out = []
    for pending in (True, False):  # one pending view per stacked leaf; each row waited for first, as before
        stacked._pending_rows = counting if pending else (lambda *a: None)
        try:
            loss, grads = step(sharded, tok, tgt)
        finally:
            stacked._pending_rows = real
        out.append((fs.device_get(loss), optree.tree_leaves(fs.device_get(grads))))
    same = torch.equal(out[0][0], out[1][0]) and all(
        torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True)
    )
    plain = all(type(g) is torch.Tensor for g in out[0][1])  # settled by value_and_grad: no pending gradient out
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, CFG))(params)
    close = torch.allclose(out[0][0], ref_loss, rtol=1e-5) and all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(out[0][1], optree.tree_leaves(ref_grads), strict=True)
    )
    return {"same": same, "plain": plain, "close": close, "made": len(made)}


def test_unstack_leaves_the_layers_sums_pending(run: Any, backend: str) -> None:
    n_stacked = len(llama.init(fs.random.key(0), CFG)["layers"])
    for r in run(_body, {"dp": 2}):
        assert r["same"] and r["plain"] and r["close"], r
        # dist: every stacked leaf's gradient one pending view (the layers' buckets share one buffer); sim: none
        assert r["made"] == (n_stacked if backend == "dist" else 0), r
