"""The asynchronous pipeline runtime and the point-to-point primitives under it.

- The plan of every schedule, run as an abstract machine with rendezvous semantics (a send completes only once
  its receive is posted, a receive once its send is): every stage finishes, each receive is posted before it
  is waited on, and the receives from one peer follow that peer's sending order.
- ``DeviceHandle.p2p`` under sim and on gloo workers (same body): tags matched out of posting order, groups
  of a 2-axis mesh, and the sim mailbox's errors (a peer that finished without sending, a shape mismatch,
  a deadlock, a timeout): each names the devices and never hangs.
- ``pipeline.run`` with a stage function whose gradients alias the blocks it sends (gradients accumulated in
  place must not write into a block still being sent), with stages slowed unevenly (the devices drift apart),
  every schedule under sim and on gloo, and an error on one stage ending the step on all of them.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import lax as core_lax
from funcshard._src.runtime.backends.sim import SimWorld
from funcshard._src.runtime.comm import P2POp
from funcshard._src.runtime.context import current
from funcshard.pipeline import SCHEDULE_NAMES, by_name, run, stage_order
from funcshard.pipeline.messages import LOOKAHEAD, messages, stage_plan

# -- the plan under rendezvous semantics -------------------------------------------------------------------


def _programs(sched, lookahead: int):
    """Each stage's sequence of point-to-point events, in the order ``run`` makes them."""
    progs = []
    for s in range(sched.n_stages):
        plan = stage_plan(sched, s, lookahead=lookahead)
        prog = [("post_recv", x) for x in plan.posts[0]]
        for i, unit in enumerate(plan.units):
            for j, step in enumerate(unit):
                if step.recv is not None and step.recv.src != s:
                    prog.append(("wait_recv", step.recv))
                if step.send is not None and step.send.dst != s:
                    prog.append(("post_send", step.send))
                if j == len(unit) - 1 and i + 1 < len(plan.units):
                    prog += [("post_recv", x) for x in plan.posts[i + 1]]
        prog += [("wait_send", x) for x in plan.sends]
        progs.append(prog)
    return progs


def _rendezvous(sched, lookahead: int) -> None:
    progs = _programs(sched, lookahead)
    sent, posted = set(), set()
    recv_order: dict[tuple[int, int], list] = {}
    pos = [0] * len(progs)
    progress = True
    while progress:
        progress = False
        for s, prog in enumerate(progs):
            while pos[s] < len(prog):
                kind, x = prog[pos[s]]
                if kind == "post_recv":
                    assert x not in posted, f"{x} posted twice"
                    posted.add(x)
                    recv_order.setdefault((x.src, x.dst), []).append(x)
                elif kind == "post_send":
                    sent.add(x)
                elif kind == "wait_recv":
                    assert x in posted, f"stage {s} waits on {x} before posting its receive"
                    if x not in sent:
                        break
                elif x not in posted:  # wait_send: done once the receiver has posted
                    break
                pos[s] += 1
                progress = True
    stuck = [(s, progs[s][pos[s]]) for s in range(len(progs)) if pos[s] < len(progs[s])]
    assert not stuck, f"{sched.name}: deadlock at {stuck}"
    assert sent == posted == set(messages(sched))
    for (src, dst), order in recv_order.items():  # in the sender's order: what an in-order backend (NCCL) needs
        assert order == [x for x in stage_plan(sched, src).sends if x.dst == dst], (src, dst)


SIZES = [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (8, 16)]


@pytest.mark.parametrize("lookahead", [0, LOOKAHEAD, 100])
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_plan_cannot_deadlock(name: str, lookahead: int) -> None:
    for p, m in SIZES:
        if name in ("interleaved", "interleaved_zb") and m % p:
            continue
        if name == "dualpipev" and m < 2 * p:
            continue
        _rendezvous(by_name(name, p, m), lookahead)


def test_plan_posts_ahead_and_from_the_start() -> None:
    sched = by_name("1f1b", 4, 8)
    plan = stage_plan(sched, 1)
    need = {s.recv: i for i, u in enumerate(plan.units) for s in u if s.recv is not None}
    at = {x: i for i, row in enumerate(plan.posts) for x in row}
    assert set(at) == set(need)
    assert all(at[x] == max(0, need[x] - LOOKAHEAD) for x in at)  # 1F1B consumes in the senders' order
    assert set(stage_plan(sched, 1, lookahead=100).posts[0]) == set(plan.recvs)  # everything at the start


def test_plan_errors() -> None:
    sched = by_name("1f1b", 2, 4)
    with pytest.raises(fs.ShardingError, match=r"no stage 2; stages are 0\.\.1"):
        stage_plan(sched, 2)
    with pytest.raises(fs.ShardingError, match="lookahead must be an int >= 0"):
        stage_plan(sched, 0, lookahead=-1)


# -- the backend primitives --------------------------------------------------------------------------------


def _ring_body(mesh: fs.Mesh) -> list[float]:
    """Each device of the 'pp' group sends two tagged blocks to the next one and receives from the previous
    one, posting its receives in the opposite order of the sends (tags match them)."""

    def f(x):
        dev = current("test").device
        n, i = mesh.shape["pp"], dev.coords["pp"]
        base = float(dev.rank)
        recvs = dev.p2p(
            [P2POp("recv", torch.empty(3), (i - 1) % n, tag=2), P2POp("recv", torch.empty(3), (i - 1) % n, 1)], ("pp",)
        )
        sends = dev.p2p(
            [
                P2POp("send", torch.full((3,), base), (i + 1) % n, 1),
                P2POp("send", torch.full((3,), base + 0.5), (i + 1) % n, 2),
            ],
            ("pp",),
        )
        a, b = recvs[1].wait(), recvs[0].wait()  # tag 1, then tag 2
        for w in sends:
            assert w.wait() is None
        return torch.stack([a, b])[None]  # [1, 2, 3]

    out = fs.shard_map(f, mesh=mesh, in_specs=(P(),), out_specs=P(tuple(mesh.axis_names)), check_vma=False)(
        torch.zeros(1)
    )
    return fs.device_get(out)[:, :, 0].reshape(-1).tolist()


def test_p2p_ring(run) -> None:
    got = run(_ring_body, {"pp": 4})[0]
    # device r received (rank of the previous device) on tag 1 and + 0.5 on tag 2
    assert got == [3.0, 3.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


def test_p2p_within_groups_of_a_2d_mesh(run) -> None:
    got = run(_ring_body, {"dp": 2, "pp": 2})[0]
    # ranks (dp, pp) row-major: 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); the pp peer of rank r is r ^ 1
    assert got == [1.0, 1.5, 0.0, 0.5, 3.0, 3.5, 2.0, 2.5]


def _sim_error(fn, timeout: float = 30.0) -> str:
    world = SimWorld(fs.make_mesh({"pp": 2}, backend="sim"), timeout=timeout)
    with pytest.raises(fs.ShardingError) as e:
        world.run(fn)
    return str(e.value)


def test_sim_p2p_peer_finished_without_sending() -> None:
    def fn(dev):
        if dev.coords["pp"] == 1:
            dev.p2p([P2POp("recv", torch.empty(3), 0, tag=5)], ("pp",))[0].wait()

    msg = _sim_error(fn)
    assert "receive of a (3,) torch.float32 block (tag 5) from device (pp=0)" in msg
    assert "device (pp=1) waits for device (pp=0), which finished without sending it" in msg


def test_sim_p2p_receiver_finished_without_receiving() -> None:
    def fn(dev):
        if dev.coords["pp"] == 0:
            dev.p2p([P2POp("send", torch.ones(2), 1, tag=3)], ("pp",))[0].wait()

    assert "which finished without posting the matching receive" in _sim_error(fn)


def test_sim_p2p_shape_mismatch() -> None:
    def fn(dev):
        if dev.coords["pp"] == 0:
            dev.p2p([P2POp("send", torch.ones(2), 1)], ("pp",))[0].wait()
        else:
            dev.p2p([P2POp("recv", torch.empty(3), 0)], ("pp",))[0].wait()

    msg = _sim_error(fn)
    assert "device (pp=0) sent a (2,) torch.float32 block (tag 0) to device (pp=1)" in msg
    assert "receive for a (3,) torch.float32 block" in msg


def test_sim_p2p_deadlock_is_reported_at_once() -> None:
    def fn(dev):  # both receive first: neither ever sends
        dev.p2p([P2POp("recv", torch.empty(3), 1 - dev.coords["pp"])], ("pp",))[0].wait()

    t0 = time.monotonic()
    msg = _sim_error(fn, timeout=30.0)
    assert time.monotonic() - t0 < 10
    assert "deadlock" in msg and "(pp=0) waits in a point-to-point receive" in msg


def test_sim_p2p_times_out_naming_the_silent_device() -> None:
    def fn(dev):
        if dev.coords["pp"] == 0:
            time.sleep(1.5)  # busy in its own code, never sends
        else:
            dev.p2p([P2POp("recv", torch.empty(3), 0)], ("pp",))[0].wait()

    msg = _sim_error(fn, timeout=0.5)
    assert "device (pp=1) waited 0.5 s (FUNCSHARD_TIMEOUT) for device (pp=0), which never sent it" in msg


def test_p2p_bad_peer() -> None:
    def fn(dev):
        dev.p2p([P2POp("send", torch.ones(1), dev.coords["pp"])], ("pp",))

    assert "must be another member of the group" in _sim_error(fn)
    with pytest.raises(fs.ShardingError, match="kind must be 'send' or 'recv'"):
        P2POp("put", torch.ones(1), 0)


# -- the runtime -------------------------------------------------------------------------------------------


D, MB = 4, 2


def _aliasing(params, x):
    # d/dx and d/dp of x + p are both the incoming gradient: the parameter gradient aliases the block sent back
    return torch.tanh(x) + params[0]


def _mse(y, t):
    return ((y - t) ** 2).mean()


def _slowed(params, x):
    time.sleep(0.002 * core_lax.axis_index_int("pp"))  # later stages slower: the devices drift apart
    return _aliasing(params, x)


def _body(mesh: fs.Mesh, names: tuple[str, ...], slow: bool) -> str:
    p, m = mesh.shape["pp"], 8
    for name in names:
        sched = by_name(name, p, m)
        n = p * sched.n_virtual
        g = torch.Generator().manual_seed(7)
        w = torch.randn(n, 1, MB, D, generator=g, dtype=torch.float64)  # one [MB, D] bias per layer
        xs, ts = (torch.randn(m, MB, D, generator=g, dtype=torch.float64) for _ in range(2))
        wr = w.clone().requires_grad_()
        losses = []
        for x, t in zip(xs, ts, strict=True):
            for i in range(n):
                x = _aliasing(wr[i], x)
            losses.append(_mse(x, t))
        ref = torch.stack(losses).mean()
        ref_g = torch.autograd.grad(ref, wr)[0]

        def step(w, xs, ts, sched=sched):
            fn = _slowed if slow else _aliasing
            return run(sched, fn, w, xs, targets=ts, loss_fn=_mse)

        order = stage_order(sched)
        f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")))
        loss, grads = f(w[order], xs, ts)
        torch.testing.assert_close(fs.device_get(loss).reshape(()), ref.detach(), msg=name)
        torch.testing.assert_close(fs.device_get(grads)[torch.tensor(order).argsort()], ref_g, msg=name)
    return "ok"


def test_every_schedule_with_aliasing_gradients(run, backend: str) -> None:
    names = SCHEDULE_NAMES if backend == "sim" else ("1f1b", "interleaved", "zbv", "interleaved_zb")
    assert set(run(_body, {"pp": 4}, names, False)) == {"ok"}


def test_uneven_stages_drift_apart_and_agree() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _body, {"pp": 4}, ("1f1b", "interleaved", "dualpipev"), True) == ["ok"]


def test_an_error_on_one_stage_ends_the_step_on_all() -> None:
    mesh = fs.make_mesh({"pp": 4}, backend="sim")
    sched = by_name("1f1b", 4, 8)

    def bad(params, x):
        if core_lax.axis_index_int("pp") == 2:
            raise ValueError("stage 2 is broken")
        return _aliasing(params, x)

    f = fs.shard_map(
        lambda w, xs: run(sched, bad, w, xs, loss_fn=lambda y: y.sum()),
        mesh=mesh,
        in_specs=(P("pp"), P()),
        out_specs=(P(), P("pp")),
    )
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="stage 2 is broken"):
        f(torch.zeros(4, 1, MB, D), torch.zeros(8, MB, D))
    assert time.monotonic() - t0 < 20  # not a FUNCSHARD_TIMEOUT (60 s in the tests)


def test_trace_records_each_stage_in_schedule_order() -> None:
    """``pipeline.trace`` records every action once, on its stage, in the schedule's order, without overlap;
    with 20 ms stages the makespan is at least the simulated one at those costs."""
    from funcshard.pipeline import one_f_one_b, trace

    mesh = fs.make_mesh({"pp": 2}, backend="sim")
    sched = one_f_one_b(2, 4)

    def stage_fn(p, x):
        time.sleep(0.02)
        return x @ p[0]

    def step(w, xs):
        return run(sched, stage_fn, w, xs, loss_fn=lambda y: y.sum())

    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P()), out_specs=(P(), P("pp")))
    with trace() as tr:
        f(torch.ones(2, 1, 3, 3), torch.ones(4, 2, 3))
    assert [[a for _, _, a in row] for row in tr.timeline] == [list(r) for r in sched.actions]
    for row in tr.timeline:
        assert all(b <= e for b, e, _ in row) and all(e0 <= b1 for (_, e0, _), (b1, _, _) in itertools.pairwise(row))
    assert tr.makespan >= sched.simulate({"F": 0.02, "B": 1e-6}).makespan * 0.95
    with trace() as empty:
        pass
    assert empty.timeline == [] and empty.bubble_fraction == 0.0
