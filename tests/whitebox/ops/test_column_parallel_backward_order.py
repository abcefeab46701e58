"""Column-parallel linear's backward (``ops.tp.ColumnParallel``): the input gradient's all-reduce is issued before
the weights' gradients are computed, so under ``dist`` it travels while they compute (an event order, not a
timing); the numbers are those of ``pvary`` + ``F.linear`` and of the unsharded reference. Sim and dist."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard import P
from funcshard.ops import column_parallel_linear, row_parallel_linear

pytestmark = pytest.mark.counters


class _Events(TorchDispatchMode):
    """Records each mm's output shape, in order (the weight gradients are the [out/tp, in] ones)."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            self.events.append(("mm", tuple(out.shape)))
        return out


def _mlp_body(mesh: fs.Mesh) -> dict:
    from funcshard._src.runtime.backends import dist as dist_backend

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 8, generator=gen)
    w1, w3 = torch.randn(12, 8, generator=gen) / 3, torch.randn(12, 8, generator=gen) / 3
    w2 = torch.randn(8, 12, generator=gen) / 3

    def loss(ws: dict, x: torch.Tensor) -> torch.Tensor:
        h = x.cos()  # (a node before the layer: the backward's last node reduces synchronously, nothing left)
        a, c = column_parallel_linear(h, [ws["w1"], ws["w3"]], axis="tp")  # [4, 6, 8] -> 2 x [4, 6, 12/tp]
        y = row_parallel_linear(F.silu(a) * c, ws["w2"], axis="tp")  # [4, 6, 12/tp] -> [4, 6, 8]
        return (y * x).sin().sum()

    def ref_loss(ws: dict, x: torch.Tensor) -> torch.Tensor:
        h = x.cos()
        return ((F.linear(F.silu(F.linear(h, ws["w1"])) * F.linear(h, ws["w3"]), ws["w2"]) * x).sin()).sum()

    ws = {"w1": w1, "w2": w2, "w3": w3}
    specs = {"w1": P("tp", None), "w2": P(None, "tp"), "w3": P("tp", None)}
    events: list = []
    if mesh.backend == "dist":
        dist_backend.issued_hook = lambda t: events.append(("issued", tuple(t.shape)))

    def step(ws: dict, x: torch.Tensor) -> tuple:
        with _Events(events):
            return fs.value_and_grad(loss, argnums=(0, 1))(ws, x)

    try:
        value, (gw, gx) = fs.shard_map(step, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), (specs, P())))(ws, x)
    finally:
        dist_backend.issued_hook = None
    wr = {k: v.clone().requires_grad_() for k, v in ws.items()}
    xr = x.clone().requires_grad_()
    ref = ref_loss(wr, xr)
    ref_gw = torch.autograd.grad(ref, [*wr.values(), xr])
    got = [fs.device_get(gw)[k] for k in wr] + [fs.device_get(gx)]
    close = torch.allclose(fs.device_get(value), ref.detach(), rtol=1e-5, atol=1e-5) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, ref_gw, strict=True)
    )
    issued = [i for i, e in enumerate(events) if e == ("issued", (4, 6, 8))]  # x's gradient, [4, 6, 8]
    dw = [i for i, e in enumerate(events) if e[0] == "mm" and e[1] == (12 // mesh.shape["tp"], 8)]  # dw1, dw3
    return {"close": close, "issued": issued, "dw": dw, "dist": mesh.backend == "dist"}


def test_column_parallel_input_gradient_all_reduce_overlaps_weight_gradients(run) -> None:
    for r in run(_mlp_body, {"tp": 2}):
        assert r["close"], r
        if r["dist"]:
            # one pending all-reduce of x's gradient, issued before either weight gradient of w1 / w3 is computed
            assert len(r["issued"]) == 1 and len(r["dw"]) == 2, r
            assert r["issued"][0] < min(r["dw"]), r
