"""``fs.nn.functionalize``: a module as a parameter tree and a pure function, equal to the module itself.

The Hugging Face Llama's logits exactly and its autograd gradients by dotted name; a plain MLP through
``fs.value_and_grad``, ``fs.remat`` and ``shard_map`` (sim and dist); the user's module never changed; Python-side
state refused with the attribute named.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import P


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.oracle
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_llama_logits_exact_and_grads_by_dotted_name(tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(conf)
    params, fn = fs.nn.functionalize(model)
    assert "model.layers.0.self_attn.q_proj.weight" in params and "model.rotary_emb.inv_freq" in params
    assert ("lm_head.weight" in params) == (not tie)  # a tied weight once, under its first name
    tokens = torch.randint(0, 96, (2, 12))
    assert torch.equal(fn(params, tokens).logits, model(tokens).logits)

    loss, grads = fs.value_and_grad(lambda p: fn(p, tokens, labels=tokens).loss)(params)
    out = model(tokens, labels=tokens)
    out.loss.backward()
    assert torch.equal(loss, out.loss.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)


def test_params_share_storage_and_the_module_is_untouched() -> None:
    mlp = _mlp()
    hooks_before = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in mlp.modules()]
    params, fn = fs.nn.functionalize(mlp)
    assert params["0.weight"].data_ptr() == mlp[0].weight.data_ptr()
    new = {k: torch.zeros_like(v) for k, v in params.items()}
    assert torch.equal(fn(new, torch.randn(3, 8)), torch.zeros(3, 4))  # the tree's values, not the module's
    assert mlp[0].weight.abs().sum() > 0 and mlp[0].weight.device.type == "cpu"
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in mlp.modules()] == hooks_before


def test_remat_and_value_and_grad_equal_autograd() -> None:
    mlp = _mlp()
    params, fn = fs.nn.functionalize(mlp)
    x = torch.randn(5, 8)
    _, grads = fs.value_and_grad(lambda p: fs.remat(fn)(p, x).square().mean())(params)
    mlp(x).square().mean().backward()
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def _dp_body(mesh: fs.Mesh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mlp = _mlp()
    params, fn = fs.nn.functionalize(mlp)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))

    def loss(p: dict, x: torch.Tensor) -> torch.Tensor:
        return fs.pmean(fn(p, x).square().mean(), "dp")  # [b/dp, 4] -> []

    f = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()))
    return fs.device_get(f(params, x))


def test_inside_shard_map_gives_the_full_batch_gradient(run) -> None:
    mlp = _mlp()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    mlp(x).square().mean().backward()
    for loss, grads in run(_dp_body, {"dp": 2}):
        torch.testing.assert_close(loss, mlp(x).square().mean().detach())
        for name, p in mlp.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python-side state: differs per device and per call
        return self.lin(x)


def test_python_side_state_is_refused_with_its_attribute_named() -> None:
    params, fn = fs.nn.functionalize(_Counter())
    with pytest.raises(fs.ConfigError, match=r"changed its attribute 'calls' from 0 to 1"):
        fn(params, torch.randn(1, 2))
    params, fn = fs.nn.functionalize(_Counter(), check_state=False)
    assert fn(params, torch.randn(1, 2)).shape == (1, 2)


def test_not_a_module_is_a_config_error() -> None:
    with pytest.raises(fs.ConfigError, match=r"expected a torch\.nn\.Module, found function"):
        fs.nn.functionalize(lambda x: x)
