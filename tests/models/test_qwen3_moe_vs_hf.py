"""Qwen3-MoE through ``mixtral.from_hf``: a ``Qwen3MoeForCausalLM`` folder (q/k RMSNorm per head, a head size of
its own, ``norm_topk_prob`` either way) against transformers' model (logits, the loss with ``output_router_logits``
and its aux term, every gradient; fp32 rtol 1e-4) on one device, on sim ``ep=2`` alone and beside ``tp``, ``fsdp``,
``pp`` and ``cp``, and on 4 gloo processes ``ep=2 x tp=2``; ``to_hf`` writes a folder transformers loads; greedy
``mixtral.generate`` (the KV-cached decode with the q/k norms) emits transformers' tokens; the configs funcshard
cannot represent (dense layers, a sliding window) are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _moe_hf import check_sharded

import funcshard as fs
from funcshard import P
from funcshard.models import mixtral

pytestmark = pytest.mark.oracle

SIZES = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,  # not hidden_size / heads = 8
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-3,
    "rope_theta": 123.0,
    "router_aux_loss_coef": 0.3,  # large: the load-balancing term weighs in every gradient
}


def _hf_model(norm_topk: bool = False):
    """A random tiny Qwen3MoeForCausalLM (norms, q/k norms included, not all ones)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SIZES, norm_topk_prob=norm_topk)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _data(batch: int = 4, seq: int = 16):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=g)
    labels = tokens.clone()
    labels[0, :9] = -100
    targets = torch.cat([labels[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return tokens, labels, targets


def _reference(model, tokens, labels):
    model.zero_grad()
    out = model(tokens, labels=labels, output_router_logits=True)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hf_grads(grads: dict) -> dict[str, torch.Tensor]:
    """funcshard's gradient tree under transformers 5's in-memory Qwen3-MoE names."""
    attn = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
    out = {"model.embed_tokens.weight": grads["embed"], "model.norm.weight": grads["norm"]}
    out["lm_head.weight"] = grads["head"]
    lay = grads["layers"]
    for i in range(SIZES["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        out[f"{pre}input_layernorm.weight"] = lay["attn_norm"][i]
        out[f"{pre}post_attention_layernorm.weight"] = lay["mlp_norm"][i]
        out |= {f"{pre}self_attn.{v}.weight": lay[k][i] for k, v in attn.items()}
        out[f"{pre}mlp.gate.weight"] = lay["router"][i]
        out[f"{pre}mlp.experts.gate_up_proj"] = torch.cat([lay["w1"][i], lay["w3"][i]], dim=1)
        out[f"{pre}mlp.experts.down_proj"] = lay["w2"][i]
    return out


def _compare(loss, grads, ref_loss, ref_grads, what: str) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6, msg=f"{what} loss")
    got = _hf_grads(grads)
    assert set(got) == set(ref_grads)
    for name, g in got.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{what} {name}")


@pytest.mark.parametrize("norm_topk", [False, True], ids=["raw_topk", "norm_topk"])
def test_one_device_equals_transformers(tmp_path, norm_topk: bool) -> None:
    model = _hf_model(norm_topk)
    model.save_pretrained(tmp_path)
    cfg, params = mixtral.from_hf(tmp_path)
    assert (cfg.qk_norm, cfg.head_dim, cfg.ffn_dim, cfg.norm_topk_prob) == (True, 12, 24, norm_topk)
    tokens, labels, targets = _data()
    ref_logits, ref_loss, ref_grads = _reference(model, tokens, labels)
    torch.testing.assert_close(mixtral.forward(params, tokens, cfg), ref_logits, rtol=1e-4, atol=1e-5)
    loss, grads = fs.value_and_grad(mixtral.loss)(params, tokens, targets, cfg)
    _compare(loss, grads, ref_loss, ref_grads, "one device")


def _sharded_body(mesh: fs.Mesh, tmp: str, check_vma: bool) -> str:
    model = _hf_model()
    cfg, params = mixtral.from_hf(tmp)
    cfg = dataclasses.replace(cfg, pp_microbatches=1)  # with pp: one microbatch, HF's pooling of the whole batch
    tokens, labels, targets = _data()
    ref = _reference(model, tokens, labels)
    return check_sharded(mesh, cfg, params, (tokens, targets), ref, _compare, check_vma)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize(
    "mesh",
    [{"ep": 2}, {"ep": 2, "tp": 2}, {"fsdp": 2, "ep": 2}, {"pp": 2, "ep": 2}, {"cp": 2, "ep": 2}],
    ids=["ep2", "ep2_tp2", "fsdp2_ep2", "pp2_ep2", "cp2_ep2"],
)
def test_sharded_equals_transformers_sim(tmp_path, mesh: dict, check_vma: bool) -> None:
    from _dist_pool import run_body

    _hf_model().save_pretrained(tmp_path)
    assert run_body("sim", _sharded_body, mesh, str(tmp_path), check_vma) == ["ok"]


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_equals_transformers_dist(tmp_path) -> None:
    from _dist_pool import run_body

    _hf_model().save_pretrained(tmp_path)
    assert run_body("dist", _sharded_body, {"ep": 2, "tp": 2}, str(tmp_path), True) == ["ok"] * 4


def test_to_hf_writes_a_folder_transformers_loads(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _hf_model()
    model.save_pretrained(tmp_path / "a")
    cfg, params = mixtral.from_hf(tmp_path / "a")
    mixtral.to_hf(params, cfg, tmp_path / "b")
    cfg2, params2 = mixtral.from_hf(tmp_path / "b")
    assert cfg2 == cfg and torch.equal(params2["layers"]["q_norm"], params["layers"]["q_norm"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    tokens = _data()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"mlp_only_layers": [1]}, "layers [1] have a dense MLP"),
        ({"decoder_sparse_step": 2}, "layers [0] have a dense MLP"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ],
    ids=["mlp_only_layers", "sparse_step", "sliding_window"],
)
def test_what_cannot_be_represented_is_refused(tmp_path, change: dict, says: str) -> None:
    _hf_model().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(fs.ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        mixtral.from_hf(tmp_path)


def _greedy_hf(model, prompts: list[list[int]], new: int) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids, mask = (
        torch.zeros((len(prompts), width), dtype=torch.long),
        torch.zeros((len(prompts), width), dtype=torch.long),
    )
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              eos_token_id=None)  # fmt: skip


@pytest.mark.parametrize("mesh", [None, {"ep": 2, "tp": 2}], ids=["one_device", "ep2_tp2"])
def test_greedy_generate_equals_transformers(tmp_path, mesh: dict | None) -> None:
    """The KV-cached decode with the q/k norms: ``mixtral.generate`` emits transformers' greedy tokens."""
    model = _hf_model(norm_topk=True)
    model.save_pretrained(tmp_path)
    cfg, params = mixtral.from_hf(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (1, 5, 9)]
    if mesh is None:
        got = mixtral.generate(params, prompts, cfg, max_new_tokens=12, pad_id=0)
    else:
        m = fs.make_mesh(mesh, backend="sim")
        specs = mixtral.param_specs(cfg, m)
        f = fs.shard_map(lambda p: mixtral.generate(p, prompts, cfg, max_new_tokens=12, pad_id=0), mesh=m,
                         in_specs=(specs,), out_specs=P())  # fmt: skip
        got = fs.device_get(f(fs.device_put(params, m, specs)))
    assert torch.equal(got, _greedy_hf(model, prompts, 12))
