"""Audit of the models, ops, pipeline and checkpoints against their peers on cases the other tests leave out.

Peers: torch's ``F.scaled_dot_product_attention`` and ``F.cross_entropy`` in float64 (the ops keep float64's
precision, not float32's), transformers' ``LlamaForCausalLM`` (loss over labels with HF's ``-100`` and every
gradient, for one shared k/v head), the plain model for pipelines with odd microbatch counts and fewer
microbatches than stages, and an unsharded AdamW run for a checkpoint saved on one mesh with its optimiser
state and resumed on another.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard.ops import attention, vocab_parallel_cross_entropy

pytestmark = pytest.mark.oracle

# ---------------------------------------------------------------------------------------------- float64 ops


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_with_lse_keeps_float64(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    r = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # GQA: 4 q heads, 1 kv head
    ref_grads = torch.autograd.grad((ref * r).sum(), (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / 8**0.5  # [b, 4, s, d] @ [b, 1, d, s] -> [b, 4, s, s]
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    grads = torch.autograd.grad((out * r).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def _cross_entropy_body(mesh: fs.Mesh, reduction: str) -> str:
    g = torch.Generator().manual_seed(1)
    logits = (10 * torch.randn(3, 5, 8, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 8, (3, 5), generator=g)
    labels[0, :2] = labels[2, 4] = -100  # HF's ignore index
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), logits)

    def local(x: torch.Tensor, y: torch.Tensor, w_: torch.Tensor, axis: str | None) -> tuple:
        x = x.detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, y, axis=axis, reduction=reduction)
        (grad,) = torch.autograd.grad((loss * w_).sum(), x)
        return loss, grad

    loss, grad = local(logits, labels, w, None)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    f = fs.shard_map(
        lambda x, y, w_: local(x, y, w_, "tp"),
        mesh=mesh,
        in_specs=(P(None, None, "tp"), P(), P()),
        out_specs=(P(), P(None, None, "tp")),
    )
    loss, grad = f(logits.detach(), labels, w)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(fs.device_get(loss), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fs.device_get(grad), ref_grad, rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_keeps_float64_sim(reduction: str) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _cross_entropy_body, {"tp": 2}, reduction) == ["ok"]


@pytest.mark.dist
def test_cross_entropy_keeps_float64_dist() -> None:
    from _dist_pool import run_body

    assert run_body("dist", _cross_entropy_body, {"tp": 2}, "mean") == ["ok", "ok"]


# ---------------------------------------------------------------------------------------------- HF Llama

HF_SIZES = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,  # one k/v head shared by every query head
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-3,
    "rope_theta": 123.0,
}


def _hf_folder(tmp_path, tie: bool):
    """A random tiny LlamaForCausalLM (norms not all ones) saved to ``tmp_path``; returns the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _tokens_and_labels(batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, HF labels with -100 spread unevenly over the sequences, and funcshard's targets (shifted)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, HF_SIZES["vocab_size"], (batch, seq), generator=g)
    labels = tokens.clone()
    labels[0, :9] = -100  # a prompt: more ignored tokens in the first sequence (and microbatch, and dp shard)
    labels[batch - 1, -2:] = -100
    targets = torch.cat([labels[:, 1:], torch.full((batch, 1), -100)], dim=1)  # HF shifts inside its loss
    return tokens, labels, targets


def test_float64_logits_equal_transformers(tmp_path) -> None:
    from funcshard.models import llama

    model = _hf_folder(tmp_path, tie=False).double()
    cfg, params = llama.from_hf(tmp_path, dtype=torch.float64)
    tokens, _, _ = _tokens_and_labels()
    with torch.no_grad():
        ref = model(tokens).logits
    got = llama.forward(params, tokens, cfg)
    assert got.dtype == torch.float64 and ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


HF_MESHES = {"single": None, "dp2_cp2": {"dp": 2, "cp": 2}, "fsdp2_pp2": {"fsdp": 2, "pp": 2}}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("mesh_name", sorted(HF_MESHES))
def test_loss_and_grads_equal_transformers_with_ignored_labels(tmp_path, mesh_name: str, tie: bool) -> None:
    from funcshard.models import llama
    from funcshard.models.llama.hf.convert import hf_names

    model = _hf_folder(tmp_path, tie)
    cfg, params = llama.from_hf(tmp_path)
    tokens, labels, targets = _tokens_and_labels()
    out = model(tokens, labels=labels)
    out.loss.backward()
    ref = {name: p.grad for name, p in model.named_parameters()}
    shape = HF_MESHES[mesh_name]
    if shape is None:
        loss, grads = fs.value_and_grad(llama.loss)(params, tokens, targets, cfg)
    else:
        mesh = fs.make_mesh(shape, backend="sim")
        cfg = dataclasses.replace(cfg, pp_microbatches=2)  # pp: microbatches with different counts of -100
        specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
        f = fs.shard_map(
            lambda p, t, y: llama.value_and_grad(p, t, y, cfg),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
        )
        loss, grads = fs.device_get(f(fs.device_put(params, mesh, specs), tokens, targets))
    torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
    for name, leaf, layer in hf_names(cfg):
        got = grads[leaf] if layer is None else grads["layers"][leaf][layer]
        torch.testing.assert_close(got, ref[name], rtol=1e-4, atol=1e-6, msg=f"{mesh_name} {name}")


# ---------------------------------------------------------------------------------------------- pipelines

# odd microbatch counts, fewer microbatches than stages, an odd number of stages
# (tests/pipeline/test_pipeline_run_vs_plain.py
# runs m in (4, 8) on p in (2, 4)); every schedule, each where its own rules allow
PP_ODD = [
    ("gpipe", 4, 1),
    ("1f1b", 4, 3),
    ("1f1b", 3, 5),
    ("interleaved", 3, 3),
    ("zb_h1", 3, 5),
    ("zb_h1", 4, 2),
    ("interleaved_zb", 4, 3),
    ("looped_bfs", 2, 5),
    ("zbv", 4, 3),
    ("zbv", 2, 1),
    ("dualpipev", 3, 7),
]


@pytest.mark.parametrize(("name", "p", "m"), PP_ODD, ids=[f"{n}-p{p}-m{m}" for n, p, m in PP_ODD])
def test_pipeline_odd_and_few_microbatches_equal_plain_model(name: str, p: int, m: int) -> None:
    from _dist_pool import run_body
    from _pipeline_toy import _pipeline_body  # the toy residual-MLP pipeline vs the plain model

    assert run_body("sim", _pipeline_body, {"pp": p}, name, m, True) == ["ok"]


@pytest.mark.dist
def test_pipeline_odd_microbatches_dist() -> None:
    from _dist_pool import run_body
    from _pipeline_toy import _pipeline_body

    assert run_body("dist", _pipeline_body, {"pp": 2}, "zb_h1", 3, True) == ["ok", "ok"]


@pytest.mark.parametrize("p", [2, 3, 5])
def test_bubble_with_fewer_microbatches_than_stages(p: int) -> None:
    from funcshard.pipeline import gpipe, one_f_one_b

    for m in range(1, p):
        bubble = (p - 1) / (m + p - 1)  # F = 1, B = 2: idle time over the makespan 3 (m + p - 1)
        g, o = gpipe(p, m).simulate(), one_f_one_b(p, m).simulate()
        assert g.bubble_fraction == pytest.approx(bubble) and o.bubble_fraction == pytest.approx(bubble)
        assert g.makespan == o.makespan == pytest.approx(3 * (m + p - 1))
        assert g.peak_in_flight == [m] * p and o.peak_in_flight == [min(p - s, m) for s in range(p)]


# ---------------------------------------------------------------------------------------------- checkpoints


def _llama_adamw_setup():
    """(cfg, opt, params, tokens, targets) of a small Llama and AdamW with weight decay."""
    from funcshard.models import llama

    cfg = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (4, 16), generator=g)
    return cfg, opt, llama.init(fs.random.key(0), cfg), tokens, tokens.roll(-1, dims=1)


def _sharded_step(mesh: fs.Mesh, cfg, opt):
    """``(step, init_state, specs, state_specs)``: one AdamW step of the Llama, shard_map'd over ``mesh``."""
    from funcshard.models import llama

    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    sspecs = opt.state_specs(specs)

    def step(p, s, t, y):
        loss, grads = llama.value_and_grad(p, t, y, cfg)
        return (loss, *opt.update(grads, s, p))

    f = fs.shard_map(step, mesh=mesh, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs))
    return f, fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs), specs


def _resume_on_other_mesh_body(mesh: fs.Mesh, path: str, other_shape: dict[str, int]) -> tuple:
    cfg, opt, params, tokens, targets = _llama_adamw_setup()
    step, init, specs = _sharded_step(mesh, cfg, opt)
    p = fs.device_put(params, mesh, specs)
    _, p, s = step(p, init(p), tokens, targets)
    fs.checkpoint.save(path, {"params": p, "opt_state": s, "step": 1})
    saved = fs.device_get((p, s))
    other = fs.make_mesh(other_shape, backend=mesh.backend)
    step2, init2, specs2 = _sharded_step(other, cfg, opt)
    like_p = fs.device_put(fs.pytree.tree_map(torch.zeros_like, params), other, specs2)
    tree = fs.checkpoint.load(path, {"params": like_p, "opt_state": init2(like_p), "step": 0})
    assert tree["step"] == 1 and tree["params"]["layers"]["wq"].mesh == other
    assert tree["opt_state"].mu["layers"]["wq"].spec == specs2["layers"]["wq"]
    loaded = fs.device_get((tree["params"], tree["opt_state"]))
    _assert_equal_trees(loaded, saved)  # params, both moments and the step count, bit for bit
    # the next step from the loaded state is the step from the saved state laid out on the other mesh
    direct = step2(*fs.device_put(saved, other, (specs2, opt.state_specs(specs2))), tokens, targets)
    loss, p2, s2 = step2(tree["params"], tree["opt_state"], tokens, targets)
    _assert_equal_trees(fs.device_get((loss, p2, s2)), fs.device_get(direct))
    return fs.device_get(loss), fs.device_get(s2.count)


def _assert_equal_trees(a, b) -> None:
    la, lb = fs.pytree.leaves_with_path(a), fs.pytree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), path


def test_resume_with_optimizer_state_on_another_mesh(run, backend: str, tmp_path) -> None:
    from funcshard.models import llama

    cfg, opt, params, tokens, targets = _llama_adamw_setup()
    p, s = params, opt.init(params)
    for _ in range(2):  # the unsharded run: the loss of its second step
        loss, grads = fs.value_and_grad(llama.loss)(p, tokens, targets, cfg)
        p, s = opt.update(grads, s, p)
    # sim: dp2 x tp2 -> fsdp2 x cp2; dist (fewer processes to start): tp2 -> fsdp2
    a, b = ({"dp": 2, "tp": 2}, {"fsdp": 2, "cp": 2}) if backend == "sim" else ({"tp": 2}, {"fsdp": 2})
    for got_loss, count in run(_resume_on_other_mesh_body, a, str(tmp_path / "ck"), b):
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
        assert int(count) == 2


# ---------------------------------------------------------------------------------------------- Llama 3.1 RoPE

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# head_dim 8, theta 123: wavelengths 6.3, 21, 70 and 233 against 16 / 4 and 16 / 1: one pair blended, three scaled
LLAMA3_SIZES = {**HF_SIZES, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _llama3_model(tmp_path, original: int | None = 16):
    transformers = pytest.importorskip("transformers")
    scaling = {**LLAMA3} if original is None else {**LLAMA3, "original_max_position_embeddings": original}
    torch.manual_seed(1)
    conf = transformers.LlamaConfig(**LLAMA3_SIZES, rope_scaling=scaling)
    model = transformers.LlamaForCausalLM(conf).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("original", [16, None], ids=["original16", "original_absent"])
def test_llama3_rope_scaling_equals_transformers(tmp_path, original: int | None) -> None:
    from funcshard.models import llama

    model = _llama3_model(tmp_path, original)
    cfg, params = llama.from_hf(tmp_path)
    want = 16 if original is not None else 64  # transformers: the context length when the field is absent
    assert cfg.rope_scaling == llama.RopeScaling(8.0, 1.0, 4.0, want)
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(4))  # past 16 positions
    with torch.no_grad():
        ref = model(tokens).logits
    got = llama.forward(params, tokens, cfg)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    plain = llama.forward(params, tokens, dataclasses.replace(cfg, rope_scaling=None))
    assert (plain - ref).abs().max() > 1e-2  # the scaling changes the numbers: the check above can fail


def test_llama3_rope_scaling_sharded_loss_and_grads(tmp_path) -> None:
    from funcshard.models import llama
    from funcshard.models.llama.hf.convert import hf_names

    model = _llama3_model(tmp_path)
    cfg, params = llama.from_hf(tmp_path)
    tokens, labels, targets = _tokens_and_labels(seq=32)
    out = model(tokens, labels=labels)
    out.loss.backward()
    ref = {name: p.grad for name, p in model.named_parameters()}
    mesh = fs.make_mesh({"cp": 2, "tp": 2}, backend="sim")  # cp: RoPE at this device's (traced) offset
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    loss, grads = fs.device_get(f(fs.device_put(params, mesh, specs), tokens, targets))
    torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
    for name, leaf, layer in hf_names(cfg):
        got = grads[leaf] if layer is None else grads["layers"][leaf][layer]
        torch.testing.assert_close(got, ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_llama3_rope_scaling_to_hf_and_back(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from funcshard.models import llama

    cfg = llama.Config(96, 32, 2, 4, 2, 48, 64, rope_theta=123.0, rope_scaling=llama.RopeScaling(8.0, 1.0, 4.0, 16))
    params = llama.init(fs.random.key(2), cfg)
    llama.to_hf(params, cfg, tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(llama.forward(params, tokens, cfg), model(tokens).logits, rtol=1e-6, atol=1e-6)
    assert llama.from_hf(tmp_path)[0] == cfg
    assert llama.Config(**dataclasses.asdict(cfg)) == cfg  # a checkpoint's metadata gives the config back


def test_llama3_rope_scaling_errors(tmp_path) -> None:
    from funcshard.models import llama
    from funcshard.models.llama.hf.config import config_from_hf

    hf = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    hf |= {"num_attention_heads": 4, "vocab_size": 96}
    with pytest.raises(fs.ConfigError, match=r"type 'llama3'.*missing \['factor'\]"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4}})
    with pytest.raises(fs.ConfigError, match=r"high_freq_factor \(1\.0\) must be greater than low_freq_factor"):
        config_from_hf({**hf, "rope_parameters": {**LLAMA3, "high_freq_factor": 1.0, "rope_theta": 5e5}})
    with pytest.raises(fs.ConfigError, match=r"type 'yarn'"):
        config_from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}})
    with pytest.raises(fs.ConfigError, match=r"rope_scaling must be a RopeScaling"):
        llama.Config(rope_scaling=8.0)


# ---------------------------------------------------------------------------------------------- to_hf under dist


def _to_hf_then_read_body(mesh: fs.Mesh, path: str) -> list[bool]:
    from funcshard.models import llama

    cfg = llama.Config(96, 32, 2, 4, 2, 48, 64)
    params = llama.init(fs.random.key(2), cfg)
    sharded = fs.device_put(params, mesh, llama.param_specs(cfg, mesh))
    same = []
    for i in range(3):  # each folder read by every process right after the save: no process reads a partial one
        llama.to_hf(sharded, cfg, f"{path}/{i}", max_shard_bytes=20_000)
        back = llama.from_hf(f"{path}/{i}")[1]
        same.append(all(torch.equal(back["layers"][k], params["layers"][k]) for k in params["layers"]))
    return same


@pytest.mark.dist
def test_to_hf_under_dist_is_read_back_by_every_process(tmp_path) -> None:
    from _dist_pool import run_body

    assert run_body("dist", _to_hf_then_read_body, {"tp": 2}, str(tmp_path)) == [[True] * 3] * 2


def test_null_config_fields_read_as_transformers_does() -> None:
    transformers = pytest.importorskip("transformers")
    from funcshard.models.llama.hf.config import config_from_hf

    hf = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4}
    hf |= {"vocab_size": 96, "num_key_value_heads": None}
    ref = transformers.LlamaConfig(**hf)
    assert config_from_hf({"model_type": "llama", **hf}).n_kv_heads == ref.num_key_value_heads == 4


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("rope_theta", 0.0, "rope_theta must be a finite number > 0, found 0.0"),  # RoPE of infinite frequencies
        ("rope_theta", float("nan"), "rope_theta must be a finite number > 0, found nan"),
        ("norm_eps", -1e-5, "norm_eps must be a finite number >= 0"),  # rsqrt of a negative: NaN
        ("tie_embeddings", "no", "tie_embeddings must be True or False, found 'no'"),  # a truthy string: tied
    ],
)
def test_config_refuses_values_that_compute_garbage(field: str, value: object, needle: str) -> None:
    from funcshard.models import llama

    with pytest.raises(fs.ConfigError, match=re.escape(needle)):
        llama.Config(**{field: value})


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention in q's dtype, grouped-query (jvp-able, unlike SDPA's fused CPU kernel)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # [b, h, s, d] @ [b, h, d, s] -> [b, h, s, s]
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v  # [b, h, s, s] @ [b, h, s, d] -> [b, h, s, d]


def test_ring_attention_under_vmap_and_jvp_keeps_float64() -> None:
    from funcshard.ops import ring_attention, zigzag_indices, zigzag_inverse_indices

    g = torch.Generator().manual_seed(6)
    q, tq = (torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64) for _ in "qt")
    k, v = (torch.randn(2, 1, 16, 8, generator=g, dtype=torch.float64) for _ in "kv")
    zz, inv, spec = zigzag_indices(16, 2), zigzag_inverse_indices(16, 2), P(None, None, "cp")

    def inner(q, k, v, tq):  # transforms the ring's Function has no rule for: autograd through the ring
        out = torch.vmap(lambda q, k, v: ring_attention(q[None], k[None], v[None])[0])(q, k, v)
        return out, torch.func.jvp(lambda q: ring_attention(q, k, v), (q,), (tq,))[1]

    mesh = fs.make_mesh({"cp": 2}, backend="sim")
    f = fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))
    out, tangent = (fs.device_get(t).index_select(2, inv) for t in f(*(t.index_select(2, zz) for t in (q, k, v, tq))))
    ref, ref_tangent = torch.func.jvp(lambda q: _softmax_attention(q, k, v), (q,), (tq,))
    assert out.dtype == tangent.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)  # float32 inside: 1e-7 off
    torch.testing.assert_close(tangent, ref_tangent, rtol=1e-11, atol=1e-11)


def test_int32_targets_on_every_mesh() -> None:
    """Token ids as int32 (what tokenizers and funcshard's data give): the same loss with or without a tp axis
    (F.cross_entropy alone takes int64 only; the sharded path took int32 already)."""
    from funcshard.models import llama

    cfg = llama.Config(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    params = llama.init(fs.random.key(0), cfg)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    targets = tokens.roll(-1, 1)
    targets[0, :3] = -100
    want = llama.loss(params, tokens.long(), targets.long(), cfg)
    torch.testing.assert_close(llama.loss(params, tokens, targets, cfg), want, rtol=0, atol=0)
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(lambda p, t, y: llama.loss(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=P())
    torch.testing.assert_close(fs.device_get(f(params, tokens, targets)), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- transforms


def test_attention_under_jvp_hessian_and_grad_of_grad() -> None:
    """SDPA's fused CPU kernel has no forward-mode rule and no double backward: torch.func.jvp, hessian and
    grad-of-grad of ops.attention raised NotImplementedError; now equal to the written-out softmax."""
    g = torch.Generator().manual_seed(8)
    q, t = (torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64) for _ in "qt")
    k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in "kv")

    def square(fn):  # a scalar of q, through attention
        return lambda q: fn(q, k, v).pow(2).sum()

    fs_attn = lambda q, k, v: attention(q, k, v, causal=True)  # noqa: E731
    out, tangent = torch.func.jvp(lambda q: fs_attn(q, k, v), (q,), (t,))
    ref, ref_tangent = torch.func.jvp(lambda q: _softmax_attention(q, k, v), (q,), (t,))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tangent, ref_tangent, rtol=1e-12, atol=1e-12)
    hvp = torch.func.hessian(square(fs_attn))(q)
    torch.testing.assert_close(hvp, torch.func.hessian(square(_softmax_attention))(q), rtol=1e-10, atol=1e-10)
    gg = torch.func.grad(lambda q: torch.func.grad(square(fs_attn))(q).sum())(q)
    ref_gg = torch.func.grad(lambda q: torch.func.grad(square(_softmax_attention))(q).sum())(q)
    torch.testing.assert_close(gg, ref_gg, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # no transform: SDPA itself, as before
        assert torch.equal(
            attention(q, k, v), F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
        )


def _llama_jvp_body(mesh: fs.Mesh) -> tuple[float, float]:
    """(jvp of llama.loss inside shard_map over ``mesh``, the unsharded gradient dotted with the tangent)."""
    from funcshard.models import llama

    cfg = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    params = fs.pytree.tree_map(lambda x: x.double(), llama.init(fs.random.key(0), cfg))
    g = torch.Generator().manual_seed(9)
    tangent = fs.pytree.tree_map(lambda x: torch.randn(x.shape, generator=g, dtype=x.dtype), params)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    targets = tokens.roll(-1, 1)
    _, grads = fs.value_and_grad(llama.loss)(params, tokens, targets, cfg)
    leaves = lambda tree: [x for _, x in fs.pytree.leaves_with_path(tree)]  # noqa: E731
    want = sum((a * b).sum() for a, b in zip(leaves(grads), leaves(tangent), strict=True))
    jvp = lambda p, t, x, y: torch.func.jvp(lambda p: llama.loss(p, x, y, cfg), (p,), (t,))[1]  # noqa: E731
    torch.testing.assert_close(jvp(params, tangent, tokens, targets), want, rtol=1e-5, atol=0)  # RMSNorm in fp32
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(jvp, mesh=mesh, in_specs=(specs, specs, bs, bs), out_specs=P())
    return fs.device_get(f(params, tangent, tokens, targets)).item(), want.item()


@pytest.mark.parametrize("shape", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2"])
def test_llama_jvp_is_the_gradient_along_the_tangent(run, shape: dict[str, int]) -> None:
    """torch.func.jvp of llama.loss (forward-mode, as jax.jvp), unsharded and inside shard_map, equals the
    reverse-mode gradient dotted with the tangent."""
    for got, want in run(_llama_jvp_body, shape):
        assert got == pytest.approx(want, rel=1e-5)
