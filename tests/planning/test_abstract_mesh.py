"""The ``"abstract"`` backend: meshes of any size, no data, one run per class of devices, and communication
counted byte for byte as a real run counts it (the sim backend as the reference)."""

from __future__ import annotations

import time

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P, extend, optim
from funcshard.models import llama
from funcshard.ops import ring_attention, ulysses_attention

BASE = dict(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def _shapes(tree):
    return optree.tree_map(lambda t: fs.ShapeDtype(t.shape, t.dtype), tree)


def _llama_step_rows(mesh_shape: dict[str, int], backend: str, cfg: llama.Config, check_vma: bool = True):
    """comm_stats rows of one train step (llama.value_and_grad + AdamW, params and state donated)."""
    mesh = fs.make_mesh(mesh_shape, backend=backend)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    opt = optim.adamw(1e-3, weight_decay=0.1)
    sspecs = opt.state_specs(specs)

    def step_fn(p, s, t, u):
        loss, g = llama.value_and_grad(p, t, u, cfg)
        p, s = opt.update(g, s, p)
        return loss, p, s

    kw = dict(mesh=mesh, check_vma=check_vma)
    full = llama.init(fs.random.key(0), cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16))
    if backend == "abstract":
        full, tokens = _shapes(full), fs.ShapeDtype(tokens.shape, tokens.dtype)
    params = fs.device_put(full, mesh, specs)
    state = fs.shard_map(opt.init, in_specs=(specs,), out_specs=sspecs, **kw)(params)
    step = fs.shard_map(step_fn, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs), donate=(0, 1), **kw)
    x = fs.device_put(tokens, mesh, bs)
    with fs.comm_stats() as stats:
        loss, params, state = step(params, state, x, x)
    return stats.rows(), loss


LLAMA_CASES = {
    "dp2_tp2": ({"dp": 2, "tp": 2}, {}),
    "fsdp2_tp2_sp": ({"fsdp": 2, "tp": 2}, {"sequence_parallel": True}),
    "hsdp": ({"dp": 2, "fsdp": 2}, {}),
    "cp2_ring": ({"cp": 2}, {}),
    "pp2_1f1b": ({"pp": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    "pp2_interleaved_dp2": ({"pp": 2, "dp": 2}, {"pp_schedule": "interleaved", "pp_microbatches": 2}),
    "fsdp2_remat_full": ({"fsdp": 2}, {"remat": "full"}),
    "tp2_remat_selective": ({"tp": 2}, {"remat": "selective"}),
    "fsdp2_keep": ({"fsdp": 2, "tp": 2}, {"reshard_after_forward": False}),
}


@pytest.mark.counters
@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_step_counts_equal_a_real_run(case: str) -> None:
    shape, extra = LLAMA_CASES[case]
    cfg = llama.Config(**BASE, **extra)
    real, _ = _llama_step_rows(shape, "sim", cfg)
    abstract, loss = _llama_step_rows(shape, "abstract", cfg)
    assert real and abstract == real
    assert loss.shape == () and loss.mesh.backend == "abstract"


@pytest.mark.counters
def test_llama_step_counts_equal_without_vma_tracking() -> None:
    cfg = llama.Config(**BASE)
    real, _ = _llama_step_rows({"dp": 2, "tp": 2}, "sim", cfg, check_vma=False)
    abstract, _ = _llama_step_rows({"dp": 2, "tp": 2}, "abstract", cfg, check_vma=False)
    assert real and abstract == real


@pytest.mark.counters
@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_context_parallel_attention_counts_equal(kind: str) -> None:
    def body(q, k, v):
        fn = ring_attention if kind == "ring" else ulysses_attention
        out = fn(q, k, v, axis="cp", causal=True)
        return fs.psum(out.float().square().sum(), "cp")

    def rows(backend: str):
        mesh = fs.make_mesh({"cp": 2}, backend=backend)
        f = fs.shard_map(
            lambda q, k, v: fs.value_and_grad(body, argnums=(0, 1, 2))(q, k, v),
            mesh=mesh,
            in_specs=(P(None, None, "cp"),) * 3,
            out_specs=(P(), (P(None, None, "cp"),) * 3),
        )
        qkv = [torch.randn(2, 4, 16, 8) for _ in range(3)]
        if backend == "abstract":
            qkv = [fs.ShapeDtype(t.shape, t.dtype) for t in qkv]
        with fs.comm_stats() as stats:
            _, grads = f(*qkv)
        assert [tuple(g.shape) for g in grads] == [(2, 4, 16, 8)] * 3
        return stats.rows()

    assert rows("sim") and rows("abstract") == rows("sim")


def test_a_4096_device_mesh_runs_a_body_once_per_class() -> None:
    mesh = fs.make_mesh({"pp": 8, "fsdp": 64, "tp": 8}, backend="abstract")
    assert mesh.size == 4096 and mesh.backend == "abstract"
    w = fs.device_put(fs.ShapeDtype((8, 4096, 1024), torch.bfloat16), mesh, P("pp", "fsdp", "tp"))
    assert w.shards[(5, 63, 7)].shape == (1, 64, 128) and w.shards[(5, 63, 7)].is_meta
    runs: list[int] = []

    def body(w):
        stage = extend.axis_index_int("pp")  # a Python number: the program may differ per stage
        runs.append(stage)
        full = fs.all_gather(w, "fsdp", dim=1, tiled=True)  # [1, 64, 128] -> [1, 4096, 128]
        return fs.psum(full.sum(-1), "tp")  # [1, 4096]

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("pp", "fsdp", "tp"),), out_specs=P("pp", "fsdp"))
    t0 = time.perf_counter()
    with fs.comm_stats() as stats:
        y = f(w)
    assert time.perf_counter() - t0 < 10
    assert y.shape == (8, 64 * 4096) and y.dtype == torch.bfloat16
    assert sorted(runs) == list(range(8))  # one run per stage, not one per device
    assert stats.calls("all_gather", "fsdp") == 1 and stats.bytes("all_gather", "fsdp") == 64 * 128 * 2
    assert stats.bytes("psum", "tp") == 4096 * 2
    assert len(stats.devices()) == 8  # one representative per class
    assert fs.device_get(y).is_meta and fs.device_get(y).shape == (8, 64 * 4096)


def test_a_body_that_reads_no_index_runs_once() -> None:
    mesh = fs.make_mesh({"dp": 512, "tp": 8}, backend="abstract")
    runs = []

    def body(x):
        runs.append(1)
        return fs.psum(x * 2, "tp")

    y = fs.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"),), out_specs=P("dp"))(fs.ShapeDtype((1024, 64)))
    assert len(runs) == 1 and y.shape == (1024, 8)


def test_axis_index_has_no_value_on_an_abstract_mesh() -> None:
    mesh = fs.make_mesh({"dp": 4}, backend="abstract")

    def body(x):
        i = fs.axis_index("dp")
        assert i.is_meta and i.shape == ()
        with pytest.raises(RuntimeError, match="meta"):
            int(i)
        return x + i

    y = fs.shard_map(body, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(fs.ShapeDtype((8,), torch.int64))
    assert y.shape == (8,)


def test_shape_dtype_leaves_need_an_abstract_mesh() -> None:
    sim = fs.make_mesh({"dp": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match="abstract"):
        fs.device_put(fs.ShapeDtype((4, 2)), sim, P("dp"))
    abstract = fs.make_mesh({"dp": 2}, backend="abstract")
    a = fs.device_put(torch.ones(4, 2), abstract, P("dp"))  # a real tensor: only its shape is kept
    assert a.shards[(1,)].is_meta and a.shards[(1,)].shape == (2, 2)


def test_abstract_is_never_picked_by_auto_and_is_listed() -> None:
    assert fs.make_mesh({"dp": 2}).backend != "abstract"
    with pytest.raises(fs.MeshError, match="abstract"):
        fs.make_mesh({"dp": 2}, backend="nope")
