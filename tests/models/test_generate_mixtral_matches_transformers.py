"""``mixtral.generate`` greedy decoding against transformers' ``MixtralForCausalLM.generate(do_sample=False)``: a
batch of prompts of lengths 1, 5 and 9 (left-padded), 20 new tokens each, on one device and sharded (sim ``ep=2``,
``ep=2 x tp=2``, ``dp=2 x ep=2``; the experts split over ``ep``, whose devices decode the same rows)."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
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
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
}
LENGTHS = (1, 5, 9)
NEW = 20
PAD = 0


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, mixtral.Config, dict]:
    """A random tiny MixtralForCausalLM, and the same model read back by ``mixtral.from_hf``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SIZES)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(folder, safe_serialization=True)
    cfg, params = mixtral.from_hf(folder)
    return model, cfg, params


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (n,), generator=gen).tolist() for n in LENGTHS]


def _hf_generate(model: object, prompts: list[list[int]]) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None
        )


def test_greedy_equals_transformers_on_one_device(hf: tuple[object, mixtral.Config, dict]) -> None:
    model, cfg, params = hf
    prompts = _prompts()
    got = mixtral.generate(params, prompts, cfg, max_new_tokens=NEW, pad_id=PAD)
    assert torch.equal(got, _hf_generate(model, prompts))


@pytest.mark.parametrize("shape", [{"ep": 2}, {"ep": 2, "tp": 2}, {"dp": 2, "ep": 2}], ids=str)
def test_greedy_sharded_over_ep_equals_transformers(hf: tuple[object, mixtral.Config, dict], shape: dict) -> None:
    model, cfg, params = hf
    prompts = _prompts()
    mesh = fs.make_mesh(shape, backend="sim")
    specs = mixtral.param_specs(cfg, mesh)
    f = fs.shard_map(
        lambda p: mixtral.generate(p, prompts, cfg, max_new_tokens=NEW, pad_id=PAD),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=P("dp") if "dp" in shape else P(),
    )
    got = fs.device_get(f(fs.device_put(params, mesh, specs)))[: len(prompts)]
    assert torch.equal(got, _hf_generate(model, prompts))


def test_a_pipeline_axis_is_refused(hf: tuple[object, mixtral.Config, dict]) -> None:
    _, cfg, params = hf
    mesh = fs.make_mesh({"pp": 2}, backend="sim")
    specs = mixtral.param_specs(cfg, mesh)
    f = fs.shard_map(
        lambda p: mixtral.generate(p, [[1, 2]], cfg, max_new_tokens=2), mesh=mesh, in_specs=(specs,), out_specs=P()
    )
    with pytest.raises(fs.ConfigError, match=r"mixtral\.generate: a mesh with a pp"):
        f(fs.device_put(params, mesh, specs))
