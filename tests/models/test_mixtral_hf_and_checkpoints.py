"""The Mixtral's parameters in and out: ``from_hf`` / ``to_hf`` through a saved Hugging Face folder (both expert
layouts, sharded files, bf16), the config and its presets, checkpoints saved at one ``ep`` size restored at another,
a sharded init, the Llama on a mesh with an ``ep`` axis, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama, mixtral, plan_from_mesh

CFG = mixtral.Config(
    vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16, n_experts=4
)


def _equal(a, b) -> None:
    la, lb = fs.pytree.leaves_with_path(a), fs.pytree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), path


@pytest.mark.oracle
@pytest.mark.parametrize("max_shard_bytes", [5_000_000_000, 30_000], ids=["one_file", "sharded"])
def test_to_hf_loads_in_transformers_and_back(tmp_path, max_shard_bytes: int) -> None:
    transformers = pytest.importorskip("transformers")
    params = mixtral.init(fs.random.key(1), CFG)
    mixtral.to_hf(params, CFG, tmp_path, max_shard_bytes=max_shard_bytes)
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(mixtral.forward(params, tokens, CFG), model(tokens).logits, rtol=1e-5, atol=1e-5)
    cfg, back = mixtral.from_hf(tmp_path)
    assert cfg == CFG
    _equal(back, params)  # bit for bit
    model.save_pretrained(tmp_path / "again")  # what transformers writes reads back the same
    cfg2, again = mixtral.from_hf(tmp_path / "again")
    assert cfg2 == CFG
    _equal(again, params)


@pytest.mark.oracle
def test_fused_expert_layout_is_read(tmp_path) -> None:
    """transformers 5's in-memory names (gate_up_proj [E, 2f, d], down_proj, mlp.gate), as a state dict saved as is."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    params = mixtral.init(fs.random.key(2), CFG)
    mixtral.to_hf(params, CFG, tmp_path / "ref")
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "ref")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "fused").mkdir()
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    cfg, back = mixtral.from_hf(tmp_path / "fused")
    assert cfg == CFG
    _equal(back, params)


def test_bf16_on_disk(tmp_path) -> None:
    params = mixtral.init(fs.random.key(3), CFG)
    mixtral.to_hf(params, CFG, tmp_path, dtype=torch.bfloat16)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "mixtral" and hf["torch_dtype"] == "bfloat16" and hf["num_local_experts"] == 4
    _, back = mixtral.from_hf(tmp_path, dtype=None)
    assert back["layers"]["w2"].dtype == torch.bfloat16
    torch.testing.assert_close(back["layers"]["w2"].float(), params["layers"]["w2"], rtol=1e-2, atol=1e-3)


def test_presets() -> None:
    cfg = mixtral.Config.preset("mixtral-8x7b")
    assert (cfg.dim, cfg.n_layers, cfg.n_experts, cfg.experts_per_token, cfg.vocab_size) == (4096, 32, 8, 2, 32000)
    assert cfg.num_params() == 46_702_792_704  # Mixtral 8x7B's published 46.7B
    assert mixtral.Config.preset("mixtral-8x22b").num_params() == 140_630_071_296  # 8x22B's 141B
    assert cfg.active_params() < cfg.num_params() / 3  # 2 of 8 experts a token
    shapes = fs.eval_shape(mixtral.init, fs.random.key(0), cfg)
    assert shapes["layers"]["w1"].shape == (32, 8, 14336, 4096)
    assert mixtral.PRESETS == ("debug", "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b")
    qwen = mixtral.Config.preset("qwen3-30b-a3b")  # Qwen3-30B-A3B: 30.5B, 3.3B active; head 128 at width 2048
    assert (qwen.num_params(), qwen.active_params(), qwen.head_dim, qwen.qk_norm) == (
        30_532_122_624, 3_353_032_704, 128, True,
    )  # fmt: skip
    assert mixtral.Config.preset("qwen3-235b-a22b").num_params() == 235_093_634_560  # Qwen3-235B-A22B
    assert fs.eval_shape(mixtral.init, fs.random.key(0), qwen)["layers"]["q_norm"].shape == (48, 128)
    with pytest.raises(fs.ConfigError, match="no preset named 'llama3-8b'"):
        mixtral.Config.preset("llama3-8b")


def _ckpt_body(mesh: fs.Mesh, path: str, shapes: list[dict[str, int]]) -> str:
    """Params and AdamW state saved on ``mesh``, loaded on each mesh of ``shapes``: the same numbers, the new layout."""
    opt = fs.optim.adamw(1e-2)
    params = mixtral.init(fs.random.key(4), CFG)
    specs = mixtral.param_specs(CFG, mesh)
    p = fs.device_put(params, mesh, specs)
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=opt.state_specs(specs))(p)
    fs.checkpoint.save(path, {"params": p, "opt_state": state})
    for shape in shapes:
        other = fs.make_mesh(shape, backend=mesh.backend)
        specs2 = mixtral.param_specs(CFG, other)
        like = fs.device_put(fs.pytree.tree_map(torch.zeros_like, params), other, specs2)
        like_state = fs.shard_map(opt.init, mesh=other, in_specs=(specs2,), out_specs=opt.state_specs(specs2))(like)
        tree = fs.checkpoint.load(path, {"params": like, "opt_state": like_state})
        assert tree["params"]["layers"]["w1"].spec == specs2["layers"]["w1"]
        _equal(fs.device_get(tree["params"]), params)
    return "ok"


def test_checkpoint_saved_at_ep2_restored_at_ep4_and_ep1(tmp_path) -> None:
    from _dist_pool import run_body

    shapes = [{"ep": 4}, {"ep": 1}, {"fsdp": 2, "tp": 2}]
    assert run_body("sim", _ckpt_body, {"ep": 2}, str(tmp_path / "ck"), shapes) == ["ok"]


def test_sharded_init_draws_each_devices_blocks() -> None:
    params = mixtral.init(fs.random.key(5), CFG)
    mesh = fs.make_mesh({"ep": 2, "tp": 2}, backend="sim")
    specs = mixtral.param_specs(CFG, mesh)
    assert specs["layers"]["w1"] == P(None, "ep", "tp", None) and specs["layers"]["router"] == P(None, None, None)
    sharded = fs.shard_map(lambda k: mixtral.init(k, CFG), mesh=mesh, in_specs=(P(),), out_specs=specs)
    _equal(fs.device_get(sharded(fs.random.key(5))), params)


def _llama_ep_body(mesh: fs.Mesh) -> str:
    """The Llama runs an ep axis as a data axis: the batch split over it, the gradients summed over it."""
    cfg = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    params = llama.init(fs.random.key(0), cfg)
    tok = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = fs.value_and_grad(llama.loss)(params, tok, tok.roll(-1, 1), cfg)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    assert bs == P(("dp", "ep"), None) and specs["layers"]["wq"] == P(None, None, None)
    for check_vma in (True, False):
        f = fs.shard_map(
            lambda p, t, y: llama.value_and_grad(p, t, y, cfg),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
            check_vma=check_vma,
        )
        loss, grads = fs.device_get(f(params, tok, tok.roll(-1, 1)))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for (path, g), (_, r) in zip(fs.pytree.leaves_with_path(grads), fs.pytree.leaves_with_path(ref_grads)):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=path)
    return "ok"


def _remat_body(mesh: fs.Mesh, remat: str, precision: str | None) -> float:
    """value_and_grad on ``mesh`` under ``remat`` / ``precision``: the largest gradient difference to one device."""
    cfg = mixtral.Config.preset("debug", remat=remat, precision=precision)
    params = mixtral.init(fs.random.key(0), cfg)
    tok = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = fs.value_and_grad(mixtral.loss)(params, tok, tok.roll(-1, 1), cfg)
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    step = lambda p, t, y: mixtral.value_and_grad(p, t, y, cfg)  # noqa: E731
    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs))
    loss, grads = fs.device_get(f(params, tok, tok.roll(-1, 1)))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    got, want = fs.pytree.leaves_with_path(grads), fs.pytree.leaves_with_path(ref_grads)
    return max((g - r).abs().max().item() for (_, g), (_, r) in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("shape", "remat", "precision", "tol"),
    [
        ({"fsdp": 2, "ep": 2}, "full", None, 1e-6),  # FSDP's gathers replayed inside the remat region
        ({"ep": 2, "tp": 2}, "selective", None, 1e-6),
        ({"dp": 2, "ep": 2}, "none", "bf16", 2e-3),
    ],
    ids=["fsdp2_ep2-full", "ep2_tp2-selective", "dp2_ep2-bf16"],
)
def test_remat_and_precision_equal_one_device(shape, remat: str, precision: str | None, tol: float) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _remat_body, shape, remat, precision)[0] < tol


def test_llama_on_an_ep_axis_is_data_parallel() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _llama_ep_body, {"dp": 2, "ep": 2}) == ["ok"]


def test_ep_role_of_the_plan() -> None:
    mesh = fs.make_mesh({"data": 2, "experts": 2, "model": 2}, backend="sim")
    plan = plan_from_mesh(mesh, {"dp": "data", "ep": "experts", "tp": "model"})
    assert plan.batch_axes == ("data", "experts") and plan.data_axes == ("data", "experts")
    assert plan.replica_axes == ("data", "experts") and plan.expert_replica_axes == ("data",)
    specs = mixtral.param_specs(CFG, mesh, plan)
    assert specs["layers"]["w2"] == P(None, "experts", None, "model")
    assert mixtral.batch_spec(mesh, plan) == P(("data", "experts"), None)
    with pytest.raises(fs.ConfigError, match="axis 'experts' is given two roles, 'dp' and 'ep'"):
        plan_from_mesh(mesh, {"dp": "experts", "ep": "experts", "tp": "model"})


def test_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(fs.ShardingError, match="n_experts=4 is not divisible by ep=3"):
        mixtral.param_specs(CFG, fs.make_mesh({"ep": 3}, backend="sim"))
    with pytest.raises(fs.ConfigError, match="experts_per_token=5 is more than n_experts=4"):
        mixtral.Config(n_experts=4, experts_per_token=5)
    with pytest.raises(fs.ConfigError, match="router_aux_loss_coef must be a finite number >= 0"):
        mixtral.Config(router_aux_loss_coef=-1.0)
    with pytest.raises(fs.ConfigError, match="sequence_parallel=True is not supported"):
        mixtral.Config(sequence_parallel=True)
    llama.to_hf(llama.init(fs.random.key(0), llama.Config.preset("debug")), llama.Config.preset("debug"), tmp_path)
    with pytest.raises(fs.ConfigError, match=r"reads Mixtral .* and Qwen3-MoE .* folders"):
        mixtral.from_hf(tmp_path)
    params = mixtral.init(fs.random.key(0), CFG)
    params["layers"]["w1"] = params["layers"]["w1"][:, :2]
    with pytest.raises(fs.ConfigError, match="leaf 'w1' has shape \\[2, 2, 48, 32\\], expected \\[2, 4, 48, 32\\]"):
        mixtral.to_hf(params, CFG, tmp_path / "bad")
