"""The pipeline tests' toy model: ``L = n_stages * n_virtual`` residual-MLP layers (``y = x + tanh(x @ W1) @ W2``),
its plain reference, the schedules by name, and the body that runs it through ``funcshard.pipeline.run`` inside
shard_map and checks the loss and every layer's gradient against the reference (sim or dist)."""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard import P
from funcshard.pipeline import by_name, gpipe, interleaved_1f1b, one_f_one_b, run, zero_bubble_h1
from funcshard.pipeline.runtime import stage_order

D, H, MB = 4, 6, 3  # feature dim, hidden dim, rows per microbatch


DT = torch.float64


def _layer(params, x):
    w1, w2 = params
    return x + torch.tanh(x @ w1) @ w2


def _mse(y, t):
    return ((y - t) ** 2).mean()


def _data(n_layers: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(n_layers, D, H, generator=g, dtype=DT) * 0.5
    w2 = torch.randn(n_layers, H, D, generator=g, dtype=DT) * 0.5
    x = torch.randn(batch, D, generator=g, dtype=DT)
    t = torch.randn(batch, D, generator=g, dtype=DT)
    return w1, w2, x, t


def _reference(w1, w2, x, t):
    """Loss and per-layer grads of the plain model on the full batch."""
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    y = x
    for i in range(w1.shape[0]):
        y = _layer((w1[i], w2[i]), y)
    loss = _mse(y, t)
    g1, g2 = torch.autograd.grad(loss, (w1, w2))
    return loss.detach(), g1, g2


def _schedule(name: str, p: int, m: int):
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, 2)
    if name in ("interleaved_zb", "looped_bfs"):
        return by_name(name, p, m, n_virtual=2)
    if name in ("zbv", "dualpipev"):
        return by_name(name, p, m)
    return zero_bubble_h1(p, m)


def _pipeline_body(mesh: fs.Mesh, name: str, m: int, check_vma: bool) -> str:
    p = mesh.shape["pp"]
    sched = _schedule(name, p, m)
    v = sched.n_virtual
    w1, w2, x, t = _data(p * v, m * MB)
    ref_loss, ref_g1, ref_g2 = _reference(w1, w2, x, t)
    order = stage_order(sched)  # global stacked index -> layer
    params = (w1[order], w2[order])  # [p * v, D, H], [p * v, H, D]

    def step(params, xs, ts):
        return run(sched, _layer, params, xs, targets=ts, loss_fn=_mse)

    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")), check_vma=check_vma)
    loss, (g1, g2) = f(params, x.reshape(m, MB, D), t.reshape(m, MB, D))
    torch.testing.assert_close(fs.device_get(loss).reshape(()), ref_loss, rtol=1e-5, atol=1e-12)
    inv = torch.tensor(order).argsort()  # layer -> global stacked index
    torch.testing.assert_close(fs.device_get(g1)[inv], ref_g1, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g2)[inv], ref_g2, rtol=1e-5, atol=1e-12)
    return "ok"
