"""A transformer block in TP, TP+SP, FSDP, FSDP+TP and HSDP on 4 devices: loss and gradients equal the
unsharded block's, gradients come out with the parameters' specs, and the communication measured with
fs.comm_stats equals the theory exactly."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard.models import block

pytestmark = pytest.mark.counters

CFG = block.BlockConfig(dim=16, heads=4, ffn=32)
BATCH, SEQ = 4, 8


def _x() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, CFG.dim, generator=torch.Generator().manual_seed(1))


def _measured(stats: fs.CommStats) -> dict[tuple[str, str], tuple[int, int]]:
    return stats.rows()


def _block_body(mesh: fs.Mesh, mode: str, check_vma: bool) -> str:
    params, x = block.init(CFG, seed=0), _x()
    specs = block.param_specs(mode)
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss_ref = block.loss(ref, x, CFG, None)
    grads_ref = dict(zip(ref, torch.autograd.grad(loss_ref, list(ref.values()))))

    def step(p, x):  # no hand-written reduction in either mode: the block's ops are correct in both
        return fs.value_and_grad(lambda p: block.loss(p, x, CFG, mode))(p)

    f = fs.shard_map(
        step, mesh=mesh, in_specs=(specs, block.batch_spec(mode)), out_specs=(fs.P(), specs), check_vma=check_vma
    )
    sharded = fs.device_put(params, mesh, specs)
    with fs.comm_stats() as stats:
        loss, grads = f(sharded, x)
    torch.testing.assert_close(fs.device_get(loss), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    for k in params:
        assert grads[k].spec == specs[k], k
        torch.testing.assert_close(fs.device_get(grads[k]), grads_ref[k], rtol=1e-5, atol=1e-5, msg=f"{mode} {k}")
    theory = block.comm_theory(CFG, mode, batch=BATCH, seq=SEQ)
    assert _measured(stats) == theory, f"{mode}: measured {_measured(stats)} != theory {theory}"
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("mode", block.MODES)
def test_block_sim(mode: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _block_body, block.mesh_shape(mode), mode, check_vma) == ["ok"]


def _all_modes_body(mesh: fs.Mesh, modes: list[str]) -> str:
    for mode in modes:
        _block_body(fs.make_mesh(block.mesh_shape(mode), backend="dist"), mode, True)
    return "ok"


@pytest.mark.dist
def test_blocks_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _all_modes_body, {"tp": 4}, list(block.MODES))) == {"ok"}
