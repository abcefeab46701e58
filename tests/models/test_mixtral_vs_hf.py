"""The Mixtral against transformers' ``MixtralForCausalLM``: logits, the loss with ``output_router_logits=True``
(its load-balancing term included) and every gradient (fp32, rtol 1e-4) on one device and on simulated meshes with
``ep`` alone and beside ``tp``, ``fsdp``, ``dp``, ``pp`` and ``cp``, with ``check_vma`` on and off; under dist (gloo, 4
processes) ``ep=2 x dp=2`` and ``ep=2 x tp=2``; a skewed router (most tokens to one expert, dropless) too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _moe_hf import check_sharded

import funcshard as fs
from funcshard.models import mixtral

pytestmark = pytest.mark.oracle

SIZES = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-3,
    "rope_theta": 123.0,
    "router_aux_loss_coef": 0.3,  # large: the load-balancing term weighs in every gradient
}


def _hf_model(skew: float = 0.0):
    """A random tiny MixtralForCausalLM (norms not all ones); ``skew`` routes most tokens to expert 0 (a large first
    feature in every embedding, weighed by expert 0's router row)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SIZES)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        if skew:
            model.model.embed_tokens.weight[:, 0] += 3.0
            for layer in model.model.layers:
                layer.mlp.gate.weight[0, 0] += skew
    return model


def _data(batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, HF labels (some -100) and funcshard's targets (shifted, as HF shifts inside its loss)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=g)
    labels = tokens.clone()
    labels[0, :9] = -100
    labels[batch - 1, -2:] = -100
    targets = torch.cat([labels[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return tokens, labels, targets


def _reference(model, tokens, labels) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """HF's logits, loss (LM + coef x aux) and gradients by parameter name."""
    model.zero_grad()
    out = model(tokens, labels=labels, output_router_logits=True)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hf_grads(grads: dict, n_layers: int) -> dict[str, torch.Tensor]:
    """funcshard's gradient tree under transformers 5's in-memory parameter names."""
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    attn = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    out = {"model.embed_tokens.weight": grads["embed"], "model.norm.weight": grads["norm"]}
    out["lm_head.weight"] = grads["head"]
    lay = grads["layers"]
    for i in range(n_layers):
        pre = f"model.layers.{i}."
        out |= {f"{pre}{v}.weight": lay[k][i] for k, v in names.items()}
        out |= {f"{pre}self_attn.{v}.weight": lay[k][i] for k, v in attn.items()}
        out[f"{pre}mlp.gate.weight"] = lay["router"][i]
        out[f"{pre}mlp.experts.gate_up_proj"] = torch.cat([lay["w1"][i], lay["w3"][i]], dim=1)
        out[f"{pre}mlp.experts.down_proj"] = lay["w2"][i]
    return out


def _compare(loss, grads, ref_loss, ref_grads, what: str) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6, msg=f"{what} loss")
    got = _hf_grads(grads, SIZES["num_hidden_layers"])
    assert set(got) == set(ref_grads)
    for name, g in got.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{what} {name}")


def _sharded_body(mesh: fs.Mesh, tmp: str, check_vma: bool, skew: float = 0.0) -> str:
    """From the HF folder ``tmp`` (of ``_hf_model(skew)``, saved by the caller), value_and_grad on ``mesh`` against
    HF's loss and gradients; forward against its logits."""
    model = _hf_model(skew)
    cfg, params = mixtral.from_hf(tmp)
    cfg = dataclasses.replace(cfg, pp_microbatches=1)  # with pp: one microbatch, HF's pooling of the whole batch
    tokens, labels, targets = _data()
    ref = _reference(model, tokens, labels)
    return check_sharded(mesh, cfg, params, (tokens, targets), ref, _compare, check_vma)


def test_one_device_equals_transformers(tmp_path) -> None:
    model = _hf_model()
    model.save_pretrained(tmp_path)
    cfg, params = mixtral.from_hf(tmp_path)
    tokens, labels, targets = _data()
    ref_logits, ref_loss, ref_grads = _reference(model, tokens, labels)
    torch.testing.assert_close(mixtral.forward(params, tokens, cfg), ref_logits, rtol=1e-4, atol=1e-5)
    loss, grads = fs.value_and_grad(mixtral.loss)(params, tokens, targets, cfg)
    _compare(loss, grads, ref_loss, ref_grads, "one device")
    aux = model(tokens, output_router_logits=True).aux_loss.detach()
    plain = dataclasses.replace(cfg, router_aux_loss_coef=0.0)
    lm = mixtral.loss(params, tokens, targets, plain)
    torch.testing.assert_close(loss - lm, SIZES["router_aux_loss_coef"] * aux, rtol=1e-4, atol=1e-6)  # aux counts


MESHES = {
    "ep2": {"ep": 2},
    "ep4": {"ep": 4},
    "ep2_tp2": {"ep": 2, "tp": 2},
    "fsdp2_ep2": {"fsdp": 2, "ep": 2},
    "dp2_ep2": {"dp": 2, "ep": 2},
    "pp2_ep2": {"pp": 2, "ep": 2},
    "cp2_ep2": {"cp": 2, "ep": 2},
}


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_equals_transformers_sim(tmp_path, name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    _hf_model().save_pretrained(tmp_path)
    assert run_body("sim", _sharded_body, MESHES[name], str(tmp_path), check_vma) == ["ok"]


SKEW = 6.0


def test_skewed_router_is_dropless(tmp_path) -> None:
    """Most tokens routed to expert 0 (on one ep device): no token dropped, still HF's numbers."""
    from _dist_pool import run_body

    model = _hf_model(skew=SKEW)
    tokens, _, _ = _data()
    with torch.no_grad():
        logits = model(tokens, output_router_logits=True).router_logits  # one [T, E] per layer
    for z in logits:
        share = (z.topk(2).indices == 0).any(-1).float().mean()
        assert share > 0.9  # expert 0 takes nearly every token (its device gets far more rows than the other)
    model.save_pretrained(tmp_path)
    assert run_body("sim", _sharded_body, {"ep": 2}, str(tmp_path), True, SKEW) == ["ok"]


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_equals_transformers_dist(tmp_path) -> None:
    from _dist_pool import run_body

    _hf_model().save_pretrained(tmp_path)
    for shape in ({"ep": 2, "dp": 2}, {"ep": 2, "tp": 2}):
        assert run_body("dist", _sharded_body, shape, str(tmp_path), True) == ["ok"] * 4
