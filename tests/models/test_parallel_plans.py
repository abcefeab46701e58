"""Parallel plans: ops fall back to local math on ``axis=None``; a plan is validated once from the mesh, with
clear errors; the Llama on a mesh whose axes have other names (roles mapped by a plan) gets the same loss and
gradients as on the default names and as the unsharded model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard.models import ParallelPlan, block, llama, plan_from_mesh
from funcshard.models.transformer import transformer_block
from funcshard.ops import (
    attention,
    column_parallel_linear,
    fsdp_gather,
    fsdp_unsharded_specs,
    ring_attention,
    row_parallel_linear,
    sequence_gather,
    sequence_scatter,
    ulysses_attention,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    zigzag_merge,
    zigzag_split,
)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _grads(fn, *args: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fn(*args)`` and the gradients of ``sum(out * r)`` with respect to every float argument."""
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    r = _rand(*out.shape, seed=99)
    grads = torch.autograd.grad((out * r).sum(), [a for a in leaves if a.requires_grad])
    return out.detach(), list(grads)


# -- ops: axis=None is the plain torch function ---------------------------------------------------------------

_X, _W, _B = _rand(2, 5, 8, seed=1), _rand(6, 8, seed=2), _rand(6, seed=3)
_QKV = (_rand(2, 4, 8, 16, seed=4), _rand(2, 2, 8, 16, seed=5), _rand(2, 2, 8, 16, seed=6))
_LOCAL_CASES = {
    "column": (lambda x, w, b: column_parallel_linear(x, w, b, axis=None), F.linear, (_X, _W, _B)),
    "column_gather_dim": (lambda x, w: column_parallel_linear(x, w, axis=None, gather_dim=1), F.linear, (_X, _W)),
    "row": (lambda x, w, b: row_parallel_linear(x, w, b, axis=None), F.linear, (_X, _W, _B)),
    "row_scatter_dim": (lambda x, w: row_parallel_linear(x, w, axis=None, scatter_dim=1), F.linear, (_X, _W)),
    "ring": (
        lambda q, k, v: ring_attention(q, k, v, axis=None),
        lambda q, k, v: attention(q, k, v, causal=True),
        _QKV,
    ),
    "ring_contiguous_full": (
        lambda q, k, v: ring_attention(q, k, v, axis=None, causal=False, layout="contiguous"),
        attention,
        _QKV,
    ),
    "ulysses": (
        lambda q, k, v: ulysses_attention(q, k, v, axis=None),
        lambda q, k, v: attention(q, k, v, causal=True),
        _QKV,
    ),
}


@pytest.mark.parametrize("name", sorted(_LOCAL_CASES))
def test_ops_without_axis_are_the_torch_function(name: str) -> None:
    op, ref, args = _LOCAL_CASES[name]
    out, grads = _grads(op, *args)
    want, want_grads = _grads(ref, *args)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fused_column_weights_without_axis() -> None:
    wk = _rand(4, 8, seed=7)
    q, k = column_parallel_linear(_X, [_W, wk], [_B, None], axis=None)
    torch.testing.assert_close(q, F.linear(_X, _W, _B), rtol=0, atol=0)
    torch.testing.assert_close(k, F.linear(_X, wk), rtol=0, atol=0)


def test_embedding_without_axis() -> None:
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(0))
    table = _rand(10, 8, seed=8).requires_grad_(True)
    out = vocab_parallel_embedding(ids, table, axis=None, scatter_dim=1)
    torch.testing.assert_close(out, F.embedding(ids, table), rtol=0, atol=0)
    (g,) = torch.autograd.grad(out.sum(), table)
    (want,) = torch.autograd.grad(F.embedding(ids, table).sum(), table)
    torch.testing.assert_close(g, want, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_without_axis(reduction: str) -> None:
    logits = (_rand(2, 5, 11, seed=9) * 3).requires_grad_(True)
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    labels[0, :2] = -100
    out = vocab_parallel_cross_entropy(logits, labels, axis=None, reduction=reduction)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)
    if reduction == "none":
        want = want.view(labels.shape)
    torch.testing.assert_close(out, want)
    (g,) = torch.autograd.grad(out.sum(), logits)
    (gw,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g, gw)


def test_cross_entropy_without_axis_keeps_the_ops_rules() -> None:
    logits, labels = _rand(3, 4, seed=10), torch.full((3,), -100)
    assert vocab_parallel_cross_entropy(logits, labels, axis=None).item() == 0.0  # no valid label: 0, not nan
    with pytest.raises(fs.ShardingError, match="reduction must be"):
        vocab_parallel_cross_entropy(logits, labels, axis=None, reduction="avg")


def test_identities_without_axis() -> None:
    x = _rand(2, 4, 8, 3, seed=11)
    params = {"w": _rand(4, 3, seed=12)}
    assert fsdp_gather(params, {"w": P("fsdp")}, axis=None) is params
    assert fsdp_gather(params, None, axis=None, replicate_axis=()) is params
    assert fsdp_unsharded_specs({"w": P("fsdp")}, axis=None) == {"w": P("fsdp")}
    for op in (sequence_gather, sequence_scatter, zigzag_split, zigzag_merge):
        assert op(x, None, 2) is x, op.__name__


def test_ops_without_axis_make_no_collective_inside_shard_map() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    q, k, v = _QKV

    def f(x, w, b, q, k, v):
        h = row_parallel_linear(column_parallel_linear(x, w, b, axis=None), w.t(), axis=None)  # [2, 5, 8]
        o = ring_attention(q, k, v, axis=None) + ulysses_attention(q, k, v, axis=None)
        return h.sum() + o.sum() + vocab_parallel_cross_entropy(x, torch.zeros(2, 5, dtype=torch.long), axis=None)

    for check_vma in (True, False):
        g = fs.shard_map(f, mesh=mesh, in_specs=(P(),) * 6, out_specs=P(), check_vma=check_vma)
        with fs.comm_stats() as stats:
            out = g(_X, _W, _B, q, k, v)
        assert stats.calls() == 0
        torch.testing.assert_close(fs.device_get(out), f(_X, _W, _B, q, k, v))


# -- the plan ---------------------------------------------------------------------------------------------------

_MESH = {"data": 2, "model": 2}


def test_default_plan_uses_the_axes_own_names() -> None:
    plan = plan_from_mesh(fs.make_mesh({"dp": 2, "fsdp": 2, "tp": 1}, backend="sim"))
    assert (plan.dp, plan.fsdp, plan.tp, plan.cp, plan.pp, plan.sp) == ("dp", "fsdp", "tp", None, None, False)
    assert plan.batch_axes == ("dp", "fsdp") and plan.data_axes == ("dp", "fsdp")
    assert plan.replica_axes == ("dp",) and plan.size("fsdp") == 2 and plan.size("cp") == 1
    assert ParallelPlan().roles == {} and ParallelPlan().replica_axes is None


def test_named_roles() -> None:
    mesh = fs.make_mesh({"replica": 2, "shard": 2, "ctx": 2}, backend="sim")
    plan = plan_from_mesh(mesh, {"dp": "replica", "fsdp": "shard", "cp": "ctx", "tp": None})
    assert plan.roles == {"dp": "replica", "fsdp": "shard", "cp": "ctx"}
    assert plan.data_axes == ("replica", "shard", "ctx") and plan.replica_axes == ("replica", "ctx")
    assert plan.to_mesh(P(("dp", "fsdp"), "cp", "tp")) == P(("replica", "shard"), "ctx")
    assert hash(plan) == hash(plan_from_mesh(mesh, {"dp": "replica", "fsdp": "shard", "cp": "ctx"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tp = "ctx"  # type: ignore[misc]


def test_an_axis_of_size_one_may_play_no_role() -> None:
    plan = plan_from_mesh({"data": 4, "pp": 1}, {"dp": "data"})
    assert plan.roles == {"dp": "data"}


@pytest.mark.parametrize(
    ("roles", "kw", "match"),
    [
        ({"mp": "model", "dp": "data"}, {}, "unknown role 'mp'; the roles are"),
        ({"dp": "data", "tp": "modle"}, {}, "role 'tp' maps to axis 'modle', which mesh .* does not have"),
        ({"dp": "data", "tp": "data"}, {}, "axis 'data' is given two roles, 'dp' and 'tp'"),
        ({"dp": "data"}, {}, "mesh axis 'model' \\(size 2\\) plays no role; give it one"),
        ({"dp": "data", "fsdp": "model"}, {"sequence_parallel": True}, "no axis plays 'tp'"),
        ({"dp": ("data", "model")}, {}, "a role is played by one mesh axis"),
        ([("dp", "data")], {}, "roles must be a mapping"),
        (None, {}, "mesh axis 'data' \\(size 2\\) plays no role"),
    ],
)
def test_plan_errors(roles, kw, match: str) -> None:
    with pytest.raises(fs.ConfigError, match=match):
        plan_from_mesh(fs.make_mesh(_MESH, backend="sim"), roles, **kw)


# -- the Llama with a plan --------------------------------------------------------------------------------------

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=64, max_seq_len=16)


def test_llama_plan_errors() -> None:
    mesh = fs.make_mesh(_MESH, backend="sim")
    plan = plan_from_mesh(mesh, {"dp": "data", "tp": "model"})
    with pytest.raises(fs.ConfigError, match="the plan was built for mesh \\{'data': 2, 'model': 2\\}, not"):
        llama.param_specs(CFG, fs.make_mesh({"data": 4}, backend="sim"), plan)
    with pytest.raises(fs.ConfigError, match="the plan was built for mesh"):
        llama.batch_spec(fs.make_mesh({"dp": 2, "tp": 2}, backend="sim"), plan)
    piped = llama.param_specs(CFG, mesh, plan_from_mesh(mesh, {"dp": "data", "pp": "model"}))  # layers over pp
    assert piped["layers"]["wq"] == P("model", None, None)
    sp_cfg = dataclasses.replace(CFG, sequence_parallel=True)
    with pytest.raises(fs.ConfigError, match="sequence_parallel=True but the plan has no sequence parallelism"):
        llama.param_specs(sp_cfg, mesh, plan)
    odd = fs.make_mesh({"data": 2, "model": 3}, backend="sim")
    with pytest.raises(fs.ShardingError, match="n_heads=8 is not divisible by tp=3; choose tp \\(axis 'model'\\)"):
        llama.param_specs(CFG, odd, plan_from_mesh(odd, {"dp": "data", "tp": "model"}))
    with pytest.raises(fs.ShardingError, match="axes of other names take roles through a plan"):
        llama.param_specs(CFG, mesh)  # other names without a plan
    with pytest.raises(fs.ConfigError, match="called outside shard_map"):
        llama.forward(llama.init(fs.random.key(0), CFG), torch.zeros(1, 4, dtype=torch.long), CFG, plan)


def test_llama_specs_follow_the_roles() -> None:
    named = fs.make_mesh({"shard": 2, "model": 2}, backend="sim")
    plan = plan_from_mesh(named, {"fsdp": "shard", "tp": "model"})
    default = llama.param_specs(CFG, fs.make_mesh({"fsdp": 2, "tp": 2}, backend="sim"))
    rename = {"fsdp": "shard", "tp": "model"}

    def renamed(e: object) -> object:  # an entry: None, an axis, or a tuple of axes (P(("tp", "fsdp"), None))
        return tuple(rename.get(a, a) for a in e) if isinstance(e, (tuple, list)) else rename.get(e, e)

    want = fs.pytree.tree_map(lambda s: P(*map(renamed, s.entries)), default, is_leaf=lambda x: isinstance(x, P))
    assert llama.param_specs(CFG, named, plan) == want
    assert llama.batch_spec(named, plan) == P("shard", None)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt[0, :5] = -100
    return tok, tgt


def _step(cfg: llama.Config, mesh: fs.Mesh, plan: ParallelPlan | None, check_vma: bool, params, tok, tgt):
    specs, bs = llama.param_specs(cfg, mesh, plan), llama.batch_spec(mesh, plan)
    f = fs.shard_map(
        lambda p, t, y: fs.value_and_grad(lambda p: llama.loss(p, t, y, cfg, plan))(p),
        mesh=mesh,
        in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    return fs.device_get(loss), fs.device_get(grads), specs


def _renamed_body(mesh: fs.Mesh, roles: dict[str, str], default: dict[str, int], sp: bool, check_vma: bool) -> str:
    cfg = dataclasses.replace(CFG, sequence_parallel=sp)
    key, (tok, tgt) = fs.random.key(0), _batch()
    params = llama.init(key, cfg)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    plan = plan_from_mesh(mesh, roles, sequence_parallel=sp)
    loss, grads, specs = _step(cfg, mesh, plan, check_vma, params, tok, tgt)
    default_mesh = fs.make_mesh(default, backend=mesh.backend)
    d_loss, d_grads, _ = _step(cfg, default_mesh, None, check_vma, params, tok, tgt)
    torch.testing.assert_close(loss, d_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (path, g), (_, d), (_, r) in zip(
        fs.pytree.leaves_with_path(grads),
        fs.pytree.leaves_with_path(d_grads),
        fs.pytree.leaves_with_path(ref_grads),
        strict=True,
    ):
        torch.testing.assert_close(g, d, rtol=1e-6, atol=1e-7, msg=path)
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=path)
    # a sharded init under the plan draws each device's blocks, bitwise equal to the unsharded init
    init = fs.shard_map(lambda k: llama.init(k, cfg, plan), mesh=mesh, in_specs=(P(),), out_specs=specs)
    drawn = fs.pytree.leaves_with_path(fs.device_get(init(key)))
    for (path, a), (_, b) in zip(drawn, fs.pytree.leaves_with_path(params), strict=True):
        assert torch.equal(a, b), path
    return "ok"


RENAMED = {
    "data2_model2": ({"data": 2, "model": 2}, {"dp": "data", "tp": "model"}, {"dp": 2, "tp": 2}, False),
    "shard2_seq2": ({"shard": 2, "seq": 2}, {"fsdp": "shard", "cp": "seq"}, {"fsdp": 2, "cp": 2}, False),
    "model2_ctx2_sp": ({"model": 2, "ctx": 2}, {"tp": "model", "cp": "ctx"}, {"tp": 2, "cp": 2}, True),
}


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(RENAMED))
def test_llama_on_renamed_axes_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape, roles, default, sp = RENAMED[name]
    assert run_body("sim", _renamed_body, shape, roles, default, sp, check_vma) == ["ok"]


@pytest.mark.dist
def test_llama_on_renamed_axes_dist() -> None:
    from _dist_pool import run_body

    shape, roles, default, sp = RENAMED["data2_model2"]
    assert set(run_body("dist", _renamed_body, shape, roles, default, sp, True)) == {"ok"}


# -- the test block is the same block ------------------------------------------------------------------------------


def test_block_modes_are_plans() -> None:
    assert block.plan_for(None) == ParallelPlan()
    assert block.plan_for("tp_sp").sp and block.plan_for("tp_sp").tp == "tp"
    assert block.plan_for("hsdp").roles == {"dp": "dp", "fsdp": "fsdp"}
    with pytest.raises(fs.ShardingError, match="unknown parallel mode"):
        block.plan_for("zero")
    cfg = block.BlockConfig(dim=16, heads=4, ffn=32)
    p, x = block.init(cfg), _rand(2, 8, 16, seed=13)
    want = transformer_block(x, p, ParallelPlan(), head_dim=4, norm_eps=1e-6, mlp="gelu")
    torch.testing.assert_close(block.forward(p, x, cfg, None), want, rtol=0, atol=0)
