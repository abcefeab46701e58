"""What the vma mode and a repeat ``shard_map`` call no longer do per op / per call (counted, not timed): a read of
a tensor's metadata (``x.shape``, ``x.dim()``, ``x.size(0)``) is handed to torch without a tag lookup, an invariant
constant that meets a varying value is not widened (no view, no ``pvary``) while the result is tagged as before
and the constant keeps its own tag, ``fs.value_and_grad`` makes no ``functools.wraps`` per call, and a dist call
reuses its device context and executor; every result equals the unsharded function's, sim and dist."""

from __future__ import annotations

import collections
import functools
from typing import Any
from unittest import mock

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


def _reads_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.collectives import vma as _vma

    calls: collections.Counter[str] = collections.Counter()
    real = _vma.get_vma

    def counted(t: torch.Tensor) -> frozenset[str]:
        calls["get_vma"] += 1
        return real(t)

    def f(x: torch.Tensor) -> torch.Tensor:
        v = torch.ones(4, 2)  # a constant: untagged (each read of it looked its tag up the slow way)
        _vma.get_vma = counted
        try:
            n = v.shape[0] + v.dim() + v.size(0) + v.numel() + int(v.is_floating_point()) + len(v)
        finally:
            _vma.get_vma = real
        return x * n

    x = torch.arange(8.0).reshape(4, 2)
    out = fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
    return {"lookups": calls["get_vma"], "close": torch.equal(fs.device_get(out), x * (4 + 2 + 4 + 8 + 1 + 4))}


def test_metadata_reads_skip_the_tag_lookup(run, backend) -> None:
    for r in run(_reads_body, {"dp": 2}):
        assert r["close"], r
        assert r["lookups"] == 0, r  # six reads of an untagged constant: no tag looked up (was 6)


def _constant_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.collectives import vma as _vma

    made: collections.Counter[str] = collections.Counter()
    real = _vma.pvary_to

    def counted(x: torch.Tensor, want: frozenset[str], dev: Any) -> torch.Tensor:
        made["pvary_to"] += 1
        return real(x, want, dev)

    seen: dict[str, Any] = {}
    scale = torch.linspace(0.5, 2.0, 3)  # a constant (no grad): closed over, invariant

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = (x @ w) * scale  # [b/dp, 3] @ [3, 3] -> [b/dp, 3]; varying over dp meets the invariant constant
        same = scale.type_as(y)  # torch hands the constant itself back: the mode gives a view in its stead
        seen["fresh"] = same is not scale
        seen["same_tag"] = _vma.get_vma(same)
        seen["scale_tag"] = _vma.find_vma(scale)
        seen["y_tag"] = _vma.get_vma(y)
        return fs.psum(((y + same) ** 2).sum(), "dp")

    def step(w: torch.Tensor, x: torch.Tensor) -> Any:
        _vma.pvary_to = counted
        try:
            return fs.value_and_grad(loss)(w, x)
        finally:
            _vma.pvary_to = real

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 3, generator=gen), torch.randn(4, 3, generator=gen)
    value, grad = fs.shard_map(step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()))(w, x)

    def ref(w: torch.Tensor) -> torch.Tensor:
        y = (x @ w) * scale
        return ((y + scale) ** 2).sum()

    ref_grad, ref_value = torch.func.grad_and_value(ref)(w)
    return {
        "made": made["pvary_to"],
        "seen": seen,
        "close": torch.allclose(fs.device_get(value), ref_value) and torch.allclose(fs.device_get(grad), ref_grad),
    }


def test_constants_meet_varying_values_without_a_view(run, backend) -> None:
    for r in run(_constant_body, {"dp": 2}):
        assert r["close"], r  # w's gradient summed over dp, as the unsharded function's
        seen = r["seen"]
        assert seen["y_tag"] == {"dp"} and seen["same_tag"] == {"dp"}, r  # results tagged with the union
        assert seen["fresh"] and seen["scale_tag"] is None, r  # the constant itself keeps no tag
        # per device: w widened (the invariant parameter meeting the varying batch) and the psum's operand
        # checked; the constant met a varying value twice (* scale, type_as) without a pvary_to (7 before, dist)
        n_dev = 2 if backend == "sim" else 1  # sim counts both devices in this process
        assert r["made"] == 2 * n_dev, r


def _vag_body(mesh: fs.Mesh) -> dict[str, Any]:
    wraps = collections.Counter()
    real = functools.update_wrapper

    def counted(*a: Any, **kw: Any) -> Any:
        wraps["n"] += 1
        return real(*a, **kw)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The loss."""
        return fs.psum(((x @ w) ** 2).sum(), "dp")  # [b/dp, 3] @ [3] -> [b/dp]

    g = fs.shard_map(lambda w, x: fs.value_and_grad(loss)(w, x), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(3, generator=gen), torch.randn(4, 3, generator=gen)
    with mock.patch.object(functools, "update_wrapper", counted):
        outs = [g(w, x) for _ in range(3)]
    ref_grad, ref_value = torch.func.grad_and_value(lambda w: ((x @ w) ** 2).sum())(w)
    vag = fs.value_and_grad(loss)
    return {
        "wraps": wraps["n"],
        "meta": (vag.__name__, vag.__qualname__.rsplit(".", 1)[-1], vag.__doc__, vag.__wrapped__ is loss),
        "close": all(
            torch.allclose(fs.device_get(v), ref_value) and torch.allclose(fs.device_get(gr), ref_grad)
            for v, gr in outs
        ),
    }


def test_value_and_grad_makes_no_wrapper_per_call(run, backend) -> None:
    for r in run(_vag_body, {"dp": 2}):
        assert r["close"], r
        assert r["wraps"] == 0, r  # was one functools.wraps per call of the step
        assert r["meta"] == ("loss", "loss", "The loss.", True), r


def test_value_and_grad_binds_as_a_method() -> None:
    class Model:
        scale = 3.0
        loss = fs.value_and_grad(lambda self, w: self.scale * (w**2).sum(), argnums=1)

    value, grad = Model().loss(torch.tensor([1.0, 2.0]))
    assert torch.equal(value, torch.tensor(15.0)) and torch.equal(grad, torch.tensor([6.0, 12.0]))


def _context_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.runtime import context as _context
    from funcshard._src.shard_map import executor as _executor

    made = collections.Counter()
    real_ctx, real_ex = _context.DeviceContext, _executor.executor_for

    def ctx(*a: Any, **kw: Any) -> Any:
        made["context"] += 1
        return real_ctx(*a, **kw)

    def ex(*a: Any, **kw: Any) -> Any:
        made["executor_for"] += 1
        return real_ex(*a, **kw)

    f = fs.shard_map(lambda x: fs.psum(x * 2, "dp"), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    x = torch.arange(4.0)
    f(x)  # the first call: its context and executor made / found
    with (
        mock.patch.object(_executor, "DeviceContext", ctx),
        mock.patch("funcshard._src.shard_map.api.executor_for", ex),
    ):
        outs = [f(x) for _ in range(3)]
    want = (x[:2] + x[2:]) * 2
    return {"made": dict(made), "close": all(torch.equal(fs.device_get(o), want) for o in outs)}


def test_repeat_calls_reuse_context_and_executor(run, backend) -> None:
    for r in run(_context_body, {"dp": 2}):
        assert r["close"], r
        assert r["made"].get("executor_for", 0) == 0, r  # kept by the shard_map'd function
        # dist: the process's device context made once; sim: its devices live one call, so one each per call
        assert r["made"].get("context", 0) == (0 if backend == "dist" else 2 * 3), r
