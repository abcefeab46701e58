"""The pipeline runtime's per-microbatch cuts under the vma mode, with counters (sim and dist).

- ``stage_fn`` runs tracked (under the vma mode) once per chunk and step when that run is plain; the chunk's
  later microbatches replay it untracked, with the same loss and gradients, bit for bit, as without replay.
- A stage whose tracked run needs a ``pvary`` (parameters replicated over ``dp`` meeting a ``dp``-sharded
  batch) is tracked on every microbatch, and its gradients are summed over ``dp``.
- A collective that only later microbatches make (control flow on the data) raises.
- The parameter gradients are accumulated by the autograd engine: the runtime's Python adds or copies none.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import lax as core_lax
from funcshard.pipeline import PipelineGrads, by_name, run, stage_order

pytestmark = pytest.mark.counters

D, H, ROWS, M = 4, 6, 3, 4

_calls: Counter[tuple[int, bool]] = Counter()  # (stage, tracked) -> stage_fn calls, while counting
_lock = threading.Lock()
_counting = threading.local()


def _mlp(params: Any, x: torch.Tensor) -> torch.Tensor:
    if getattr(_counting, "on", False):
        with _lock:
            _calls[(core_lax.axis_index_int("pp"), torch._C._is_torch_function_enabled())] += 1
    for a, b in zip(params[0], params[1], strict=True):
        x = x + torch.tanh(x @ a) @ b  # [rows, D] @ [D, H] @ [H, D] -> [rows, D]
    return x


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def _data(n: int, m: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    w1 = torch.randn(n, 2, D, H, generator=g, dtype=torch.float64) / 2  # [virtual stage, layer, D, H]
    w2 = torch.randn(n, 2, H, D, generator=g, dtype=torch.float64) / 2  # [virtual stage, layer, H, D]
    xs = torch.randn(m, ROWS, D, generator=g, dtype=torch.float64)
    ts = torch.randn(m, ROWS, D, generator=g, dtype=torch.float64)
    return w1, w2, xs, ts


def _reference(w1: torch.Tensor, w2: torch.Tensor, xs: torch.Tensor, ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    losses = []
    for x, t in zip(xs, ts, strict=True):
        for i in range(w1.shape[0]):
            x = _mlp((w1[i], w2[i]), x)
        losses.append(_mse(x, t))
    loss = torch.stack(losses).mean()
    return (loss.detach(), *torch.autograd.grad(loss, (w1, w2)))


def _replay_body(mesh: fs.Mesh, name: str) -> dict[str, Any]:
    p = mesh.shape["pp"]
    sched = by_name(name, p, M)
    w1, w2, xs, ts = _data(p * sched.n_virtual, M)
    order = stage_order(sched)
    back = torch.tensor(order).argsort()
    got = {}
    for vma in (True, False):

        def step(w: Any, xs: torch.Tensor, ts: torch.Tensor, vma: bool = vma) -> Any:
            _counting.on = vma
            try:
                return run(sched, _mlp, w, xs, targets=ts, loss_fn=_mse)
            finally:
                _counting.on = False

        f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")), check_vma=vma)
        _calls.clear()
        loss, (g1, g2) = f((w1[order], w2[order]), xs, ts)
        got[vma] = (fs.device_get(loss).reshape(()), fs.device_get(g1)[back], fs.device_get(g2)[back])
        if vma:
            calls = dict(_calls)
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b), "check_vma=True (replayed) differs from check_vma=False"
    ref = _reference(w1, w2, xs, ts)
    for a, b in zip(got[True], ref, strict=True):
        torch.testing.assert_close(a, b)
    me = None if mesh.backend == "sim" else torch.distributed.get_rank()
    return {"calls": {k: v for k, v in calls.items() if me is None or k[0] == me}, "v": sched.n_virtual}


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb"])
def test_stage_fn_tracked_once_per_chunk_then_replayed(run, backend: str, name: str) -> None:
    results = run(_replay_body, {"pp": 2}, name)
    calls: Counter[tuple[int, bool]] = Counter()
    for r in results:
        calls.update(r["calls"])
    v = results[0]["v"]
    for s in range(2):  # per stage: one tracked call per chunk, the other microbatches replayed
        assert calls[(s, True)] == v, calls
        assert calls[(s, False)] == v * (M - 1), calls


def _dp_body(mesh: fs.Mesh) -> str:
    sched = by_name("1f1b", 2, M)
    w1, w2, xs, ts = _data(2, M)
    rows = 2 * ROWS
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(M, rows, D, generator=g, dtype=torch.float64)
    ts = torch.randn(M, rows, D, generator=g, dtype=torch.float64)

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fs.pmean(_mse(y, t), "dp")

    def step(w: Any, xs: torch.Tensor, ts: torch.Tensor) -> Any:
        _counting.on = True
        try:
            return run(sched, _mlp, w, xs, targets=ts, loss_fn=loss_fn)
        finally:
            _counting.on = False

    # the batch's rows split over dp, the parameters replicated over it: each op mixes {pp, dp} with {pp}
    spec = P(None, "dp")
    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), spec, spec), out_specs=(P(), P("pp")))
    _calls.clear()
    loss, (g1, g2) = f((w1, w2), xs, ts)
    tracked = sum(n for (_, on), n in _calls.items() if on)
    untracked = sum(n for (_, on), n in _calls.items() if not on)
    ref = _reference(w1, w2, xs, ts)
    torch.testing.assert_close(fs.device_get(loss).reshape(()), ref[0])
    torch.testing.assert_close(fs.device_get(g1), ref[1])  # summed over dp (the pvary's backward)
    torch.testing.assert_close(fs.device_get(g2), ref[2])
    devices = 4 if mesh.backend == "sim" else 1
    assert (tracked, untracked) == (devices * M, 0), (tracked, untracked)
    return "ok"


def test_a_stage_that_needs_pvary_is_tracked_on_every_microbatch(run) -> None:
    assert set(run(_dp_body, {"pp": 2, "dp": 2})) == {"ok"}


def _sometimes_psum(params: Any, x: torch.Tensor) -> torch.Tensor:
    y = _mlp(params, x)
    if bool(x.abs().sum() > 0):  # control flow on the data: microbatch 0 is zeros
        y = fs.psum(y, "tp") / 2
    return y


def test_a_collective_only_later_microbatches_make_raises() -> None:
    mesh = fs.make_mesh({"pp": 2, "tp": 2}, backend="sim")
    sched = by_name("1f1b", 2, M)
    w1, w2, xs, ts = _data(2, M)
    xs[0] = 0
    w1[:, :, :, :] = w1 * 0  # every stage maps zeros to zeros: microbatch 0 makes no collective anywhere

    def step(w: Any, xs: torch.Tensor, ts: torch.Tensor) -> Any:
        return run(sched, _sometimes_psum, w, xs, targets=ts, loss_fn=_mse)

    f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")))
    with pytest.raises(fs.ShardingError, match="same ops on every microbatch"):
        f((w1, w2), xs, ts)


def _no_python_accumulation_body(mesh: fs.Mesh, name: str) -> dict[str, int]:
    p = mesh.shape["pp"]
    sched = by_name(name, p, M)
    w1, w2, xs, ts = _data(p * sched.n_virtual, M)
    order = stage_order(sched)
    seen = Counter()
    originals = {k: getattr(torch.Tensor, k) for k in ("add_", "clone", "copy_")}

    def counted(k: str) -> Any:
        fn = originals[k]

        def wrapper(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.endswith("runtime.py"):
                seen[k] += 1
            return fn(self, *a, **kw)

        return wrapper

    f = fs.shard_map(
        lambda w, xs, ts: run(sched, _mlp, w, xs, targets=ts, loss_fn=_mse),
        mesh=mesh,
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    for k in originals:
        setattr(torch.Tensor, k, counted(k))
    try:
        f((w1[order], w2[order]), xs, ts)
    finally:
        for k, fn in originals.items():
            setattr(torch.Tensor, k, fn)
    return dict(seen)


@pytest.mark.parametrize("name", ["1f1b", "zb", "interleaved"])
def test_gradients_accumulate_in_the_engine_not_in_python(run, name: str) -> None:
    for seen in run(_no_python_accumulation_body, {"pp": 2}, name):  # per device (sim: all of them)
        # no add_ / copy_ from run's code, and no copy of a gradient: one clone at most (the loss note it receives)
        assert seen.get("add_", 0) == seen.get("copy_", 0) == 0, seen
        assert seen.get("clone", 0) <= 1, seen


_fn_calls: Counter[tuple[str, bool]] = Counter()  # (function, tracked) -> calls, while counting


def _first(sh: Any, tok: torch.Tensor) -> torch.Tensor:
    if getattr(_counting, "on", False):
        with _lock:
            _fn_calls[("first_fn", torch._C._is_torch_function_enabled())] += 1
    return sh["emb"][tok]  # [ROWS] -> [ROWS, D]


def _head_loss(sh: Any, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if getattr(_counting, "on", False):
        with _lock:
            _fn_calls[("loss_fn", torch._C._is_torch_function_enabled())] += 1
    return torch.nn.functional.cross_entropy(y @ sh["head"], t)  # [ROWS, D] @ [D, 7] -> []


def _shared_body(mesh: fs.Mesh) -> dict[tuple[str, bool], int]:
    sched = by_name("1f1b", 2, M)
    w1, w2, _, _ = _data(2, M)
    g = torch.Generator().manual_seed(9)
    sh = {
        "emb": torch.randn(7, D, generator=g, dtype=torch.float64),  # [vocab, D]
        "head": torch.randn(D, 7, generator=g, dtype=torch.float64),  # [D, vocab]
    }
    tok, tgt = torch.randint(0, 7, (M, ROWS), generator=g), torch.randint(0, 7, (M, ROWS), generator=g)
    got, calls = {}, {}
    for vma in (True, False):

        def step(w: Any, sh: Any, tok: torch.Tensor, tgt: torch.Tensor, vma: bool = vma) -> Any:
            _counting.on = vma
            try:
                return run(sched, _mlp, w, tok, targets=tgt, loss_fn=_head_loss, first_fn=_first, shared_params=sh)
            finally:
                _counting.on = False

        f = fs.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("pp"), P(), P(), P()),
            out_specs=(P(), PipelineGrads(P("pp"), P(), None)),
            check_vma=vma,
        )
        _fn_calls.clear()
        loss, grads = f((w1, w2), sh, tok, tgt)
        got[vma] = [fs.device_get(t) for t in (loss, *grads.stage, *grads.shared.values())]
        if vma:
            calls = dict(_fn_calls)
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b), "check_vma=True (replayed) differs from check_vma=False"
    return calls


def test_first_fn_and_loss_fn_tracked_once_then_replayed(run) -> None:
    calls: Counter[tuple[str, bool]] = Counter()
    for r in run(_shared_body, {"pp": 2}):
        calls.update(r)
    # the stage holding virtual stage 0 embeds M microbatches, the last one computes M losses
    assert calls == {("first_fn", True): 1, ("first_fn", False): M - 1, ("loss_fn", True): 1, ("loss_fn", False): M - 1}
