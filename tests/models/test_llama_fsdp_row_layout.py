"""The Llama's FSDP layout (issue #11): ``fsdp`` splits each weight's outer (row) dim, minor to ``tp`` where both
split it (``P(("tp", "fsdp"), None)``), so what a device gathers over ``fsdp`` is a contiguous block of rows, as
FSDP2's ``Shard(0)``: unpacking a gathered bucket and packing the gradients for the reduce-scatter move whole rows
(before, q/k/v, gate/up, embedding and head split their inner dim over ``fsdp``: every gradient was copied through a
transpose before its bucket's concatenation). A dim that ``tp x fsdp`` does not divide (an odd vocabulary) keeps
``fsdp`` on the inner dim. Checked: the specs, and the loss and every gradient equal to the single-device model's
under sim and dist, with either layout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama
from funcshard.models.llama.sharding import param_shapes

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=64, max_seq_len=16)
ODD = dataclasses.replace(CFG, vocab_size=66)  # 66 = 2 x 33: over tp=2 x fsdp=2 the vocabulary does not split


def _fsdp_dims(cfg: llama.Config, shape: dict[str, int]) -> dict[str, list[int]]:
    """Per leaf path, the dims its spec splits over ``fsdp`` (of one layer: the stacked dim left out)."""
    specs = llama.param_specs(cfg, fs.make_mesh(shape, backend="sim"))
    shapes = dict(fs.pytree.leaves_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size)))
    out = {}
    for path, spec in fs.pytree.leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
        skip = 1 if path.startswith("layers/") else 0
        axes = spec.dim_axes(len(shapes[path]))[skip:]
        out[path] = [d for d, a in enumerate(axes) if "fsdp" in a]
    return out


@pytest.mark.parametrize("shape", [{"fsdp": 4}, {"fsdp": 2, "tp": 2}, {"dp": 2, "fsdp": 2}], ids=str)
def test_fsdp_splits_the_outer_dim(shape: dict[str, int]) -> None:
    dims = _fsdp_dims(CFG, shape)
    assert dims == {p: [0] for p in dims}, dims  # every leaf a block of rows (norms: their one dim)
    specs = llama.param_specs(CFG, fs.make_mesh(shape, backend="sim"))
    if "tp" in shape:  # tp major, fsdp minor: a device's rows lie inside its tp block
        assert specs["embed"] == P(("tp", "fsdp"), None)
        assert specs["layers"]["w1"] == P(None, ("tp", "fsdp"), None)
        assert specs["layers"]["w2"] == P(None, "fsdp", "tp")


def test_odd_vocab_keeps_fsdp_on_the_inner_dim() -> None:
    specs = llama.param_specs(ODD, fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim"))
    assert specs["embed"] == specs["head"] == P("tp", "fsdp")  # 66 rows: 33 per tp block, not 2 x 16.5
    assert specs["layers"]["wq"] == P(None, ("tp", "fsdp"), None)  # the rest as usual
    small = dataclasses.replace(ODD, dim=36, n_heads=6, n_kv_heads=3)  # the inner dim must split: a clear error
    with pytest.raises(fs.ShardingError, match="dim=36 is not divisible by fsdp=8"):
        llama.param_specs(small, fs.make_mesh({"fsdp": 8}, backend="sim"))


def _batch(cfg: llama.Config) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt[0, :5] = -100
    return tok, tgt


def _body(mesh: fs.Mesh, cfg: llama.Config, reshard: bool) -> str:
    cfg = dataclasses.replace(cfg, reshard_after_forward=reshard)
    params = llama.init(fs.random.key(0), cfg)
    tok, tgt = _batch(cfg)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg))(p),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
    )
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    for (path, g), (_, r) in zip(
        fs.pytree.leaves_with_path(fs.device_get(grads)), fs.pytree.leaves_with_path(ref_grads), strict=True
    ):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=path)
    return "ok"


@pytest.mark.parametrize("backend", ["sim", "dist"])
@pytest.mark.parametrize("name", ["rows", "odd_vocab"])
def test_fsdp_tp_llama_equals_the_single_device_model(backend: str, name: str) -> None:
    from _dist_pool import run_body

    cfg = CFG if name == "rows" else ODD
    assert set(run_body(backend, _body, {"fsdp": 2, "tp": 2}, cfg, True)) == {"ok"}


@pytest.mark.dist
def test_fsdp4_keep_equals_the_single_device_model_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _body, {"fsdp": 4}, CFG, False)) == {"ok"}
