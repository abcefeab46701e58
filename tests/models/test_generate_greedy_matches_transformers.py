"""``llama.generate`` greedy decoding against transformers' ``generate(do_sample=False)``: a batch of prompts of
lengths 1, 5 and 9 (left-padded, as Hugging Face pads for generation), 20 new tokens each, on one device and
sharded (sim ``tp=2`` and ``dp=2 x tp=2``, dist ``tp=2``); stop tokens as Hugging Face's ``eos_token_id``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

pytestmark = pytest.mark.oracle

HF_SIZES = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
}
LENGTHS = (1, 5, 9)
NEW = 20
PAD = 0


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 320, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A random tiny LlamaForCausalLM (weights large enough that the logits differ a lot) and its folder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _hf_generate(model: object, prompts: list[list[int]], **kw: object) -> torch.Tensor:
    """transformers' greedy ``generate`` on the prompts left-padded with ``PAD`` and their attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    kw = {"eos_token_id": None, **kw}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kw)


def _sharded_generate(mesh: fs.Mesh, cfg: llama.Config, params: dict, prompts: list[list[int]]) -> torch.Tensor:
    specs = llama.param_specs(cfg, mesh)
    data = P("dp") if "dp" in mesh.axis_names else P()
    f = fs.shard_map(
        lambda p: llama.generate(p, prompts, cfg, max_new_tokens=NEW, pad_id=PAD),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=data,
    )
    return fs.device_get(f(fs.device_put(params, mesh, specs)))[: len(prompts)]


def test_greedy_batch_of_lengths_1_5_9_equals_transformers(hf: tuple[object, Path]) -> None:
    model, folder = hf
    cfg, params = llama.from_hf(folder)
    ref = _hf_generate(model, _prompts())
    assert ref.shape == (3, 9 + NEW)
    assert len(set(ref[:, 9:].flatten().tolist())) > 10  # not one token repeated
    assert torch.equal(llama.generate(params, _prompts(), cfg, max_new_tokens=NEW, pad_id=PAD), ref)


def test_padded_rows_decode_as_each_prompt_alone(hf: tuple[object, Path]) -> None:
    _, folder = hf
    cfg, params = llama.from_hf(folder)
    batch = llama.generate(params, _prompts(), cfg, max_new_tokens=NEW)
    for r, p in enumerate(_prompts()):
        alone = llama.generate(params, [p], cfg, max_new_tokens=NEW)
        assert torch.equal(alone[0], batch[r, 9 - len(p) :])


@pytest.mark.parametrize("shape", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_greedy_sharded_on_sim_equals_transformers(hf: tuple[object, Path], shape: dict[str, int]) -> None:
    model, folder = hf
    cfg, params = llama.from_hf(folder)
    mesh = fs.make_mesh(shape, backend="sim")
    assert torch.equal(_sharded_generate(mesh, cfg, params, _prompts()), _hf_generate(model, _prompts()))


def _dist_body(mesh: fs.Mesh, folder: str) -> torch.Tensor:
    cfg, params = llama.from_hf(folder)
    return _sharded_generate(mesh, cfg, params, _prompts())


@pytest.mark.dist
def test_greedy_on_two_gloo_processes_tp2_equals_transformers(hf: tuple[object, Path]) -> None:
    from _dist_pool import run_body

    model, folder = hf
    ref = _hf_generate(model, _prompts())
    for got in run_body("dist", _dist_body, {"tp": 2}, str(folder)):
        assert torch.equal(got, ref)


def test_stop_tokens_pad_the_row_as_transformers_eos(hf: tuple[object, Path]) -> None:
    model, folder = hf
    cfg, params = llama.from_hf(folder)
    free = llama.generate(params, _prompts(), cfg, max_new_tokens=NEW)
    stop = int(free[1, 9 + 3])  # a token row 1 emits as its 4th new token
    ref = _hf_generate(model, _prompts(), eos_token_id=stop)
    ours = llama.generate(params, _prompts(), cfg, max_new_tokens=NEW, stop_tokens=[stop], pad_id=PAD)
    assert torch.equal(ours, ref)
    new = ours[1, 9:].tolist()
    first = new.index(stop)  # at or before the 4th new token: then only padding
    assert first <= 3 and all(t == PAD for t in new[first + 1 :]) and new[first + 1 :]
