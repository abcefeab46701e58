"""``funcshard.pipeline.run`` against the same model without a pipeline.

A toy model of ``L = n_stages * n_virtual`` residual-MLP layers (``y = x + tanh(x @ W1) @ W2``), one layer
per stage chunk, runs through each schedule inside shard_map; its loss and every layer's gradient must
equal those of the plain model on the full batch. Sim with check_vma on and off, dist on gloo workers
(pp=4, and dp=2 x pp=2 with the batch also split over dp), the exact point-to-point message count, and bad
inputs.
"""

from __future__ import annotations

import pytest
import torch
from _pipeline_toy import DT, MB, D, _data, _layer, _mse, _pipeline_body, _reference, _schedule

import funcshard as fs
from funcshard import P
from funcshard.pipeline import PipelineGrads, by_name, one_f_one_b, run, zero_bubble_h1
from funcshard.pipeline.messages import loss_route, plans, stage_plan
from funcshard.pipeline.runtime import stage_order, virtual_stage_order

CASES = [
    (name, p, m)
    for name in ("gpipe", "1f1b", "interleaved", "zb_h1", "interleaved_zb", "looped_bfs", "zbv", "dualpipev")
    for p in (2, 4)
    for m in (4, 8)
    if not (name == "interleaved" and m % p)
    and not (name == "interleaved_zb" and m < p)
    and not (name == "dualpipev" and m < 2 * p)
]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(("name", "p", "m"), CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])
def test_pipeline_matches_plain_model_sim(name: str, p: int, m: int, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _pipeline_body, {"pp": p}, name, m, check_vma) == ["ok"]


def _all_schedules_body(mesh: fs.Mesh) -> str:
    for name in ("gpipe", "1f1b", "interleaved", "zb_h1", "zbv", "dualpipev"):
        _pipeline_body(mesh, name, 8, True)
    _pipeline_body(mesh, "1f1b", 4, False)
    return "ok"


@pytest.mark.dist
def test_pipeline_dist_pp4() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _all_schedules_body, {"pp": 4})) == {"ok"}


def _dp_pp_body(mesh: fs.Mesh, name: str, check_vma: bool, explicit: bool = True) -> str:
    """dp=2 x pp=2: the batch is also split over dp; the loss is pmean'd over dp, the grads psum'd by the
    pvary the stage function writes (correct with and without check_vma), or, with ``explicit=False``
    under check_vma, by the pvary shard_map inserts where the dp-replicated weights meet the dp-split batch."""
    p, dp, m = mesh.shape["pp"], mesh.shape["dp"], 4
    sched = _schedule(name, p, m)
    v = sched.n_virtual
    w1, w2, x, t = _data(p * v, dp * m * MB, seed=1)
    ref_loss, ref_g1, ref_g2 = _reference(w1, w2, x, t)
    order = stage_order(sched)

    def layer(params, x):
        # the weights are replicated over dp: pvary's backward psums their grads over dp
        return _layer(fs.pvary(params, "dp") if explicit else params, x)

    def step(params, xs, ts):  # xs, ts: [m, MB, D] local (this dp shard)
        loss, grads = run(sched, layer, params, xs, targets=ts, loss_fn=_mse)
        return fs.pmean(loss, "dp"), [g / dp for g in grads]  # loss: [] -> [], the mean over dp shards

    bspec = P(None, "dp")
    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), bspec, bspec), out_specs=(P(), P("pp")), check_vma=check_vma)
    # global [m, dp * MB, D]: dp shard k holds rows k*m*MB ... of the batch, cut into m microbatches
    xs = x.reshape(dp, m, MB, D).transpose(0, 1).reshape(m, dp * MB, D)
    ts = t.reshape(dp, m, MB, D).transpose(0, 1).reshape(m, dp * MB, D)
    loss, (g1, g2) = f((w1[order], w2[order]), xs, ts)
    inv = torch.tensor(order).argsort()
    torch.testing.assert_close(fs.device_get(loss).reshape(()), ref_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g1)[inv], ref_g1, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g2)[inv], ref_g2, rtol=1e-5, atol=1e-12)
    return "ok"


@pytest.mark.parametrize(
    ("check_vma", "explicit"), [(True, True), (True, False), (False, True)], ids=["vma", "vma-auto", "novma"]
)
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb_h1", "dualpipev"])
def test_pipeline_dp_pp_sim(name: str, check_vma: bool, explicit: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _dp_pp_body, {"dp": 2, "pp": 2}, name, check_vma, explicit) == ["ok"]


def _dp_pp_all_body(mesh: fs.Mesh) -> str:
    for name in ("1f1b", "interleaved", "zb_h1", "zbv"):
        _dp_pp_body(mesh, name, True)
    _dp_pp_body(mesh, "zb_h1", True, False)
    _dp_pp_body(mesh, "1f1b", False)
    return "ok"


@pytest.mark.dist
def test_pipeline_dp_pp_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _dp_pp_all_body, {"dp": 2, "pp": 2})) == {"ok"}


def _expected_sends(sched, stage: int) -> int:
    """From the action lists, independently of the plan: one message per F whose next virtual stage is on
    another stage, one per B whose previous virtual stage is on another stage."""
    n = 0
    for a in sched.actions[stage]:
        vs = sched.virtual_stage(stage, a.chunk)
        if a.kind == "F" and vs < sched.n_virtual_stages - 1:
            n += sched.stage_of(vs + 1)[0] != stage
        if a.kind == "B" and vs > 0:
            n += sched.stage_of(vs - 1)[0] != stage
    return n


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "interleaved", "gpipe", "zbv"])
def test_message_count(name: str) -> None:
    """One point-to-point message per block that crosses stages, no ppermute (no empty rounds), no collective:
    the loss reaches every stage inside blocks it receives anyway."""
    p, m = 4, 8
    sched = _schedule(name, p, m)
    mesh = fs.make_mesh({"pp": p}, backend="sim")
    w1, w2, x, t = _data(p * sched.n_virtual, m * MB)
    order = stage_order(sched)
    f = fs.shard_map(
        lambda params, xs, ts: run(sched, _layer, params, xs, targets=ts, loss_fn=_mse),
        mesh=mesh,
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    with fs.comm_stats() as st:
        f((w1[order], w2[order]), x.reshape(m, MB, D), t.reshape(m, MB, D))
    assert st.calls("ppermute") == 0
    route = loss_route(sched)
    assert route is not None and len(route) == p - 1  # one block into each stage but the loss's
    for s in range(p):
        expected = _expected_sends(sched, s)
        notes = sum(x.src == s for x in route)  # blocks that also carry the loss: 3 float64 more
        assert st.calls("send", "pp", device=s) == expected
        assert st.bytes("send", "pp", device=s) == expected * MB * D * 8 + notes * 24  # [MB, D] float64 blocks
        assert st.calls("psum", "pp", device=s) == 0  # the loss came with the blocks: no collective at the end
    total = sum(st.calls("send", "pp", device=s) for s in range(p))
    hops = p * sched.n_virtual - 1 if sched.placement_kind != "v" else 2 * p - 2  # a V turns within stage p-1
    assert total == 2 * m * hops
    if name == "1f1b":
        # the lock-step runtime made 32 ppermutes per device (15 forward and 17 backward shifts, every device
        # in each); now stage 0 sends only its 8 activations, a middle stage 8 + 8 blocks
        assert [st.calls("send", "pp", device=s) for s in range(p)] == [8, 16, 16, 8]


def _no_targets_fp32_body(mesh: fs.Mesh, check_vma: bool) -> str:
    p, m = mesh.shape["pp"], 4
    w1, w2, x, _ = (a.float() for a in _data(p, m * MB, seed=2))

    def loss_fn(y):
        return (y**2).mean()

    w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    y = x
    for i in range(p):
        y = _layer((w1r[i], w2r[i]), y)
    ref = loss_fn(y)
    ref_g = torch.autograd.grad(ref, (w1r, w2r))
    f = fs.shard_map(
        lambda params, xs: run(zero_bubble_h1(p, m), _layer, params, xs, loss_fn=loss_fn),
        mesh=mesh,
        in_specs=(P("pp"), P()),
        out_specs=(P(), P("pp")),
        check_vma=check_vma,
    )
    loss, grads = f((w1, w2), x.reshape(m, MB, D))
    torch.testing.assert_close(fs.device_get(loss).reshape(()), ref.detach(), rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_g, strict=True):
        torch.testing.assert_close(fs.device_get(g), r, rtol=1e-5, atol=1e-6)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_no_targets_fp32(check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _no_targets_fp32_body, {"pp": 4}, check_vma) == ["ok"]


def test_virtual_stage_order() -> None:
    assert virtual_stage_order(4, 1) == [0, 1, 2, 3]
    assert virtual_stage_order(2, 3) == [0, 2, 4, 1, 3, 5]


def _bad(mesh_shape: dict[str, int], sched, params, xs, ts):
    mesh = fs.make_mesh(mesh_shape, backend="sim")
    f = fs.shard_map(
        lambda params, xs, ts: run(sched, _layer, params, xs, targets=ts, loss_fn=_mse),
        mesh=mesh,
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    return f(params, xs, ts)


def test_bad_axis_size() -> None:
    w1, w2, x, t = _data(4, 4 * MB)
    with pytest.raises(fs.ShardingError, match=r"axis 'pp' has size 2 .* n_stages=4; build the schedule"):
        _bad({"pp": 2}, one_f_one_b(4, 4), (w1, w2), x.reshape(4, MB, D), t.reshape(4, MB, D))


def test_bad_param_leading_dim() -> None:
    w1, w2, x, t = _data(4, 4 * MB)  # 4 layers on pp=2 is 2 chunks per stage, but the schedule has 1
    with pytest.raises(
        fs.ShardingError, match=r"leaf 0 has local shape \(2, 4, 6\); expected a leading dim of n_virtual=1"
    ):
        _bad({"pp": 2}, one_f_one_b(2, 4), (w1, w2), x.reshape(4, MB, D), t.reshape(4, MB, D))


def test_bad_microbatch_count() -> None:
    w1, w2, x, t = _data(2, 4 * MB)
    with pytest.raises(
        fs.ShardingError, match=r"microbatches has local shape \(2, 6, 4\); expected .* n_microbatches=4"
    ):
        _bad({"pp": 2}, one_f_one_b(2, 4), (w1, w2), x.reshape(2, 2 * MB, D), t.reshape(4, MB, D))
    with pytest.raises(fs.ShardingError, match=r"targets has local shape \(2, 6, 4\)"):
        _bad({"pp": 2}, one_f_one_b(2, 4), (w1, w2), x.reshape(4, MB, D), t.reshape(2, 2 * MB, D))


def test_stage_fn_must_keep_shape() -> None:
    mesh = fs.make_mesh({"pp": 2}, backend="sim")
    w1, w2, x, t = _data(2, 4 * MB)
    f = fs.shard_map(
        lambda params, xs, ts: run(one_f_one_b(2, 4), lambda p, x: x @ p[0], params, xs, targets=ts, loss_fn=_mse),
        mesh=mesh,
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    with pytest.raises(fs.ShardingError, match="must keep the activation's shape and dtype"):
        f((w1, w2), x.reshape(4, MB, D), t.reshape(4, MB, D))


VOCAB = 11


def _embed_model(n_layers: int, batch: int, tied: bool, seed: int = 3):
    """Token ids -> embedding -> residual-MLP layers -> head -> cross-entropy, in float64."""
    w1, w2, _, _ = _data(n_layers, batch, seed)
    g = torch.Generator().manual_seed(seed + 1)
    shared = {"emb": torch.randn(VOCAB, D, generator=g, dtype=DT)}
    if not tied:
        shared["head"] = torch.randn(VOCAB, D, generator=g, dtype=DT)
    tok = torch.randint(0, VOCAB, (batch,), generator=g)
    tgt = torch.randint(0, VOCAB, (batch,), generator=g)
    return w1, w2, shared, tok, tgt


def _first(sh, tok):
    return sh["emb"][tok]  # [MB] -> [MB, D]: the first stage changes shape and dtype


def _head_loss(sh, y, t):
    head = sh.get("head", sh["emb"])
    return torch.nn.functional.cross_entropy(y @ head.T, t)  # [MB, D] @ [D, V] -> [MB, V]


def _embed_reference(w1, w2, shared, tok, tgt):
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    sh = {k: v.clone().requires_grad_() for k, v in shared.items()}
    y = _first(sh, tok)
    for i in range(w1.shape[0]):
        y = _layer((w1[i], w2[i]), y)
    loss = _head_loss(sh, y, tgt)
    grads = torch.autograd.grad(loss, (w1, w2, *sh.values()))
    return loss.detach(), grads[0], grads[1], dict(zip(sh, grads[2:]))


def _embed_body(mesh: fs.Mesh, name: str, m: int, tied: bool, check_vma: bool) -> str:
    p = mesh.shape["pp"]
    sched = _schedule(name, p, m)
    w1, w2, shared, tok, tgt = _embed_model(p * sched.n_virtual, m * MB, tied)
    ref_loss, ref_g1, ref_g2, ref_sh = _embed_reference(w1, w2, shared, tok, tgt)
    order = stage_order(sched)

    def step(params, sh, toks, ts):
        loss, g = run(sched, _layer, params, toks, targets=ts, loss_fn=_head_loss, first_fn=_first, shared_params=sh)
        assert isinstance(g, PipelineGrads) and g.input is None
        return loss, g.stage, g.shared

    f = fs.shard_map(
        step, mesh=mesh, in_specs=(P("pp"), P(), P(), P()), out_specs=(P(), P("pp"), P()), check_vma=check_vma
    )
    loss, (g1, g2), g_sh = f((w1[order], w2[order]), shared, tok.reshape(m, MB), tgt.reshape(m, MB))
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-12)
    inv = torch.tensor(order).argsort()
    torch.testing.assert_close(fs.device_get(g1)[inv], ref_g1, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g2)[inv], ref_g2, rtol=1e-5, atol=1e-12)
    for k, r in ref_sh.items():  # tied: the embedding's gradient sums the first and the last stage's parts
        torch.testing.assert_close(fs.device_get(g_sh[k]), r, rtol=1e-5, atol=1e-12, msg=k)
    return "ok"


EMBED_CASES = [("1f1b", 2, False), ("interleaved", 2, True), ("zb_h1", 4, False), ("zbv", 2, True)]
EMBED_CASES += [("dualpipev", 4, False), ("looped_bfs", 4, True)]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(("name", "p", "tied"), EMBED_CASES, ids=[f"{n}-p{p}-tied{t}" for n, p, t in EMBED_CASES])
def test_first_stage_embeds_last_has_head(name: str, p: int, tied: bool, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _embed_body, {"pp": p}, name, 2 * p, tied, check_vma) == ["ok"]


def _input_grad_body(mesh: fs.Mesh, name: str) -> str:
    p, m = mesh.shape["pp"], 4
    sched = _schedule(name, p, m)
    w1, w2, x, t = _data(p * sched.n_virtual, m * MB, seed=5)
    xr = x.clone().requires_grad_()
    y = xr
    for i in range(w1.shape[0]):
        y = _layer((w1[i], w2[i]), y)
    ref_gx = torch.autograd.grad(_mse(y, t), xr)[0]
    order = stage_order(sched)

    def step(params, xs, ts):
        _, g = run(sched, _layer, params, xs, targets=ts, loss_fn=_mse, input_grad=True)
        return g.input

    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=P())
    gx = f((w1[order], w2[order]), x.reshape(m, MB, D), t.reshape(m, MB, D))
    torch.testing.assert_close(fs.device_get(gx).reshape(m * MB, D), ref_gx, rtol=1e-5, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zbv"])
def test_input_gradient_of_the_first_stage(name: str) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _input_grad_body, {"pp": 2}, name) == ["ok"]


def test_input_grad_needs_float_microbatches() -> None:
    mesh = fs.make_mesh({"pp": 2}, backend="sim")
    w1, w2, shared, tok, tgt = _embed_model(2, 4 * MB, True)
    f = fs.shard_map(
        lambda w, sh, xs, ts: run(
            one_f_one_b(2, 4),
            _layer,
            w,
            xs,
            targets=ts,
            loss_fn=_head_loss,
            first_fn=_first,
            shared_params=sh,
            input_grad=True,
        )[0],
        mesh=mesh,
        in_specs=(P("pp"), P(), P(), P()),
        out_specs=P(),
    )
    with pytest.raises(fs.ShardingError, match="input_grad=True needs floating-point microbatches"):
        f((w1, w2), shared, tok.reshape(4, MB), tgt.reshape(4, MB))


@pytest.mark.parametrize(("name", "p", "m"), [c for c in CASES if c[1] == 4] + [("1f1b", 1, 4)])
def test_loss_route_reaches_every_stage(name: str, p: int, m: int) -> None:
    """Every shipped schedule has a loss route: each stage but the one holding the last virtual stage receives
    exactly one block that carries the loss, sent by a stage that has it by then (the runtime raises if not;
    the loss tests above check the values), and ``plans`` marks every stage's plan routed."""
    sched = _schedule(name, p, m)
    route = loss_route(sched)
    holder = sched.stage_of(sched.n_virtual_stages - 1)[0]
    assert route is not None
    assert sorted(x.dst for x in route) == [s for s in range(p) if s != holder]
    assert all(x.src != x.dst for x in route)
    for plan in plans(sched):
        assert plan.routed
        assert plan.notes == {x for x in route if plan.stage in (x.src, x.dst)}


def test_loss_without_a_route_is_one_psum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a plan has no loss route, the loss is reduced with one psum over the axis, to the same value."""
    import dataclasses

    from funcshard.pipeline import runtime

    unrouted = {}

    def no_route(sched):
        unrouted[id(sched)] = tuple(dataclasses.replace(q, notes=frozenset(), routed=False) for q in plans(sched))
        return unrouted[id(sched)]

    monkeypatch.setattr(runtime, "plans", no_route)
    p, m = 2, 4
    sched = one_f_one_b(p, m)
    w1, w2, x, t = _data(p, m * MB)
    ref_loss, ref_g1, _ = _reference(w1, w2, x, t)
    f = fs.shard_map(
        lambda params, xs, ts: run(sched, _layer, params, xs, targets=ts, loss_fn=_mse),
        mesh=fs.make_mesh({"pp": p}, backend="sim"),
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    with fs.comm_stats() as st:
        loss, (g1, _) = f((w1, w2), x.reshape(m, MB, D), t.reshape(m, MB, D))
    assert unrouted and st.calls("psum", "pp", device=0) == st.calls("psum", "pp", device=1) == 1
    for s in range(p):  # blocks only, no loss note: m [MB, D] float64 blocks out of each stage
        assert st.bytes("send", "pp", device=s) == m * MB * D * 8
    torch.testing.assert_close(fs.device_get(loss).reshape(()), ref_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(fs.device_get(g1), ref_g1, rtol=1e-5, atol=1e-12)


def test_v_schedules_hand_off_the_turn_locally() -> None:
    """ZB-V on p=4: no block crosses from stage 3 to itself; forward sends go down on chunk 0 and up on
    chunk 1; the sends counted equal the plan's."""
    sched = by_name("zbv", 4, 8)
    plans = [stage_plan(sched, s) for s in range(4)]
    steps = [st for pl in plans for u in pl.units for st in u]
    local = [st.send for st in steps if st.send is not None and st.send.src == st.send.dst]  # hand-offs in a stage
    assert len(local) == 2 * 8  # F and B of each microbatch at the turn
    assert all(x.src == 3 for x in local)
    assert all(x.src != x.dst for pl in plans for x in pl.sends)
    for x in (x for pl in plans for x in pl.sends if x.kind == "F"):  # chunk 0 goes down, chunk 1 up
        assert x.dst == x.src + 1 if x.virtual_stage < 4 else x.dst == x.src - 1
    mesh = fs.make_mesh({"pp": 4}, backend="sim")
    w1, w2, x, t = _data(8, 8 * MB)
    order = stage_order(sched)
    f = fs.shard_map(
        lambda params, xs, ts: run(sched, _layer, params, xs, targets=ts, loss_fn=_mse),
        mesh=mesh,
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    with fs.comm_stats() as st:
        f((w1[order], w2[order]), x.reshape(8, MB, D), t.reshape(8, MB, D))
    assert [st.calls("send", "pp", device=s) for s in range(4)] == [len(pl.sends) for pl in plans]
    assert sum(len(pl.sends) for pl in plans) == 2 * 8 * (2 * 4 - 2)  # 2p - 2 stage boundaries, each way


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "looped_bfs", "zbv", "dualpipev"])
def test_to_chunks_and_back(name: str) -> None:
    """Natural layer order (spec P("pp")) -> each stage's chunks as the placement says, and back."""
    from funcshard.pipeline import from_chunks, to_chunks

    p = 4
    sched = by_name(name, p, 8)
    n = p * sched.n_virtual * 2  # two layers per chunk
    layers = torch.arange(float(n)).repeat_interleave(3).reshape(n, 3)  # row i holds layer i
    mesh = fs.make_mesh({"pp": p}, backend="sim")
    chunks = fs.shard_map(lambda w: to_chunks(w, sched), mesh=mesh, in_specs=(P("pp"),), out_specs=P("pp"))(layers)
    got = fs.device_get(chunks)  # [p * v, 2, 3]: global index s * v + c holds virtual stage placement[s][c]
    for g, vs in enumerate(stage_order(sched)):
        assert got[g, :, 0].tolist() == [2.0 * vs, 2.0 * vs + 1]
    back = fs.shard_map(lambda c: from_chunks(c, sched), mesh=mesh, in_specs=(P("pp"),), out_specs=P("pp"))(chunks)
    assert torch.equal(fs.device_get(back), layers)
