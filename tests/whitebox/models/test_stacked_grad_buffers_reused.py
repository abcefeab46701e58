"""The Llama's stacked ``[n_layers, ...]`` layer weights: their gradients are stacked back into buffers kept from
step to step (``funcshard.models.stacked.unstack``) under ``dist``, never while a gradient handed out from one is
still held, with the numbers of ``torch.unbind``'s fresh stack. Every body runs under ``sim`` and ``dist``."""

from __future__ import annotations

import optree
import pytest
import torch
from _llama_dp import CFG, llama_step

import funcshard as fs
from funcshard._src.collectives.prims import BUCKETS
from funcshard.models.llama import model as llama_model
from funcshard.models.stacked import Unstack, _pool, unstack

pytestmark = pytest.mark.counters


def _stacked_body(mesh: fs.Mesh) -> tuple[bool, bool, bool, bool, int, bool, int, bool]:
    _pool().clear()
    BUCKETS.clear()
    f, params, tokens, targets = llama_step(mesh)

    def local(grads: dict) -> tuple[int, torch.Tensor]:  # this process's wq gradient: its storage, its value
        a = grads["layers"]["wq"]
        t = a.shards[min(a.shards)]
        return t.untyped_storage().data_ptr(), t.clone()

    llama_model.unstack = torch.unbind  # the reference: torch's own unbind (a fresh stack per backward)
    try:
        loss_ref, g_ref = f(params, tokens, targets)
    finally:
        llama_model.unstack = unstack
    loss1, g1 = f(params, tokens, targets)
    ptr1, val1 = local(g1)
    same = torch.equal(fs.device_get(loss1), fs.device_get(loss_ref)) and all(
        torch.equal(a, b)
        for a, b in zip(optree.tree_leaves(fs.device_get(g1)), optree.tree_leaves(fs.device_get(g_ref)), strict=True)
    )
    _, g2 = f(params, tokens, targets)  # g1 still held: its buffer must not be written
    ptr2, _ = local(g2)
    kept = ptr2 != ptr1 and torch.equal(local(g1)[1], val1)
    del g1, g2
    _, g3 = f(params, tokens, targets)  # nothing holds the earlier gradients: a kept buffer is taken again
    ptr3, val3 = local(g3)
    wq = g3["layers"]["wq"]
    made = len(_pool().kept.get((wq.shards[min(wq.shards)].numel(), torch.float32, torch.device("cpu")), []))
    # the layers' gradient buckets: rows of one [n_layers, per layer] buffer, each stacked gradient a strided view
    layers = [a.shards[min(a.shards)] for a in g3["layers"].values()]
    per_layer = sum(t[0].numel() for t in layers)
    shared = len(BUCKETS.kept.get((CFG.n_layers * per_layer, torch.float32, torch.device("cpu")), []))
    views = all(t.untyped_storage().data_ptr() == layers[0].untyped_storage().data_ptr() for t in layers)
    return same, kept, ptr3 in (ptr1, ptr2), torch.equal(val3, val1), made, mesh.backend == "dist", shared, views


def test_stacked_layer_gradients_in_kept_buffers(run) -> None:
    for same, kept, reused, equal, made, dist, shared, views in run(_stacked_body, {"dp": 2}):
        assert same and kept and equal
        if dist:
            # every layer's bucket is a row of one [n_layers, per layer] buffer, and each stacked gradient a strided
            # view of it (no stack copy, so no buffer of the stacks' own pool); 2 such buffers (step 3 took step
            # 1's or step 2's, step 2 could not take step 1's: its gradients were still held)
            assert reused and views and shared == 2 and made == 0
        else:  # under sim it is torch.unbind (fresh memory each step)
            assert made == 0 and shared == 0 and not views


def test_unstack_function_rules() -> None:
    # the Function's backward (kept buffer), its differentiated backward (torch.stack) and its tangent
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        rows = Unstack.apply(x)
        return sum(((r * w[i]).sin() * (i + 1)).sum() for i, r in enumerate(rows[:2]))  # row 2 gets no gradient

    (g,) = torch.autograd.grad(f(x), x)
    assert torch.equal(g[2], torch.zeros(4, dtype=torch.float64))
    (g_ref,) = torch.autograd.grad(sum(((r * w[i]).sin() * (i + 1)).sum() for i, r in enumerate(x.unbind(0)[:2])), x)
    assert torch.equal(g, g_ref)
    assert torch.autograd.gradcheck(f, (x,))
    (g2,) = torch.autograd.grad(f(x), x, create_graph=True)  # differentiated again: a plain stack
    (h,) = torch.autograd.grad((g2 * w).sum(), x)
    (g2_ref,) = torch.autograd.grad(
        sum(((r * w[i]).sin() * (i + 1)).sum() for i, r in enumerate(x.unbind(0)[:2])), x, create_graph=True
    )
    (h_ref,) = torch.autograd.grad((g2_ref * w).sum(), x)
    assert torch.equal(h, h_ref) and h.abs().sum() > 0
    _, jvp = torch.func.jvp(lambda x: torch.stack(Unstack.apply(x)), (x.detach(),), (w,))
    assert torch.equal(jvp, w)
