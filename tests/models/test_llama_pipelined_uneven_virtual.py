"""The pipelined Llama with a layer count that its virtual stages do not divide (API §14, issue #31): the layers
are split over the ``pp x chunks`` virtual stages as ``torch.tensor_split`` splits them, in virtual-stage order
(earlier virtual stages one layer more, as DTorch assigns them; a virtual stage with no layer is the identity),
for the looped (``interleaved``) and V-shaped (``zbv``, ``dualpipev``) placements as for ``1f1b``. A 7-layer
Llama on pp=2 and pp=4 equals the single device (loss and every gradient, fp32, rtol 1e-5) under ``sim``, one
case under ``dist``; the parameters stay in natural layer order, each stage holding its ``tensor_split`` block
(checkpoints and ``device_get`` unchanged); fewer layers than physical stages stays a ``ConfigError``."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

#: schedule, mesh, layers (7 layers: pp=2 x 2 chunks -> 2, 2, 2, 1; pp=4 x 2 chunks -> 1 x 7 and an empty one)
CASES = {
    "1f1b_pp2_L7": ("1f1b", {"pp": 2}, 7),
    "1f1b_pp4_L7": ("1f1b", {"pp": 4}, 7),
    "interleaved_pp2_L7": ("interleaved", {"pp": 2}, 7),
    "interleaved_pp4_L7": ("interleaved", {"pp": 4}, 7),
    "zbv_pp2_L7": ("zbv", {"pp": 2}, 7),
    "zbv_pp4_L7": ("zbv", {"pp": 4}, 7),
    "dualpipev_pp2_L5": ("dualpipev", {"pp": 2}, 5),
    "interleaved_zb_pp4_L5": ("interleaved_zb", {"pp": 4}, 5),  # three empty virtual stages, split B / W
    "interleaved_pp2_tp2_L7": ("interleaved", {"pp": 2, "tp": 2}, 7),
}


def _cfg(schedule: str, layers: int) -> llama.Config:
    return llama.Config(
        vocab_size=64,
        dim=32,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=16,
        pp_schedule=schedule,
    )


def _body(mesh: fs.Mesh, schedule: str, layers: int) -> str:
    cfg = _cfg(schedule, layers)
    params = llama.init(fs.random.key(0), cfg)
    tok = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    tgt = tok.roll(-1, dims=1)
    tgt[0, :3] = -100
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))  # natural layer order: the single device's
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)
    pp, stage = mesh.shape["pp"], mesh.axis_names.index("pp")
    want = [t.shape[0] for t in torch.tensor_split(torch.empty(layers), pp)]  # each stage's natural block
    for c, block in grads["layers"]["w1"].shards.items():
        assert block.shape[0] == want[c[stage]], (c, tuple(block.shape))
    return "ok"


@pytest.mark.parametrize("name", sorted(CASES))
def test_uneven_virtual_stages_equal_single_device_sim(name: str) -> None:
    from _dist_pool import run_body

    schedule, shape, layers = CASES[name]
    assert run_body("sim", _body, shape, schedule, layers) == ["ok"]


@pytest.mark.dist
def test_uneven_interleaved_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _body, {"pp": 2}, "interleaved", 7)) == {"ok"}
