"""What a repeat ``shard_map`` call no longer redoes (counted, not timed): the argument checks, the resharding
plans and the output plan are made once per call signature, a new signature (another shape, another layout)
makes them again, and the results equal the unsharded function's, sim and dist."""

from __future__ import annotations

import collections
from typing import Any
from unittest import mock

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


def _signature_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.shard_map import io as io

    calls: collections.Counter[str] = collections.Counter()

    def counting(name: str, real: Any) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            calls[name] += 1
            return real(*a, **kw)

        return counted

    def f(w: torch.Tensor, x: torch.Tensor, scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = x @ w  # [b/dp, d] @ [d, h] -> [b/dp, h]
        return fs.psum(y.sum(), "dp") * scale, {"y": y}

    g = fs.shard_map(f, mesh=mesh, in_specs=(P(), P("dp"), P()), out_specs=(P(), {"y": P("dp")}))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 6, generator=gen), torch.randn(4, 3, generator=gen)
    w_cols = fs.device_put(w, mesh, P(None, "dp"))  # laid out otherwise: resharded to P() on the devices
    patches = [
        mock.patch.object(io, "_check_inputs", counting("check", io._check_inputs)),
        mock.patch.object(io, "reshard_plan", counting("reshard_plan", io.reshard_plan)),
        mock.patch.object(io, "_out_plan", counting("out_plan", io._out_plan)),
    ]
    for p in patches:
        p.start()
    try:
        outs = [g(w_cols, x, 2.0) for _ in range(3)]
        first = dict(calls)
        x2 = torch.randn(6, 3, generator=gen)  # a new shape: a new signature
        out2 = g(w_cols, x2, 2.0)
        second = dict(calls)
    finally:
        for p in reversed(patches):
            p.stop()
    equal = all(
        torch.allclose(fs.device_get(s), (x @ w).sum() * 2.0) and torch.allclose(fs.device_get(d["y"]), x @ w)
        for s, d in outs
    ) and torch.allclose(fs.device_get(out2[1]["y"]), x2 @ w)
    return {"first": first, "second": second, "equal": equal}


def test_checks_and_plans_once_per_signature(run, backend) -> None:
    for r in run(_signature_body, {"dp": 2}):
        assert r["equal"], r
        assert r["first"] == {"check": 1, "reshard_plan": 1, "out_plan": 1}, r  # 3 calls, 1 signature
        assert r["second"] == {"check": 2, "reshard_plan": 2, "out_plan": 2}, r  # a new input and output shape


def test_axes_checked_once_per_name_and_mesh() -> None:
    from funcshard._src.runtime import context as _context

    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    _context._AXES.clear()
    assert _context.axes_of("tp", mesh, "f") == ("tp",)
    assert _context.axes_of(("dp", "tp"), mesh, "f") == ("dp", "tp")
    assert set(_context._AXES) == {("tp", id(mesh)), (("dp", "tp"), id(mesh))}  # (keyed by the mesh object)
    assert _context.axes_of("tp", mesh, "f") is _context._AXES[("tp", id(mesh))][0]  # the checked tuple, not a new one
    # an equal mesh that is another object: checked on its own (never another mesh's entry)
    other = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    assert _context.axes_of("tp", other, "f") == ("tp",) and len(_context._AXES) == 3
    small = fs.make_mesh({"dp": 2}, backend="sim")
    try:
        _context.axes_of("tp", small, "f")
    except fs.ShardingError:
        pass
    else:
        raise AssertionError("axes_of accepted an axis the mesh lacks")
    _context._AXES.clear()
    _context.axes_of("tp", mesh, "f")
    _context.axes_of(("dp", "tp"), mesh, "f")
    for bad in (("tp", "tp"), "zz", ("dp", ["tp"])):  # refused every time, never cached
        try:
            _context.axes_of(bad, mesh, "f")
        except fs.ShardingError:
            pass
        else:
            raise AssertionError(f"axes_of accepted {bad!r}")
    assert len(_context._AXES) == 2


def _audit_env_body(mesh: fs.Mesh) -> dict[str, Any]:
    import os

    def loss(w: torch.Tensor) -> torch.Tensor:
        # w is invariant over tp (P()) and so is its product: untracked, psum's gradient misses the sum over tp
        return fs.psum((w * 2.0).sum(), "tp")

    def step(w: torch.Tensor) -> Any:
        return fs.value_and_grad(loss)(w)

    g = fs.shard_map(step, mesh=mesh, in_specs=(P(),), out_specs=(P(), P()), check_vma=False)
    w = torch.ones(3)
    raised = []
    for flag in (None, "1", "0", None):  # set and unset between the calls of one shard_map'd function
        if flag is None:
            os.environ.pop("FUNCSHARD_AUDIT", None)
        else:
            os.environ["FUNCSHARD_AUDIT"] = flag
        try:
            g(w)
            raised.append(False)
        except fs.ShardingError as e:
            raised.append("check_vma=False" in str(e))
    os.environ.pop("FUNCSHARD_AUDIT", None)
    return {"raised": raised}


@pytest.mark.dist
def test_audit_variable_read_on_every_call_under_dist() -> None:
    from _dist_pool import run_body

    for r in run_body("dist", _audit_env_body, {"tp": 2}):
        assert r["raised"] == [False, True, False, False], r
