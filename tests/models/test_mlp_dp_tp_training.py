"""A 2-layer MLP trained with DP x TP on a 2 x 2 mesh equals the unsharded model, step by step.

With ``check_vma=True`` there is no hand-written gradient reduction at all; with ``check_vma=False`` the
only additions are explicit ``fs.pvary`` calls where replicated weights meet the dp-sharded batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P

SPECS = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}
LR = 0.1


def _init() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, h, dout, b = 8, 16, 4, 8
    params = {
        "w1": torch.randn(h, d, generator=g) / d**0.5,
        "b1": torch.randn(h, generator=g) * 0.1,
        "w2": torch.randn(dout, h, generator=g) / h**0.5,
        "b2": torch.randn(dout, generator=g) * 0.1,
    }
    return params, torch.randn(b, d, generator=g), torch.randn(b, dout, generator=g)


def _loss_ref(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.relu(F.linear(x, p["w1"], p["b1"]))
    return ((F.linear(h, p["w2"], p["b2"]) - y) ** 2).mean()


def _make_step(check_vma: bool):
    def loss_local(p, x, y):
        if not check_vma:  # by hand what check_vma=True inserts: replicated over dp meets dp-sharded data
            p = fs.pvary(p, "dp")
        h = torch.relu(F.linear(x, p["w1"], p["b1"]))  # [b/dp, d] @ [d, h/tp] -> [b/dp, h/tp]
        o = fs.psum(F.linear(h, p["w2"]), "tp") + p["b2"]  # [b/dp, h/tp] @ [h/tp, o] -> [b/dp, o], psum over tp
        return fs.pmean(((o - y) ** 2).mean(), "dp")  # [] -> [], mean over dp

    def step(p, x, y):
        grads, loss = torch.func.grad_and_value(loss_local)(p, x, y)
        new = {k: p[k] - LR * grads[k] for k in p}
        return loss, grads, new

    return step


def _mlp_body(mesh: fs.Mesh, check_vma: bool) -> str:
    params, x, y = _init()
    step = fs.shard_map(
        _make_step(check_vma),
        mesh=mesh,
        in_specs=(SPECS, P("dp"), P("dp")),
        out_specs=(P(), SPECS, SPECS),
        check_vma=check_vma,
    )
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    sharded = fs.device_put(params, mesh, SPECS)
    for _ in range(3):
        loss_ref = _loss_ref(ref, x, y)
        grads_ref = torch.autograd.grad(loss_ref, list(ref.values()))
        loss, grads, sharded = step(sharded, x, y)
        torch.testing.assert_close(fs.device_get(loss), loss_ref.detach(), rtol=1e-5, atol=1e-7)
        for k, g_ref in zip(ref, grads_ref):
            assert grads[k].spec == SPECS[k]
            torch.testing.assert_close(fs.device_get(grads[k]), g_ref, rtol=1e-5, atol=1e-7, msg=k)
        ref = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(ref.items(), grads_ref)}
    for k in ref:
        torch.testing.assert_close(fs.device_get(sharded[k]), ref[k].detach(), rtol=1e-5, atol=1e-7, msg=k)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "explicit_pvary"])
def test_mlp_dp_tp(run, check_vma: bool) -> None:
    assert set(run(_mlp_body, {"dp": 2, "tp": 2}, check_vma)) == {"ok"}


def test_replicated_param_in_replicated_compute_is_not_summed() -> None:
    """A replicated parameter used only in replicated computation gets its plain gradient (no psum)."""
    mesh = fs.make_mesh({"dp": 4}, backend="sim")
    w = torch.randn(3)

    def f(w):
        return torch.func.grad(lambda w: (w**2).sum())(w)

    g = fs.shard_map(f, mesh=mesh, in_specs=(P(),), out_specs=P())(w)
    torch.testing.assert_close(fs.device_get(g), 2 * w)
