"""The Llama on dims its mesh does not divide (API §14): a vocabulary of 250 on tp=4 (vocab-parallel embedding and
cross-entropy over ``torch.tensor_split``'s vocabulary blocks), a batch of 10 on dp=4 or fsdp=4, a sequence of 14 or
15 under sequence parallelism, and several at once: loss and every gradient equal the single-device reference, and
a sharded init equals the unsharded init bitwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config(vocab_size=250, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=64, max_seq_len=16)
#: mesh, batch, sequence, sequence parallel
CASES = {
    "tp4_vocab250": ({"tp": 4}, 4, 16, False),
    "dp4_batch10": ({"dp": 4}, 10, 16, False),
    "fsdp4_batch10": ({"fsdp": 4}, 10, 16, False),
    "dp2_tp2_batch5": ({"dp": 2, "tp": 2}, 5, 16, False),
    "tp4_sp_seq14": ({"tp": 4}, 2, 14, True),
    "dp2_tp2_sp_batch3_seq15": ({"dp": 2, "tp": 2}, 3, 15, True),
}


def _llama_body(mesh: fs.Mesh, batch: int, seq: int, sp: bool, check_vma: bool) -> str:
    cfg = dataclasses.replace(CFG, sequence_parallel=sp)
    key = fs.random.key(0)
    params = llama.init(key, cfg)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt[0, :3] = -100  # ignored positions count nowhere
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)

    def step(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg))(p)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs), check_vma=check_vma)
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)
    sharded = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(key)
    for (path, a), (_, b) in zip(
        fs.pytree.leaves_with_path(fs.device_get(sharded)), fs.pytree.leaves_with_path(params), strict=True
    ):
        assert torch.equal(a, b), path
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_llama_uneven_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape, batch, seq, sp = CASES[name]
    assert run_body("sim", _llama_body, shape, batch, seq, sp, check_vma) == ["ok"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp2_tp2_batch5", "tp4_vocab250", "dp2_tp2_sp_batch3_seq15"])
def test_llama_uneven_dist(name: str) -> None:
    from _dist_pool import run_body

    shape, batch, seq, sp = CASES[name]
    assert set(run_body("dist", _llama_body, shape, batch, seq, sp, True)) == {"ok"}
