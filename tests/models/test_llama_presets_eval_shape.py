"""``llama.Config.preset`` (the published Llama 3 shapes) and the Llama under ``fs.eval_shape``: ``init`` of a 405B
model in milliseconds with no memory, ``forward`` / ``loss`` shapes on the debug preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch

import funcshard as fs
from funcshard.models import llama

#: the parameter counts of Meta's published models (Hugging Face's ``num_parameters()``)
PUBLISHED = {
    "llama3.2-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


def _count(tree) -> int:
    return sum(s.numel() for s in optree.tree_leaves(tree))


def test_presets_are_the_published_shapes() -> None:
    assert llama.PRESETS == ("debug", "llama3.2-1b", "llama3-8b", "llama3-70b", "llama3-405b")
    shapes = {  # dim, layers, heads, kv heads, ffn, context, tied
        "llama3.2-1b": (2048, 16, 32, 8, 8192, 131072, True),
        "llama3-8b": (4096, 32, 32, 8, 14336, 8192, False),
        "llama3-70b": (8192, 80, 64, 8, 28672, 8192, False),
        "llama3-405b": (16384, 126, 128, 8, 53248, 131072, False),
    }
    for name, want in shapes.items():
        c = llama.Config.preset(name)
        got = (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.max_seq_len, c.tie_embeddings)
        assert got == want, name
        assert (c.vocab_size, c.rope_theta, c.norm_eps) == (128256, 500000.0, 1e-5), name
        assert c.head_dim == (64 if name == "llama3.2-1b" else 128), name
        assert c.num_params() == PUBLISHED[name], name
    assert llama.Config.preset("llama3-8b").rope_scaling is None  # Llama 3: plain RoPE
    assert llama.Config.preset("llama3-405b").rope_scaling == llama.RopeScaling(8.0, 1.0, 4.0, 8192)  # Llama 3.1
    assert llama.Config.preset("llama3.2-1b").rope_scaling == llama.RopeScaling(32.0, 1.0, 4.0, 8192)  # Llama 3.2
    debug = llama.Config.preset("debug")
    assert debug.num_params() < 200_000 and debug.dim % debug.n_heads == 0


def test_preset_overrides_and_unknown_names() -> None:
    cfg = llama.Config.preset("llama3-8b", max_seq_len=4096, precision="bf16")
    assert (cfg.max_seq_len, cfg.dim, cfg.precision) == (4096, 4096, fs.Precision.parse("bf16"))
    with pytest.raises(fs.ConfigError, match=r"'llama2-7b'.*debug, llama3\.2-1b, llama3-8b, llama3-70b, llama3-405b"):
        llama.Config.preset("llama2-7b")
    with pytest.raises(fs.ConfigError, match="hidden_size"):
        llama.Config.preset("debug", hidden_size=64)


def test_eval_shape_of_init_matches_a_real_init() -> None:
    for overrides in ({}, {"precision": "bf16"}, {"tie_embeddings": True}):
        cfg = llama.Config.preset("debug", **overrides)
        real = llama.init(fs.random.key(0), cfg)
        shapes = fs.eval_shape(llama.init, fs.random.key(0), cfg)
        assert optree.tree_structure(shapes) == optree.tree_structure(real)
        assert shapes == optree.tree_map(lambda t: fs.ShapeDtype(t.shape, t.dtype), real)
        assert _count(shapes) == cfg.num_params()
    again = llama.init(fs.random.key(0), cfg)  # a real init after the abstract one: bit for bit the same
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(real), optree.tree_leaves(again), strict=True))


def test_forward_loss_and_grads_under_eval_shape() -> None:
    cfg = llama.Config.preset("debug")
    params = fs.eval_shape(llama.init, fs.random.key(0), cfg)
    tokens = fs.ShapeDtype((3, 16), torch.int64)
    assert fs.eval_shape(llama.forward, params, tokens, cfg) == fs.ShapeDtype((3, 16, cfg.vocab_size))
    assert fs.eval_shape(llama.loss, params, tokens, tokens, cfg) == fs.ShapeDtype((), torch.float32)
    loss, grads = fs.eval_shape(fs.value_and_grad(llama.loss), params, tokens, tokens, cfg)
    assert loss == fs.ShapeDtype(()) and grads == params
    real = llama.init(fs.random.key(0), cfg)  # real parameters, abstract tokens: shapes only as well
    assert fs.eval_shape(llama.forward, real, tokens, cfg) == fs.ShapeDtype((3, 16, cfg.vocab_size))


def test_eval_shape_of_a_large_llama_forward() -> None:
    cfg = llama.Config.preset("llama3-8b", precision="bf16")
    params = fs.eval_shape(llama.init, fs.random.key(0), cfg)
    assert params["layers"]["wq"] == fs.ShapeDtype((32, 4096, 4096), torch.float32)  # fp32 master weights
    logits = fs.eval_shape(llama.forward, params, fs.ShapeDtype((2, 8192), torch.int64), cfg)
    assert logits == fs.ShapeDtype((2, 8192, 128256), torch.float32)


# in a fresh process: torch's first meta op imports torch._dynamo once (~1-2 s, ~150 MB), so that is done first
# (the debug preset) and each preset is then timed and its peak RSS growth read on its own
SCRIPT = """
import json, resource, sys, time
import optree
import funcshard as fs
from funcshard.models import llama
fs.eval_shape(llama.init, fs.random.key(0), llama.Config.preset("debug"))
unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
out = {}
for name in sys.argv[1:]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    shapes = fs.eval_shape(llama.init, fs.random.key(0), llama.Config.preset(name))
    seconds = time.perf_counter() - t
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * unit
    out[name] = [sum(s.numel() for s in optree.tree_leaves(shapes)), seconds, grown]
print(json.dumps(out))
"""


def test_eval_shape_of_init_counts_the_published_models_fast_and_without_memory() -> None:
    names = ["llama3-8b", "llama3-70b", "llama3-405b"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *names], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        count, seconds, grown = got[name]
        assert count == PUBLISHED[name], (name, count)
        assert seconds < 5.0, (name, seconds)  # ~15 ms measured on 2 CPU cores; generous for a loaded machine
        assert grown < 200 * 2**20, (name, grown)  # nothing measured (0-128 KiB)
