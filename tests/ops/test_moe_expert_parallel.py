"""``funcshard.ops.moe.moe_ffn`` with experts sharded over ``ep`` (tokens dispatched by ``ragged_all_to_all``)
against the single-device layer over the whole batch: output and every gradient (tokens, router, w1, w3, w2), on
``{"ep": 2}``, ``{"ep": 4}``, ``{"dp": 2, "ep": 2}`` and ``{"ep": 2, "tp": 2}`` (the experts' hidden dim over tp),
with ``check_vma`` on and off, under sim and under dist (the same body on gloo workers); skewed routing (every
token to one expert, one expert without tokens); the dispatch's bytes; the capacity factor's drops; the errors.

Gradients: ``fs.value_and_grad`` of the global loss ``psum(sum(y * r))`` inside ``shard_map``. With
``check_vma=False`` the body makes the params varying over ``dp`` itself (as a model does for a data axis), and
``moe_ffn`` sums the router's gradient over ``ep`` (and ``tp``) on its own.
"""

from __future__ import annotations

import math

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.ops import moe

E, D, F_, K = 8, 16, 32, 2
B, S = 8, 5  # tokens: B * S, the batch dim split over the token axes


def _rand(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _data(skew: bool = False):
    p = {
        "router": _rand(E, D, seed=1),
        "w1": _rand(E, F_, D, seed=2) * 0.3,
        "w3": _rand(E, F_, D, seed=3) * 0.3,
        "w2": _rand(E, D, F_, seed=4) * 0.3,
    }
    x = _rand(B, S, D, seed=5)
    if skew:  # every token's first choice is expert 6 (on the last ep device); expert 1 gets none
        p["router"] = p["router"] * 0.1
        p["router"][6] = 1.0
        p["router"][1] = -1.0
        x = x + 1.0
    return x, p, _rand(B, S, D, seed=6)


def _reference(x, p, r, **kw):
    x = x.clone().requires_grad_()
    p = {n: t.clone().requires_grad_() for n, t in p.items()}
    y = moe.moe_ffn(x, p, K, axis=None, **kw)
    gx, *gp = torch.autograd.grad((y * r).sum(), [x, *p.values()])
    return y.detach(), gx, dict(zip(p, gp))


def _specs(mesh: fs.Mesh):
    tok = tuple(a for a in ("dp", "ep") if a in mesh.shape)
    tp = "tp" if "tp" in mesh.shape else None
    pspec = {"router": P(), "w1": P("ep", tp), "w3": P("ep", tp), "w2": P("ep", None, tp)}
    return P(tok), pspec, tok, tp


def _ep_body(mesh: fs.Mesh, skew: bool, check_vma: bool) -> str:
    x, p, r = _data(skew)
    xspec, pspec, tok, tp = _specs(mesh)

    def loss(x, p, r):
        if not check_vma and "dp" in mesh.shape:
            p = fs.pvary(p, "dp")  # a data axis: the caller's (moe_ffn sums the router over ep itself)
        y = moe.moe_ffn(x, p, K, axis="ep", tp=tp)
        return fs.psum((y * r).sum(), tok), y

    def step(x, p, r):
        (value, y), grads = fs.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, p, r)
        return value, y, grads

    f = fs.shard_map(
        step, mesh=mesh, in_specs=(xspec, pspec, xspec), out_specs=(P(), xspec, (xspec, pspec)), check_vma=check_vma
    )
    value, y, (gx, gp) = f(x, p, r)
    ry, rgx, rgp = _reference(x, p, r)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(fs.device_get(y), ry, **tol)
    torch.testing.assert_close(fs.device_get(value), (ry * r).sum(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fs.device_get(gx), rgx, **tol)
    for name in ("router", "w1", "w3", "w2"):
        torch.testing.assert_close(fs.device_get(gp[name]), rgp[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    return "ok"


MESHES = {"ep2": {"ep": 2}, "ep4": {"ep": 4}, "dp2ep2": {"dp": 2, "ep": 2}, "ep2tp2": {"ep": 2, "tp": 2}}


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skewed"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_moe_ep_equals_single_device_sim(mesh: str, skew: bool, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _ep_body, MESHES[mesh], skew, check_vma) == ["ok"]


def _local_body(mesh: fs.Mesh, skew: bool, check_vma: bool) -> str:
    """``axis=None`` inside ``shard_map`` (the fused local path: gather, experts and combine in one Function): tokens
    over ``dp`` and / or the experts' hidden dim over ``tp``, against the single-device layer."""
    x, p, r = _data(skew)
    tok = ("dp",) if "dp" in mesh.shape else ()
    tp = "tp" if "tp" in mesh.shape else None
    xspec, pspec = P(tok), {"router": P(), "w1": P(None, tp), "w3": P(None, tp), "w2": P(None, None, tp)}

    def loss(x, p, r):
        if not check_vma and tok:
            p = fs.pvary(p, "dp")  # a data axis: the caller's
        y = moe.moe_ffn(x, p, K, axis=None, tp=tp)
        return (fs.psum((y * r).sum(), tok) if tok else (y * r).sum()), y

    def step(x, p, r):
        (value, y), grads = fs.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, p, r)
        return value, y, grads

    f = fs.shard_map(
        step, mesh=mesh, in_specs=(xspec, pspec, xspec), out_specs=(P(), xspec, (xspec, pspec)), check_vma=check_vma
    )
    value, y, (gx, gp) = f(x, p, r)
    ry, rgx, rgp = _reference(x, p, r)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(fs.device_get(y), ry, **tol)
    torch.testing.assert_close(fs.device_get(value), (ry * r).sum(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fs.device_get(gx), rgx, **tol)
    for name in ("router", "w1", "w3", "w2"):
        torch.testing.assert_close(fs.device_get(gp[name]), rgp[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skewed"])
@pytest.mark.parametrize("mesh", ["dp2", "tp2", "dp2tp2"])
def test_moe_local_path_in_shard_map_equals_single_device_sim(mesh: str, skew: bool, check_vma: bool) -> None:
    from _dist_pool import run_body

    shape = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "dp2tp2": {"dp": 2, "tp": 2}}[mesh]
    assert run_body("sim", _local_body, shape, skew, check_vma) == ["ok"]


def _all_ep_cases(mesh: fs.Mesh) -> str:
    for skew in (False, True):
        for check_vma in (True, False):
            _ep_body(mesh, skew, check_vma)
    return "ok"


@pytest.mark.dist
def test_moe_ep_equals_single_device_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _all_ep_cases, {"ep": 2})) == {"ok"}


def test_skewed_routing_leaves_an_expert_empty() -> None:
    x, p, _ = _data(skew=True)
    counts = torch.bincount(moe.route(x, p["router"], K)[1].reshape(-1), minlength=E)
    assert counts[6] == B * S and counts[1] == 0


def _bytes_body(mesh: fs.Mesh) -> str:
    """Forward only: the dispatch sends each device's rows for the other device's experts, the combine sends the
    rows it received back; ``comm_stats`` counts bytes to other devices only."""
    x, p, _ = _data(skew=True)
    ids = moe.route(x, p["router"], K)[1]  # flattened tokens: device r holds tokens [r*T/2, (r+1)*T/2)
    per_dev = ids.reshape(2, -1)
    e_local = E // 2
    sent = [int((per_dev[r] // e_local != r).sum()) for r in range(2)]  # rows to the other device
    assert sum(sent) > 0
    f = fs.shard_map(lambda x, p: moe.moe_ffn(x, p, K), mesh=mesh, in_specs=(P("ep"), _specs(mesh)[1]),
                     out_specs=P("ep"))  # fmt: skip
    with torch.no_grad(), fs.comm_stats() as st:
        f(x, p)
    for r in st.devices():
        got_back = sent[1 - r]  # the rows the other device sent here return to it
        assert st.bytes("ragged_all_to_all", "ep", device=r) == (sent[r] + got_back) * D * 4
        assert st.calls("ragged_all_to_all", "ep", device=r) == 2
        assert st.calls("all_to_all", "ep", device=r) == 1  # the [ep, E_local] counts
    return "ok"


@pytest.mark.counters
def test_dispatch_bytes_are_the_rows_sent_to_other_devices(run) -> None:
    assert set(run(_bytes_body, {"ep": 2})) == {"ok"}


def _capacity_reference(ids: torch.Tensor, cap: int) -> int:
    """Assignments over capacity, counted the slow way: per expert, those after its first ``cap`` in token order."""
    seen, dropped = [0] * E, 0
    for e in ids.reshape(-1).tolist():
        seen[e] += 1
        dropped += seen[e] > cap
    return dropped


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_capacity_factor_drops_and_counts(factor: float) -> None:
    x, p, _ = _data(skew=True)
    t = B * S
    y, aux = moe.moe_ffn(x, p, K, axis=None, capacity_factor=factor, return_router=True)
    cap = math.ceil(factor * t * K / E)
    assert int(aux.dropped) == _capacity_reference(aux.expert_ids, cap)
    # the reference: dropped assignments get weight 0 in the dropless layer's sum
    kept = torch.zeros(t * K, dtype=torch.bool)
    seen = [0] * E
    for i, e in enumerate(aux.expert_ids.reshape(-1).tolist()):
        seen[e] += 1
        kept[i] = seen[e] <= cap
    h = x.reshape(t, D)
    ref = torch.zeros(t, D)
    weights = moe.route(x, p["router"], K)[0].reshape(-1)
    for i in range(t * K):
        if kept[i]:
            e = int(aux.expert_ids.reshape(-1)[i])
            hid = torch.nn.functional.silu(h[i // K] @ p["w1"][e].T) * (h[i // K] @ p["w3"][e].T)
            ref[i // K] += weights[i] * (hid @ p["w2"][e].T)
    torch.testing.assert_close(y.reshape(t, D), ref, rtol=1e-4, atol=1e-5)
    if factor == 2.0:
        assert int(aux.dropped) > 0  # skewed: expert 6 takes every token, over twice its share


def _capacity_ep_body(mesh: fs.Mesh) -> str:
    """Under ep the capacity counts this device's assignments: each device drops what the local layer on its own
    tokens drops, and the outputs agree."""
    x, p, _ = _data(skew=True)

    def body(x, p):
        y, aux = moe.moe_ffn(x, p, K, capacity_factor=1.0, return_router=True)
        return y, aux.dropped.reshape(1)

    y, dropped = fs.shard_map(body, mesh=mesh, in_specs=(P("ep"), _specs(mesh)[1]), out_specs=(P("ep"), P("ep")))(x, p)
    n = mesh.shape["ep"]
    for r, xr in enumerate(x.chunk(n)):
        yr, aux = moe.moe_ffn(xr, p, K, axis=None, capacity_factor=1.0, return_router=True)
        torch.testing.assert_close(fs.device_get(y).chunk(n)[r], yr, rtol=1e-4, atol=1e-5)
        assert int(fs.device_get(dropped)[r]) == int(aux.dropped)
    return "ok"


def test_capacity_factor_under_ep() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _capacity_ep_body, {"ep": 2}) == ["ok"]


def test_errors() -> None:
    x, p, _ = _data()
    with pytest.raises(fs.ConfigError, match=r"k \(experts per token\) is 9; it must be an int in \[1, 8\]"):
        moe.moe_ffn(x, p, 9, axis=None)
    with pytest.raises(fs.ShardingError, match=r"router weight has shape \(8, 12\)"):
        moe.moe_ffn(x, {**p, "router": torch.zeros(E, 12)}, K, axis=None)
    with pytest.raises(fs.ShardingError, match=r"lack \['w3'\]"):
        moe.moe_ffn(x, {n: t for n, t in p.items() if n != "w3"}, K, axis=None)
    with pytest.raises(fs.ShardingError, match=r"w2 \(8, 16, 30\)"):
        moe.moe_ffn(x, {**p, "w2": torch.zeros(E, D, 30)}, K, axis=None)
    with pytest.raises(fs.ConfigError, match="capacity_factor"):
        moe.moe_ffn(x, p, K, axis=None, capacity_factor=0.0)
    mesh = fs.make_mesh({"ep": 4}, backend="sim")
    p6 = {"router": torch.zeros(6, D), "w1": torch.zeros(6, F_, D), "w3": torch.zeros(6, F_, D),
          "w2": torch.zeros(6, D, F_)}  # fmt: skip
    f = fs.shard_map(lambda x, p: moe.moe_ffn(x, p, K), mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep"))
    with pytest.raises(fs.ShardingError, match=r"6 experts .* not divisible by the size 4 of axis 'ep'"):
        f(x, p6)
    f = fs.shard_map(lambda x, p: moe.moe_ffn(x, p, K), mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep"))
    with pytest.raises(fs.ShardingError, match=r"E / 4 = 2 experts \(P\('ep'\) on dim 0\)"):
        f(x, p)  # expert weights replicated: every device holds all 8


def test_abstract_mesh_shapes_flops_and_bytes() -> None:
    """On meta tensors (``fs.eval_shape``, an abstract mesh) the counts are unknown: dropless shapes, the experts'
    FLOPs as ``T * k`` rows through each projection, and routing taken as balanced by the ragged all-to-all."""
    sd = fs.ShapeDtype
    p = {"router": sd((E, D), torch.float32), "w1": sd((E, F_, D), torch.float32),
         "w3": sd((E, F_, D), torch.float32), "w2": sd((E, D, F_), torch.float32)}  # fmt: skip
    x = sd((B, S, D), torch.float32)
    y, aux = fs.eval_shape(lambda x, p: moe.moe_ffn(x, p, K, axis=None, return_router=True), x, p)
    assert y.shape == (B, S, D) and aux.router_logits.shape == (B * S, E) and aux.expert_ids.shape == (B * S, K)
    mesh = fs.make_mesh({"ep": 4}, backend="abstract")
    pspec = {"router": P(), "w1": P("ep"), "w3": P("ep"), "w2": P("ep")}
    f = fs.shard_map(lambda x, p: moe.moe_ffn(x, p, K), mesh=mesh, in_specs=(P("ep"), pspec), out_specs=P("ep"))
    cost = f.lower(sd((B * S, D), torch.float32), p).cost_analysis()
    t = B * S // 4  # tokens per device
    assert cost["flops"] == 2 * t * D * E + 3 * 2 * (t * K) * D * F_  # router + three projections
    assert cost["comm_calls"]["ep"] == 3  # the counts' all_to_all, the dispatch, the combine
    counts = 4 * (E // 4) * 8  # the [ep, E_local] int64 counts
    assert cost["comm_bytes"]["ep"] == counts + 2 * (t * K * 3 // 4) * D * 4  # 3/4 of the rows leave, and return
