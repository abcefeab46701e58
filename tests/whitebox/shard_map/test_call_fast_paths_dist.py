"""The per-call fast paths of a ``shard_map`` step (counted, not timed), each checked against the general path:

- under ``"dist"`` a call that reshards and donates nothing runs from the arguments' flat leaves
  (``_executor.run_local``): the same numbers, bit for bit, as the general path, and no tag left behind;
- a collective's backward that is not differentiated calls the collective itself (no ``Function`` applied);
  differentiated again, it records one, and the second derivative is right;
- an Array argument's spec is keyed by its object (kept alive by the signature): an equal spec that is another
  object is a new signature, with the same result."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


def _step_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.collectives.vma import TAG_ATTR
    from funcshard._src.shard_map import api as _shard_map

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=gen)
    x = torch.randn(2, 3, generator=gen)
    z = torch.randn(4, 2, generator=gen)
    extra = {"a": torch.randn(2, generator=gen), "b": 2.0}
    x_before = x.clone()
    w_arr = fs.device_put(w, mesh, P(None, "tp"))

    def loss(w: torch.Tensor, x: torch.Tensor, z: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        h = torch.tanh(fs.pvary(x, "tp") @ w)  # [b, d] @ [d, h/tp] -> [b, h/tp]
        y = fs.psum(h @ z, "tp")  # [b, h/tp] @ [h/tp, 2] -> [b, 2], summed over tp
        return ((y + extra["a"]) ** 2).mean() * extra["b"]

    def body(w: torch.Tensor, x: torch.Tensor, z: torch.Tensor, extra: dict[str, Any], scale: float) -> Any:
        value, grads = fs.value_and_grad(loss, argnums=(0, 1))(w, x, z, extra)
        return value * scale, grads

    specs = (P(None, "tp"), P(), P("tp"), {"a": P(), "b": P()}, P())
    out_specs = (P(), (P(None, "tp"), P()))
    fast = fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    general = fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False, donate=(4,))
    used = {"n": 0}
    real = _shard_map.run_local

    def counted(*a: Any) -> Any:
        used["n"] += 1
        return real(*a)

    with mock.patch.object(_shard_map, "run_local", counted):
        outs_fast = [fast(w_arr, x, z, extra, 0.5) for _ in range(2)]
        fast_uses = used["n"]
        out_general = general(w_arr, x, z, extra, 0.5)
        general_uses = used["n"] - fast_uses

    def flat(out: Any) -> list[torch.Tensor]:
        value, (gw, gx) = out
        return [fs.device_get(value), fs.device_get(gw), fs.device_get(gx)]

    ref_w, ref_x = w.clone().requires_grad_(), x.clone().requires_grad_()
    ref = ((torch.tanh(ref_x @ ref_w) @ z + extra["a"]) ** 2).mean() * extra["b"]
    ref_gw, ref_gx = torch.autograd.grad(ref, (ref_w, ref_x))
    got = flat(outs_fast[-1])
    untagged = [t for t in (x, z, extra["a"], *w_arr.shards.values()) if TAG_ATTR in t.__dict__] == []
    outs_untagged = all(
        TAG_ATTR not in t.__dict__ for out in outs_fast for a in (out[0], *out[1]) for t in a.shards.values()
    )
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(got, flat(out_general), strict=True))
        and all(torch.equal(a, b) for a, b in zip(flat(outs_fast[0]), got, strict=True)),
        "close": torch.allclose(got[0], ref.detach() * 0.5)
        and torch.allclose(got[1], ref_gw)
        and torch.allclose(got[2], ref_gx),
        "fast_uses": fast_uses,
        "general_uses": general_uses,
        "untagged": untagged and outs_untagged,
        "x_kept": torch.equal(x, x_before),
    }


def test_dist_fast_path_equals_the_general_path(run, backend) -> None:
    for r in run(_step_body, {"tp": 2}):
        assert r["bitwise"] and r["close"] and r["untagged"] and r["x_kept"], r
        assert r["general_uses"] == 0, r  # (a donation takes the general path)
        assert r["fast_uses"] == (2 if backend == "dist" else 0), r


@contextlib.contextmanager
def _counting_applies() -> Iterator[dict[str, int]]:
    """Counts the ``AllReduce`` Functions applied (their ``setup_context`` runs) while inside."""
    from funcshard._src.collectives import prims as _prims

    made = {"n": 0}
    real = _prims.AllReduce.setup_context

    def counted(*a: Any) -> Any:
        made["n"] += 1
        return real(*a)

    _prims.AllReduce.setup_context = staticmethod(counted)
    try:
        yield made
    finally:
        _prims.AllReduce.setup_context = staticmethod(real)


def _pvary_backward_body(mesh: fs.Mesh) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, generator=gen)
    w = torch.randn(4, 3, generator=gen)  # rows sharded over tp

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x invariant: its gradient is summed over tp
        return fs.psum(((w @ fs.pvary(x, "tp")) ** 2).sum(), "tp")

    grad = fs.shard_map(
        lambda x, w: fs.value_and_grad(loss)(x, w)[1],
        mesh=mesh,
        in_specs=(P(), P("tp")),
        out_specs=P(),
        check_vma=False,
    )
    # the second derivative along v = 1: d/dx <grad, 1> = 2 w^T w 1 (pvary'd and psum'd twice: the full sum)
    hvp = fs.shard_map(
        lambda x, w: fs.value_and_grad(lambda x: fs.value_and_grad(loss)(x, w)[1].sum())(x)[1],
        mesh=mesh,
        in_specs=(P(), P("tp")),
        out_specs=P(),
        check_vma=False,
    )
    with _counting_applies() as made:
        g = fs.device_get(grad(x, w))
        once = made["n"]
        made["n"] = 0
        h = fs.device_get(hvp(x, w))
        twice = made["n"]
    return {
        "once": once,
        "twice": twice,
        "grad": torch.allclose(g, 2 * w.T @ (w @ x)),
        "hvp": torch.allclose(h, 2 * w.T @ (w @ torch.ones(3))),
    }


def test_pvary_backward_applies_no_function_unless_differentiated(run, backend) -> None:
    for r in run(_pvary_backward_body, {"tp": 2}):
        assert r["grad"] and r["hvp"], r
        if backend == "dist":  # (sim keeps a forward-AD level open around its devices: the Function is applied)
            assert r["once"] == 1, r  # the forward's psum only: the pvary's backward sums without a Function
        assert r["twice"] > r["once"], r  # differentiated again: the backward's sum is recorded


def _closed_over(fn: Any, kind: type) -> list[Any]:
    """The objects of ``kind`` that ``fn`` closes over, through the functions it closes over (shard_map's
    ``mapped`` lies behind a wrapper that hides it from torch.compile)."""
    found, seen, todo = [], set(), [fn]
    while todo:
        g = todo.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        for c in getattr(g, "__closure__", None) or ():
            v = c.cell_contents
            if isinstance(v, kind):
                found.append(v)
            elif callable(v):
                todo.append(v)
    return found


def test_equal_spec_objects_are_planned_apart_with_the_same_result() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    x = torch.arange(8.0).reshape(4, 2)
    f = fs.shard_map(lambda a: a * 2, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    a1 = fs.device_put(x, mesh, P("tp"))
    a2 = fs.device_put(x, mesh, P("tp"))  # an equal spec, another object
    assert a1.spec == a2.spec and a1.spec is not a2.spec
    r1, r2 = f(a1), f(a2)
    assert torch.equal(fs.device_get(r1), x * 2) and torch.equal(fs.device_get(r2), x * 2)
    from funcshard._src.shard_map.io import InputCache

    (cache,) = _closed_over(f, InputCache)
    pins = [sig.pins for sig in cache.specs.values()]
    assert len(pins) == 2 and any(p[0] is a1.spec for p in pins) and any(p[0] is a2.spec for p in pins)


def _plan_once_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.collectives.vma import TAG_ATTR
    from funcshard._src.shard_map.io import InputCache

    gen = torch.Generator().manual_seed(2)
    w = fs.device_put(torch.randn(4, 3, generator=gen), mesh, P("tp"))
    x = torch.randn(3, generator=gen)

    def step(w: torch.Tensor, x: torch.Tensor) -> Any:
        value, g = fs.value_and_grad(lambda w: fs.psum(((w @ x) ** 2).sum(), "tp"))(w)
        fresh = g * 2
        return value, g, fresh, fresh.detach()  # the last two share one storage: neither is the Array's alone

    f = fs.shard_map(step, mesh=mesh, in_specs=(P("tp"), P()), out_specs=(P(), P("tp"), P("tp"), P("tp")))
    bad = fs.shard_map(lambda w: w * 2, mesh=mesh, in_specs=(P("tp"),), out_specs=P())  # varies over tp: raises
    f(w, x)  # (the signatures planned)
    calls = {"n": 0}
    real = InputCache.out_plan

    def counted(self: Any, *a: Any) -> Any:
        calls["n"] += 1
        return real(self, *a)

    with mock.patch.object(InputCache, "out_plan", counted):
        value, g, fresh, alias = f(w, x)
    try:
        bad(w)
        raised = False
    except fs.ShardingError:
        raised = True
    blocks = [t for a in (value, g, fresh, alias) for t in a.shards.values()]
    ref_w = fs.device_get(w).clone().requires_grad_()
    ref = ((ref_w @ x) ** 2).sum()
    (ref_g,) = torch.autograd.grad(ref, (ref_w,))
    return {
        "plans": calls["n"],
        "owned": (value.owned, g.owned, fresh.owned, alias.owned),
        "untagged": all(TAG_ATTR not in t.__dict__ for t in blocks),
        "raised": raised,
        "close": torch.allclose(fs.device_get(g), ref_g) and torch.allclose(fs.device_get(value), ref.detach()),
    }


def test_dist_fast_path_plans_outputs_once_and_clears_their_tags(run, backend) -> None:
    for r in run(_plan_once_body, {"tp": 2}):
        assert r["close"] and r["untagged"] and r["raised"], r
        assert r["owned"][:2] == (True, True) and not (r["owned"][2] and r["owned"][3]), r
        if backend == "dist":  # the plan the outputs' pvarys were made by is the one they are assembled by
            assert r["plans"] == 1, r
