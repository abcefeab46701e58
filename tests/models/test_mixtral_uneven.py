"""The Mixtral on dims its mesh does not divide (API §14), as the Llama (``test_llama_uneven.py``): a vocabulary of
250 on tp=2 beside ep=2, a batch of 5 or 10 split over ep and the data axes (the router's load-balancing statistics
pooled over the global batch, whatever each device's share), a sequence of 13 beside it: the loss with its aux
term and every gradient equal the single-device reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import mixtral

CFG = mixtral.Config(
    vocab_size=250,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=48,
    max_seq_len=16,
    n_experts=4,
    router_aux_loss_coef=0.3,  # large: the load-balancing term weighs in every gradient
)
#: mesh, batch, sequence
CASES = {
    "ep2_tp2_vocab250": ({"ep": 2, "tp": 2}, 4, 16),
    "ep2_batch5": ({"ep": 2}, 5, 16),
    "dp2_ep2_batch10": ({"dp": 2, "ep": 2}, 10, 16),
    "fsdp2_ep2_batch7_seq13": ({"fsdp": 2, "ep": 2}, 7, 13),
    "ep4_batch6": ({"ep": 4}, 6, 16),
    "dp2_batch1": ({"dp": 2}, 1, 16),  # one device routes no token: its statistics are zeros
    "pp2_dp2_batch1": ({"pp": 2, "dp": 2}, 1, 16),  # a stage's microbatch of no sequence (pp_microbatches=1)
}


def _mixtral_body(mesh: fs.Mesh, batch: int, seq: int, check_vma: bool) -> str:
    cfg = dataclasses.replace(CFG, pp_microbatches=1) if "pp" in mesh.axis_names else CFG
    params = mixtral.init(fs.random.key(0), cfg)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt[0, :3] = -100  # ignored positions count nowhere (the router's statistics still count their tokens)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: mixtral.loss(p, tok, tgt, cfg))(params)
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)

    def step(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return mixtral.value_and_grad(p, t, y, cfg)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs), check_vma=check_vma)
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6, msg=path)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_mixtral_uneven_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape, batch, seq = CASES[name]
    assert run_body("sim", _mixtral_body, shape, batch, seq, check_vma) == ["ok"]


@pytest.mark.dist
def test_mixtral_uneven_dist() -> None:
    from _dist_pool import run_body

    shape, batch, seq = CASES["dp2_ep2_batch10"]
    assert set(run_body("dist", _mixtral_body, shape, batch, seq, True)) == {"ok"}
