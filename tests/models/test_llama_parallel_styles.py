"""The Llama: loss and every gradient equal the single-device reference on 4 devices for every mix of
parallel styles; a sharded init equals the unsharded init bitwise; bad meshes raise one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=64, max_seq_len=16)
MESHES = {
    "dp4": ({"dp": 4}, False),
    "fsdp4": ({"fsdp": 4}, False),
    "tp4": ({"tp": 4}, False),
    "tp4_sp": ({"tp": 4}, True),
    "dp2_tp2": ({"dp": 2, "tp": 2}, False),
    "fsdp2_tp2": ({"fsdp": 2, "tp": 2}, False),
    "dp2_fsdp2": ({"dp": 2, "fsdp": 2}, False),
    "cp4": ({"cp": 4}, False),
    "dp2_cp2": ({"dp": 2, "cp": 2}, False),
    "fsdp2_cp2": ({"fsdp": 2, "cp": 2}, False),
    "tp2_cp2_sp": ({"tp": 2, "cp": 2}, True),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt[0, :5] = -100  # ignored positions count nowhere
    return tok, tgt


def _llama_body(mesh: fs.Mesh, sp: bool, check_vma: bool) -> str:
    cfg = dataclasses.replace(CFG, sequence_parallel=sp)
    key = fs.random.key(0)
    params = llama.init(key, cfg)
    tok, tgt = _batch()
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)

    def step(p, t, y):
        return fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg))(p)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs), check_vma=check_vma)
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, g), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=path)
    # a sharded init draws only each device's blocks, bitwise equal to the unsharded init
    sharded = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(key)
    for (path, a), (_, b) in zip(
        fs.pytree.leaves_with_path(fs.device_get(sharded)), fs.pytree.leaves_with_path(params)
    ):
        assert torch.equal(a, b), path
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_llama_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape, sp = MESHES[name]
    assert run_body("sim", _llama_body, shape, sp, check_vma) == ["ok"]


@pytest.mark.dist
def test_llama_dist_dp2_tp2() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _llama_body, {"dp": 2, "tp": 2}, False, True)) == {"ok"}


def test_tied_embeddings_and_forward_shapes() -> None:
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    params = llama.init(fs.random.key(1), cfg)
    assert "head" not in params
    tok, tgt = _batch()
    assert llama.forward(params, tok, cfg).shape == (4, 16, cfg.vocab_size)
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(lambda p, t, y: llama.loss(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=P())
    torch.testing.assert_close(fs.device_get(f(params, tok, tgt)), llama.loss(params, tok, tgt, cfg))


def test_layers_are_stacked() -> None:
    shapes = {k: v.shape for k, v in llama.init(fs.random.key(0), CFG)["layers"].items()}
    assert all(s[0] == CFG.n_layers for s in shapes.values())
    assert shapes["wk"] == (2, CFG.n_kv_heads * CFG.head_dim, CFG.dim)


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ({"tp": 3}, "n_heads=8 is not divisible by tp=3"),
        ({"tp": 16}, "n_heads=8 is not divisible by tp=16"),  # (tp=8 > n_kv_heads=4: kv heads replicated)
        ({"fsdp": 3}, "dim=32 is not divisible by fsdp=3"),
        ({"mp": 2}, "axis 'mp' of size 2, which the Llama does not use"),  # (an ep axis is a data axis)
    ],
)
def test_meshes_the_model_cannot_use(shape: dict[str, int], match: str) -> None:
    with pytest.raises(fs.ShardingError, match=match):
        llama.param_specs(CFG, fs.make_mesh(shape, backend="sim"))


def test_vocab_not_divisible_by_tp() -> None:
    """A vocabulary tp does not divide is split unevenly (tests/models/test_llama_uneven.py runs it)."""
    cfg = dataclasses.replace(CFG, vocab_size=66)
    specs = llama.param_specs(cfg, fs.make_mesh({"tp": 4}, backend="sim"))
    assert specs["embed"] == specs["head"] == P("tp", None)
