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
from funcshard.models import llama, plan_from_mesh
from funcshard.models.llama.sharding import pipeline_schedule
from funcshard.pipeline import chunk_layers

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


def test_layer_split_and_fewer_layers_than_stages() -> None:
    """The virtual stages' layer counts (tensor_split in virtual-stage order), and the one layout that stays a
    ConfigError: fewer layers than physical stages."""
    mesh2, mesh4 = fs.make_mesh({"pp": 2}, backend="sim"), fs.make_mesh({"pp": 4}, backend="sim")
    sched = pipeline_schedule(_cfg("interleaved", 7), plan_from_mesh(mesh2))  # virtual stages 2, 2, 2, 1
    assert chunk_layers(sched, 7) == ((2, 2), (2, 1))
    sched = pipeline_schedule(_cfg("zbv", 7), plan_from_mesh(mesh4))  # V: stage 0 holds 0 and the empty 7
    assert chunk_layers(sched, 7) == ((1, 0), (1, 1), (1, 1), (1, 1))
    for schedule in ("interleaved", "zbv", "dualpipev"):
        with pytest.raises(fs.ConfigError, match=r"n_layers=3 is fewer than the pp=4 stages: .* n_layers >= 4"):
            llama.param_specs(_cfg(schedule, 3), mesh4)


def test_abstract_plan_of_an_uneven_interleaved_layout_counts_what_sim_sends() -> None:
    """``plan`` (the train step on an abstract mesh) of 7 layers on pp=2 x 2 chunks: the stages' blocks are the
    tensor_split blocks, and the collectives it counts are those a sim step sends."""
    from funcshard.job.cli import plan_parser
    from funcshard.job.plan import estimate
    from funcshard.job.plan.command import resolve_defaults
    from funcshard.job.step import build_step

    flags = "--dim 32 --layers 7 --heads 4 --kv-heads 2 --ffn 64 --seq 16 --batch 8 --mesh pp=2,fsdp=2"
    args = resolve_defaults(plan_parser().parse_args([*flags.split(), "--schedule", "interleaved"]))
    e = estimate(args)
    assert e.cfg.n_layers == 7 and e.fits and e.memory["params"] > 0
    mesh = fs.make_mesh({"pp": 2, "fsdp": 2}, backend="sim")
    step = build_step(args, e.cfg, mesh)
    params = fs.device_put(llama.init(fs.random.key(0), e.cfg), mesh, step.specs)
    assert [params["layers"]["wq"].shards[(r, 0)].shape[0] for r in range(2)] == [4, 3]
    x = fs.device_put(torch.randint(0, e.cfg.vocab_size, (8, 16)), mesh, step.batch_spec)
    with fs.comm_stats() as stats:
        step.step(params, step.opt_init(params), x, x)
    assert e.comm_rows == stats.rows()


def _mixtral_body(mesh: fs.Mesh) -> str:
    """The Mixtral shares the Llama's pipeline: its router statistics ride with the activation through the empty
    last virtual stage of 3 layers on pp=2 x 2 chunks (zbv: stage 0 holds virtual stages 0 and 3)."""
    from funcshard.models import mixtral

    cfg = mixtral.Config.preset("debug", pp_microbatches=1, n_layers=3, pp_schedule="zbv")  # one microbatch: HF's aux
    params = mixtral.init(fs.random.key(0), cfg)
    tok = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = fs.value_and_grad(mixtral.loss)(params, tok, tok, cfg)
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)

    def step(p, t, y):
        return mixtral.value_and_grad(p, t, y, cfg)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs))
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tok)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    for (path, a), (_, r) in zip(
        fs.pytree.leaves_with_path(fs.device_get(grads)), fs.pytree.leaves_with_path(ref_grads), strict=True
    ):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)
    return "ok"


def test_mixtral_aux_through_an_empty_virtual_stage_sim() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _mixtral_body, {"pp": 2}) == ["ok"]


def _sharded_init_body(mesh: fs.Mesh, layers: int) -> str:
    """``llama.init`` inside shard_map draws each stage's block of an uneven layer stack, unit norms included (a
    stage holding fewer layers gets fewer norm rows): equal to the unsharded init."""
    cfg = _cfg("interleaved", layers)
    specs = llama.param_specs(cfg, mesh)
    got = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(fs.random.key(0))
    ref = llama.init(fs.random.key(0), cfg)
    for (path, a), (_, r) in zip(
        fs.pytree.leaves_with_path(fs.device_get(got)), fs.pytree.leaves_with_path(ref), strict=True
    ):
        assert torch.equal(a, r), path
    stage = mesh.axis_names.index("pp")
    want = [t.shape[0] for t in torch.tensor_split(torch.empty(layers), mesh.shape["pp"])]
    assert {c[stage]: b.shape[0] for c, b in got["layers"]["attn_norm"].shards.items()} == dict(enumerate(want))
    return "ok"


def test_sharded_init_of_an_uneven_layer_stack_sim() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _sharded_init_body, {"pp": 4, "fsdp": 2}, 7) == ["ok"]


def test_sharded_init_of_an_uneven_layer_stack_abstract() -> None:
    cfg = _cfg("zbv", 7)
    mesh = fs.make_mesh({"pp": 4}, backend="abstract")
    specs = llama.param_specs(cfg, mesh)
    got = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(fs.random.key(0))
    for name in ("attn_norm", "mlp_norm", "wq"):
        assert [got["layers"][name].shards[(r,)].shape[0] for r in range(4)] == [2, 2, 2, 1], name
