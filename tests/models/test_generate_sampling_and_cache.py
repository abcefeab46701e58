"""``llama.generate``'s sampling (``fs.random`` keys: reproducible, the train job's former sampler's draws for one
prompt, the same tokens sharded, top-k / top-p) and its KV cache (FLOPs against re-running the context)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=96)
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def params() -> dict:
    return llama.init(fs.random.key(0), CFG)


def _resampling_loop(params: dict, ids: list[int], key: torch.Tensor, n: int, temperature: float) -> list[int]:
    """The job's sampler before the cache: the whole context again each step, inverse-CDF draws of fs.random."""
    ids = list(ids)
    with torch.no_grad():
        for i in range(n):
            logits = llama.forward(params, torch.tensor([ids]), CFG)[0, -1].float()  # [V]
            cdf = F.softmax(logits / temperature, dim=-1).cumsum(0)
            u = fs.random.uniform(fs.random.fold_in(key, i), ()) * cdf[-1]
            ids.append(min(int(torch.searchsorted(cdf, u, right=True)), CFG.vocab_size - 1))
    return ids


def test_sampling_is_reproducible_and_differs_for_another_key(params: dict) -> None:
    kw = {"max_new_tokens": 24, "temperature": 1.0}
    a = llama.generate(params, PROMPTS, CFG, key=fs.random.key(3), **kw)
    b = llama.generate(params, PROMPTS, CFG, key=fs.random.key(3), **kw)
    c = llama.generate(params, PROMPTS, CFG, key=fs.random.key(4), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 7:], c[:, 7:])


def test_one_prompt_draws_what_the_former_sampler_drew(params: dict) -> None:
    key = fs.random.key(5)
    ours = llama.generate(params, [[10, 20, 30]], CFG, max_new_tokens=16, temperature=0.8, key=key)
    assert ours[0].tolist() == _resampling_loop(params, [10, 20, 30], key, 16, 0.8)


def test_top_k_1_is_greedy_and_top_p_keeps_the_likely_tokens(params: dict) -> None:
    greedy = llama.generate(params, PROMPTS, CFG, max_new_tokens=12)
    key = fs.random.key(1)
    assert torch.equal(
        llama.generate(params, PROMPTS, CFG, max_new_tokens=12, temperature=2.0, key=key, top_k=1), greedy
    )
    tiny_p = llama.generate(params, PROMPTS, CFG, max_new_tokens=12, temperature=2.0, key=key, top_p=1e-6)
    assert torch.equal(tiny_p, greedy)  # only the most likely token reaches any mass


@pytest.mark.parametrize("shape", [{"tp": 2}, {"dp": 2, "tp": 2}, {"fsdp": 2, "tp": 2}], ids=str)
def test_sampled_tokens_sharded_equal_single_device(params: dict, shape: dict[str, int]) -> None:
    kw = {"max_new_tokens": 10, "temperature": 1.0, "key": fs.random.key(2), "top_k": 40, "top_p": 0.9}
    mesh = fs.make_mesh(shape, backend="sim")
    specs = llama.param_specs(CFG, mesh)
    data = P(tuple(a for a in mesh.axis_names if a != "tp") or None)
    f = fs.shard_map(lambda p: llama.generate(p, PROMPTS, CFG, **kw), mesh=mesh, in_specs=(specs,), out_specs=data)
    got = fs.device_get(f(fs.device_put(params, mesh, specs)))[: len(PROMPTS)]
    assert torch.equal(got, llama.generate(params, PROMPTS, CFG, **kw))


def test_bad_options_raise_config_error(params: dict) -> None:
    with pytest.raises(fs.ConfigError, match="key"):
        llama.generate(params, PROMPTS, CFG, max_new_tokens=2, temperature=1.0)
    with pytest.raises(fs.ConfigError, match="prompt 1 is empty"):
        llama.generate(params, [[1], []], CFG, max_new_tokens=2)
    with pytest.raises(fs.ConfigError, match="outside the vocabulary"):
        llama.generate(params, [[1, 256]], CFG, max_new_tokens=2)
    with pytest.raises(fs.ConfigError, match="top_p"):
        llama.generate(params, PROMPTS, CFG, max_new_tokens=2, temperature=1.0, key=fs.random.key(0), top_p=0)


@pytest.mark.counters
def test_cache_costs_at_most_0_3x_the_flops_of_rerunning_the_context(params: dict) -> None:
    prompt, new = list(range(1, 9)), 64
    with FlopCounterMode(display=False) as cached:
        ids = llama.generate(params, [prompt], CFG, max_new_tokens=new)
    with FlopCounterMode(display=False) as rerun, torch.no_grad():
        ctx = list(prompt)
        for _ in range(new):
            ctx.append(int(llama.forward(params, torch.tensor([ctx]), CFG)[0, -1].argmax()))
    assert ctx == ids[0].tolist()  # the same tokens
    ratio = cached.get_total_flops() / rerun.get_total_flops()
    assert ratio <= 0.3, ratio
