"""KV heads replicated over ``tp`` where it exceeds ``n_kv_heads`` (issue #31, pretrained GQA models on wide tp):
``wk`` / ``wv`` held whole on every tp device, each device using the kv head its query heads group with
(``axis_index(tp) // (tp / n_kv_heads)``, as torchtitan and Megatron replicate them). Loss and every gradient equal
the single-device reference (sim, both vma modes, and one dist case), with dp, fsdp, sequence parallelism, pp and
cp too; the Mixtral / Qwen3-MoE block; a Hugging Face ``LlamaForCausalLM`` with 2 kv heads loaded sharded on tp=4;
greedy generation and the KV cache; checkpoints between the replicated and the split layouts; the planner; and the
head counts a tp size cannot split."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama, mixtral

CFG = llama.Config(vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
#: mesh, n_kv_heads, sequence parallel
CASES = {
    "tp4_kv2": ({"tp": 4}, 2, False),
    "dp2_tp4_kv2": ({"dp": 2, "tp": 4}, 2, False),
    "tp2_kv1": ({"tp": 2}, 1, False),
    "fsdp2_tp4_sp_kv2": ({"fsdp": 2, "tp": 4}, 2, True),
    "fsdp2_tp4_kv1": ({"fsdp": 2, "tp": 4}, 1, False),
    "pp2_tp4_kv2": ({"pp": 2, "tp": 4}, 2, False),
    "cp2_tp4_kv2": ({"cp": 2, "tp": 4}, 2, False),
}


def _batch(cfg: llama.Config, batch: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return tok, tgt


def _assert_trees_close(got: object, ref: object) -> None:
    pairs = zip(fs.pytree.leaves_with_path(got), fs.pytree.leaves_with_path(ref), strict=True)
    for (path, a), (_, r) in pairs:
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=path)


def _llama_body(mesh: fs.Mesh, n_kv: int, sp: bool, check_vma: bool) -> str:
    cfg = dataclasses.replace(CFG, n_kv_heads=n_kv, sequence_parallel=sp)
    key = fs.random.key(0)
    params = llama.init(key, cfg)
    tok, tgt = _batch(cfg)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    for name in ("wk", "wv"):  # replicated over tp (fsdp on the rows where there is one)
        assert "tp" not in specs["layers"][name].axes, specs["layers"][name]
    assert "tp" in specs["layers"]["wq"].axes

    def step(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return llama.value_and_grad(p, t, y, cfg)  # (with pp: the schedule; else fs.value_and_grad of llama.loss)

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs), check_vma=check_vma)
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    _assert_trees_close(fs.device_get(grads), ref_grads)
    sharded = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)(key)
    assert all(
        torch.equal(a, b) for a, b in zip(optree.tree_leaves(fs.device_get(sharded)), optree.tree_leaves(params))
    )
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kv_replicated_loss_and_grads_equal_single_device_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape, n_kv, sp = CASES[name]
    assert run_body("sim", _llama_body, shape, n_kv, sp, check_vma) == ["ok"]


@pytest.mark.dist
def test_kv_replicated_tp4_on_four_gloo_processes() -> None:
    from _dist_pool import run_body

    shape, n_kv, sp = CASES["tp4_kv2"]
    assert run_body("dist", _llama_body, shape, n_kv, sp, True) == ["ok"] * 4


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_qwen3_moe_block_with_kv_replicated_on_ep2_tp4(check_vma: bool) -> None:
    """The Mixtral / Qwen3-MoE layer shares the transformer block: 2 kv heads (with Qwen3's q/k norms) on tp=4;
    loss, gradients and greedy generation equal single device."""
    cfg = mixtral.Config(
        vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=32, max_seq_len=16, n_experts=4,
        head_size=8, qk_norm=True, router_aux_loss_coef=0.01,
    )  # fmt: skip
    params = mixtral.init(fs.random.key(1), cfg)
    tok, tgt = _batch(cfg)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: mixtral.loss(p, tok, tgt, cfg))(params)
    mesh = fs.make_mesh({"ep": 2, "tp": 4}, backend="sim")
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    assert specs["layers"]["wk"] == P(None, None, None) and specs["layers"]["wq"] == P(None, "tp", None)
    f = fs.shard_map(
        lambda p, t, y: fs.value_and_grad(lambda p: mixtral.loss(p, t, y, cfg))(p),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    placed = fs.device_put(params, mesh, specs)
    loss, grads = f(placed, tok, tgt)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    _assert_trees_close(fs.device_get(grads), ref_grads)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    gen = fs.shard_map(
        lambda p: mixtral.generate(p, prompts, cfg, max_new_tokens=6), mesh=mesh, in_specs=(specs,), out_specs=P()
    )
    assert torch.equal(fs.device_get(gen(placed)), mixtral.generate(params, prompts, cfg, max_new_tokens=6))


HF_SIZES = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A random tiny LlamaForCausalLM with 8 query heads and 2 kv heads, and its folder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("hf_kv2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.mark.oracle
def test_hf_kv2_loaded_sharded_on_tp4_equals_transformers_logits(hf: tuple[object, Path]) -> None:
    model, folder = hf
    mesh = fs.make_mesh({"tp": 4}, backend="sim")
    cfg, arrays = llama.from_hf(folder, mesh=mesh)  # each device's blocks read from the safetensors
    assert cfg.n_kv_heads == 2 and arrays["layers"]["wk"].spec == P(None, None, None)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    f = fs.shard_map(
        lambda p, t: llama.forward(p, t, cfg), mesh=mesh, in_specs=(llama.param_specs(cfg, mesh), P()),
        out_specs=P(None, None, "tp"),
    )  # fmt: skip
    with torch.no_grad():
        ref = model(tokens).logits
    torch.testing.assert_close(fs.device_get(f(arrays, tokens)), ref, atol=1e-5, rtol=1e-5)
    out = folder.parent / "kv2_back"
    llama.to_hf(fs.device_get(arrays), cfg, out)  # and back: the same tensors
    _, again = llama.from_hf(out)
    _assert_trees_close(again, fs.device_get(arrays))


@pytest.mark.oracle
def test_greedy_generate_on_tp4_equals_single_device_and_transformers(hf: tuple[object, Path]) -> None:
    model, folder = hf
    cfg, params = llama.from_hf(folder)
    prompts = [[5, 17, 3], [9], [40, 41, 42, 43, 44]]
    single = llama.generate(params, prompts, cfg, max_new_tokens=12)
    mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="sim")
    specs = llama.param_specs(cfg, mesh)
    f = fs.shard_map(
        lambda p: llama.generate(p, prompts, cfg, max_new_tokens=12), mesh=mesh, in_specs=(specs,), out_specs=P("dp")
    )
    sharded = fs.device_get(f(fs.device_put(params, mesh, specs)))[: len(prompts)]
    assert torch.equal(sharded, single)
    ids = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, 5 - len(p) :], mask[r, 5 - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert torch.equal(single, ref)
    assert len(set(ref[:, 5:].flatten().tolist())) > 4  # not one token repeated


def test_each_tp_device_caches_its_one_kv_head() -> None:
    """The decoder on tp=4 with 2 kv heads: a cache of one kv head per device, and that head's keys (device 2 and 3
    use kv head 1): the step's keys equal the unsharded projection's rows of that head."""
    from funcshard.models.llama.generate import decoder
    from funcshard.models.transformer import kv_weights

    mesh = fs.make_mesh({"tp": 4}, backend="sim")
    specs = llama.param_specs(CFG, mesh)
    params = llama.init(fs.random.key(5), CFG)
    plan = fs.models.plan_from_mesh(mesh)

    def body(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
        lay = {k: v[0] for k, v in p["layers"].items()}
        wk, _ = kv_weights(lay["wk"], lay["wv"], plan, CFG.head_dim, kv_shared=2)  # [hd, d]
        return torch.tensor([decoder(p, CFG, plan).kv_heads]), wk

    heads, rows = fs.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(P(), P("tp")))(
        fs.device_put(params, mesh, specs)
    )
    assert fs.device_get(heads).tolist() == [1]
    hd, wk = CFG.head_dim, params["layers"]["wk"][0]  # [2 hd, d]: kv heads 0 and 1
    want = torch.cat([wk[:hd], wk[:hd], wk[hd:], wk[hd:]])  # devices 0, 1 -> head 0; devices 2, 3 -> head 1
    assert torch.equal(fs.device_get(rows), want)


def test_checkpoint_moves_between_replicated_and_split_kv_layouts(tmp_path: Path) -> None:
    """Saved on tp=4 (kv replicated), loaded on tp=2 (kv split by heads) and on fsdp=2 x tp=4, and back."""
    params = llama.init(fs.random.key(2), CFG)
    meshes = [fs.make_mesh(s, backend="sim") for s in ({"tp": 4}, {"tp": 2}, {"fsdp": 2, "tp": 4})]
    specs = [llama.param_specs(CFG, m) for m in meshes]
    assert specs[1]["layers"]["wk"] == P(None, "tp", None) and specs[2]["layers"]["wk"] == P(None, "fsdp", None)
    for i, (m, s) in enumerate(zip(meshes, specs, strict=True)):
        fs.checkpoint.save(str(tmp_path / f"c{i}"), fs.device_put(params, m, s))
    for i in range(3):
        j = (i + 1) % 3
        like = fs.device_put(optree.tree_map(torch.zeros_like, params), meshes[j], specs[j])
        got = fs.checkpoint.load(str(tmp_path / f"c{i}"), like)
        assert got["layers"]["wk"].spec == specs[j]["layers"]["wk"]
        _assert_trees_close(fs.device_get(got), params)


def test_planner_counts_the_replicated_kv_weights_and_considers_tp4() -> None:
    from funcshard.job.cli import plan_parser
    from funcshard.job.plan.estimate import lowered_step, plan_config
    from funcshard.job.plan.search import candidates

    argv = ["--dim", "64", "--layers", "2", "--heads", "8", "--kv-heads", "2", "--ffn", "64", "--seq", "16"]
    args = plan_parser().parse_args([*argv, "--batch", "4", "--hardware", "h100"])
    cfg = plan_config(args)
    shape = {"fsdp": 2, "tp": 4}
    mem = lowered_step(args, cfg, shape).memory_analysis(device=0)
    mesh = fs.make_mesh(shape, backend="sim")
    real = fs.device_put(llama.init(fs.random.key(0), cfg), mesh, llama.param_specs(cfg, mesh))
    held = sum(a.shards[(0, 0)].numel() * a.shards[(0, 0)].element_size() for a in optree.tree_leaves(real))
    assert mem["params"] == held
    d, v, n, kv_rows = cfg.dim, cfg.vocab_size, cfg.n_layers, cfg.n_kv_heads * cfg.head_dim
    # per device, fp32: embedding and head over tp x fsdp, norms over fsdp, wq / wo / MLP over tp x fsdp, and wk / wv
    # whole over tp, their rows over fsdp (split by heads over tp, they would be a quarter of that)
    layer = 2 * d / 2 + (2 * d * d + 3 * cfg.ffn_dim * d) / 8 + 2 * kv_rows * d / 2
    assert held == 4 * (2 * v * d / 8 + d / 2 + n * layer)
    assert {"tp": 4} in candidates(args, 4) and {"tp": 8} in candidates(args, 8)


@pytest.mark.parametrize(
    ("heads", "shape", "match"),
    [
        ((8, 2), {"tp": 3}, r"n_heads=8 is not divisible by tp=3; choose tp dividing n_heads .*n_kv_heads=2"),
        ((8, 2), {"tp": 16}, r"n_heads=8 is not divisible by tp=16"),
        ((12, 3), {"tp": 4}, r"tp=4 is more than n_kv_heads=3 but not a multiple of it \(n_heads=12\)"),
        ((12, 6), {"tp": 4}, r"n_kv_heads=6 is not divisible by tp=4; choose tp dividing n_kv_heads, or a multiple"),
    ],
)
def test_head_counts_tp_cannot_split_are_refused(heads: tuple[int, int], shape: dict[str, int], match: str) -> None:
    cfg = dataclasses.replace(CFG, dim=48, n_heads=heads[0], n_kv_heads=heads[1])
    with pytest.raises(fs.ShardingError, match=match):
        llama.param_specs(cfg, fs.make_mesh(shape, backend="sim"))
    assert not llama.sharding.heads_fit(cfg, shape["tp"])
