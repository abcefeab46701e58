"""The pipelined Llama with a layer count its ``pp`` stages do not divide (API §14): the layer stack is split as
``torch.tensor_split`` splits it (earlier stages take one layer more, as DTorch assigns them), and the loss and
every gradient equal the single-device reference, under ``sim`` and ``dist``, and on an abstract mesh the stages'
blocks have those shapes."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

#: schedule, mesh, layers
CASES = {
    "1f1b_pp2_L3": ("1f1b", {"pp": 2}, 3),
    "gpipe_pp2_tp2_L5": ("gpipe", {"pp": 2, "tp": 2}, 5),
    "zb_pp2_dp2_L3": ("zb", {"pp": 2, "dp": 2}, 3),
    "1f1b_pp4_L6": ("1f1b", {"pp": 4}, 6),
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


def _pipelined_body(mesh: fs.Mesh, schedule: str, layers: int) -> str:
    cfg = _cfg(schedule, layers)
    params = llama.init(fs.random.key(0), cfg)
    tok = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    tgt = tok.roll(-1, dims=1)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.pytree.leaves_with_path(fs.device_get(grads))
    for (path, a), (_, r) in zip(got, fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)
    pp = mesh.shape["pp"]
    stage = mesh.axis_names.index("pp")
    want = [t.shape[0] for t in torch.tensor_split(torch.empty(layers), pp)]  # earlier stages one layer more
    for c, block in grads["layers"]["wq"].shards.items():
        assert block.shape[0] == want[c[stage]], (c, tuple(block.shape))
    return "ok"


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipelined_uneven_layers_sim(name: str) -> None:
    from _dist_pool import run_body

    schedule, shape, layers = CASES[name]
    assert run_body("sim", _pipelined_body, shape, schedule, layers) == ["ok"]


@pytest.mark.dist
def test_pipelined_uneven_layers_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _pipelined_body, {"pp": 2}, "1f1b", 3)) == {"ok"}


def test_interleaved_takes_uneven_layers_but_not_fewer_than_stages() -> None:
    """Several chunks per stage split the layers over the virtual stages (tests/models/
    test_llama_pipelined_uneven_virtual.py runs them); a physical stage with no layer stays a ConfigError."""
    specs = llama.param_specs(_cfg("interleaved", 3), fs.make_mesh({"pp": 2}, backend="sim"))
    assert specs["layers"]["wq"][0] == "pp"
    for schedule in ("1f1b", "interleaved", "zbv"):
        with pytest.raises(fs.ConfigError, match=r"n_layers=3 is fewer than the pp=4 stages.*n_layers >= 4"):
            llama.param_specs(_cfg(schedule, 3), fs.make_mesh({"pp": 4}, backend="sim"))


def test_abstract_stages_take_tensor_split_layers() -> None:
    cfg = _cfg("1f1b", 7)
    mesh = fs.make_mesh({"pp": 4}, backend="abstract")
    specs = llama.param_specs(cfg, mesh)
    params = fs.device_put(fs.eval_shape(llama.init, fs.random.key(0), cfg), mesh, specs)
    assert [params["layers"]["wq"].shards[(r,)].shape[0] for r in range(4)] == [2, 2, 2, 1]
