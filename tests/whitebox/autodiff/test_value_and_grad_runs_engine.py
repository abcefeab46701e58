"""What ``fs.value_and_grad`` does per call inside ``shard_map`` (counted, not timed): it runs the autograd engine
itself, so the vma mode sees none of its backward (no torch function of a collective's backward, no
``torch.autograd.grad``), other torch function modes still see the call, and the gradients are those of the
unsharded function, sim and dist."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


def _loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    # x invariant meets w1 sharded over tp: the vma mode inserts a pvary (its backward: a psum over tp)
    h = torch.tanh(F.linear(x, w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
    out = fs.psum(F.linear(h, w2), "tp")  # [b, h/tp] @ [h/tp, d] -> [b, d]
    return (out**2).mean()


def _ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.linear(torch.tanh(F.linear(x, w1)), w2) ** 2).mean()


def _backward_dispatch_body(mesh: fs.Mesh) -> dict[str, Any]:
    from funcshard._src.collectives.vma import VmaMode

    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(4, 6, generator=gen), torch.randn(8, 6, generator=gen), torch.randn(6, 8, generator=gen)
    seen: list[str] = []
    phase = threading.local()  # per device thread (sim runs the devices in threads)
    plain = VmaMode.__torch_function__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(phase, "backward", False):
            seen.append(getattr(func, "__name__", str(func)))
        return plain(self, func, types, args, kwargs)

    def loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        value = _loss(x, w1, w2)
        phase.backward = True  # from here on: what value_and_grad does after f (its backward)
        return value

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Any:
        out = fs.value_and_grad(loss, argnums=(0, 1, 2))(x, w1, w2)
        phase.backward = False
        return out

    specs = (P(), P("tp", None), P(None, "tp"))
    f = fs.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(), specs))
    VmaMode.__torch_function__ = counted
    try:
        value, grads = f(x, w1, w2)
    finally:
        VmaMode.__torch_function__ = plain
    ref_value, ref_grads = torch.func.grad_and_value(_ref, argnums=(0, 1, 2))(x, w1, w2)[::-1]
    close = torch.allclose(fs.device_get(value), ref_value, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(fs.device_get(g), r, rtol=1e-5, atol=1e-6) for g, r in zip(grads, ref_grads, strict=True)
    )
    return {"seen": seen, "close": close, "tags": [g.spec for g in grads]}


def test_backward_runs_outside_the_vma_mode(run, backend) -> None:
    for r in run(_backward_dispatch_body, {"tp": 2}):
        assert r["close"], r
        # the collectives' backwards (the pvary's psum of x's cotangent) and the engine call: none through the mode
        assert r["seen"] == [], r
        assert r["tags"] == [P(), P("tp", None), P(None, "tp")], r


class _Log(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_users_torch_function_mode_still_sees_the_gradient_call() -> None:
    """Under a mode of the caller's own (here around ``value_and_grad`` outside shard_map) the call goes through
    ``torch.autograd.grad``, so that mode sees it; the numbers are the same."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, generator=gen)
    vg = fs.value_and_grad(lambda w: (w.sin() ** 2).sum())
    plain_value, plain_grad = vg(w)
    with _Log() as log:
        value, grad = vg(w)
    assert "grad" in log.names, log.names
    assert torch.equal(value, plain_value) and torch.equal(grad, plain_grad)
    torch.testing.assert_close(grad, 2 * w.sin() * w.cos())


def test_complex_value_still_raises_as_torch_does() -> None:
    w = torch.randn(2, dtype=torch.complex64)
    try:
        fs.value_and_grad(lambda w: (w * w).sum())(w)
    except (RuntimeError, TypeError) as e:  # torch.func / autograd: a complex output has no implicit gradient
        assert "complex" in str(e).lower() or "real" in str(e).lower(), e
    else:
        raise AssertionError("a complex value was differentiated without an error")


@contextlib.contextmanager
def _counting_pvary() -> Iterator[dict[str, int]]:
    """Counts the ``Pvary`` Functions made (their forwards run) while inside: ``{"n": count}``."""
    from funcshard._src.collectives import prims as _prims

    made = {"n": 0}
    real = _prims.Pvary.forward

    def counted(*a: Any) -> Any:
        made["n"] += 1
        return real(*a)

    _prims.Pvary.forward = staticmethod(counted)
    try:
        yield made
    finally:
        _prims.Pvary.forward = staticmethod(real)


def _psum_transpose_body(mesh: fs.Mesh) -> dict[str, Any]:
    """How many ``Pvary`` Functions a psum's backward makes: none when the backward records no graph (its
    transpose is the identity there), one when it is differentiated again; and the second derivative is right."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, generator=gen)

    def loss(x: torch.Tensor) -> torch.Tensor:  # x sharded over tp: d/dx of sum(psum(x)^3) = 3 psum(x)^2
        return (fs.psum(x, "tp") ** 3).sum()

    grad_once = fs.shard_map(lambda x: fs.value_and_grad(loss)(x)[1], mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    # the second derivative along v = 1: d/dx of <grad, 1> = 6 psum(x) * n (each device's psum sums n copies)
    hvp = fs.shard_map(
        lambda x: fs.value_and_grad(lambda x: fs.psum(fs.value_and_grad(loss)(x)[1].sum(), "tp"))(x)[1],
        mesh=mesh,
        in_specs=(P("tp"),),
        out_specs=P("tp"),
    )
    with _counting_pvary() as made:
        g = fs.device_get(grad_once(x))
        once = made["n"]
        made["n"] = 0
        h = fs.device_get(hvp(x))
        twice = made["n"]
    s = x.reshape(2, 2).sum(0)  # psum over the 2 devices of tp: the blocks added
    return {
        "once": once,
        "twice": twice,
        "grad": torch.allclose(g, (3 * s**2).repeat(2)),
        "hvp": torch.allclose(h, (6 * s * 2).repeat(2)),
    }


def test_psum_backward_makes_no_pvary_unless_differentiated(run, backend) -> None:
    for r in run(_psum_transpose_body, {"tp": 2}):
        assert r["grad"] and r["hvp"], r
        assert r["once"] == 0, r  # a plain backward: the identity, no Function
        assert r["twice"] >= 1, r  # a backward that is differentiated again keeps the pvary (its psum is needed)


def _constant_pvary_body(mesh: fs.Mesh) -> dict[str, Any]:
    """An invariant constant (positions) meeting a value varying over dp is widened without a ``Pvary`` Function
    (nothing can flow back into it); an invariant weight that a gradient reaches still gets its ``Pvary``, whose
    backward sums the gradient over dp."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(3, dtype=x.dtype)  # invariant constant, meets x (varying over dp): no Function
        y = (x + pos) * w  # w invariant and differentiated: one Pvary (its backward: psum over dp)
        return fs.psum((y**2).sum(), "dp")

    f = fs.shard_map(lambda w, x: fs.value_and_grad(loss)(w, x), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    with _counting_pvary() as made:
        value, grad = f(w, x)

    def ref(w: torch.Tensor) -> torch.Tensor:
        return (((x + torch.arange(3.0)) * w) ** 2).sum()

    ref_value, ref_grad = torch.func.grad_and_value(ref)(w)[::-1]
    return {
        "made": made["n"],
        "close": torch.allclose(fs.device_get(value), ref_value) and torch.allclose(fs.device_get(grad), ref_grad),
    }


def test_constants_are_widened_without_a_function(run, backend) -> None:
    n_dev = 2 if backend == "sim" else 1  # sim counts both devices in this process
    for r in run(_constant_pvary_body, {"dp": 2}):
        assert r["close"], r
        assert r["made"] == n_dev, r  # w's Pvary only: none for the constant positions


def _pending_value_body(mesh: fs.Mesh) -> dict[str, Any]:
    """A loss that is the pending result of an asynchronous all-reduce (as the dist backend's functional
    collectives give): value_and_grad seeds the backward without waiting for it, and hands back its value."""
    import torch.distributed._functional_collectives as funcol

    from funcshard._src.runtime.context import current

    seen: dict[str, Any] = {}

    class SumAsync(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
            return funcol.all_reduce(t, "sum", group)  # [] -> [] (pending)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            seen["waited_before_backward"] = seen["y"].completed
            return g, None

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = SumAsync.apply(((x @ w) ** 2).sum(), current("loss").device.process_group(("dp",)))  # [b/dp, d] @ [d]
        seen["y"] = y
        return y

    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)
    f = fs.shard_map(
        lambda w, x: fs.value_and_grad(loss)(w, x),
        mesh=mesh,
        in_specs=(P(), P("dp")),
        out_specs=(P(), P("dp")),  # the gradient: each device's share (the hand-written backward sums nothing)
        check_vma=False,
    )
    value, grad = f(w, x)
    ref_value = ((x @ w) ** 2).sum()
    ref_shares = [torch.func.grad(lambda w, xb=xb: ((xb @ w) ** 2).sum())(w) for xb in x.chunk(2)]
    return {
        "waited": seen["waited_before_backward"],
        "value": torch.allclose(fs.device_get(value), ref_value),
        "type": type(value.local).__name__,
        "grad": torch.allclose(grad.local, ref_shares[mesh.coords_of(torch.distributed.get_rank())["dp"]]),
    }


def test_a_pending_loss_is_not_waited_for_before_the_backward(run, backend) -> None:
    if backend == "sim":
        pytest.skip("simulated devices have no asynchronous collectives")
    for r in run(_pending_value_body, {"dp": 2}):
        assert r["value"] and r["grad"], r
        assert r["waited"] is False, r  # the seed did not read the pending sum
        assert r["type"] == "Tensor", r  # handed back settled
