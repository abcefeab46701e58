"""Per-op overhead of the machinery (issue #11 item 4), as exact counters, not timings.

- The collectives' autograd Functions under torch.func: no ``inspect.signature`` per call (``Function.apply``
  binds the arguments to ``forward``'s signature every call; ours are positional), and a bounded number of
  torch pytree flattens / unflattens per collective (torch's ``custom_function_call`` does those per level).
- The vma mode's per-op handler reads a tagged operand's tag inline: the slow lookup (views, torch.func
  wrappers, untagged constants) is not called for tagged operands.
- The sim backend reduces an all-reduce once per group (by the last member to arrive), not once per member,
  and a group of one exchanges nothing; a bucketed ``pvary`` over a group of one has no concatenation in its
  backward, and is still counted as the all-reduce it stands for.

Each step is checked against the unsharded reference, forward and backward, under sim and dist.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


class _Counts:
    """Counts the calls of ``inspect.signature`` and torch's pytree flatten / unflatten within the block."""

    def __init__(self) -> None:
        self.n: collections.Counter[str] = collections.Counter()
        self._patches: list[Any] = []

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            self.n[name] += 1
            return fn(*a, **kw)

        return counted

    def __enter__(self) -> _Counts:
        for owner, attr in ((inspect, "signature"), (torch_pytree, "tree_flatten"), (torch_pytree, "tree_unflatten")):
            p = mock.patch.object(owner, attr, self._wrap(attr, getattr(owner, attr)))
            p.start()
            self._patches.append(p)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self._patches):
            p.stop()


def _data() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen)
    params = {"w1": torch.randn(16, 8, generator=gen) / 3, "w2": torch.randn(8, 16, generator=gen) / 4}
    return x, params


def _ref_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (F.linear(torch.tanh(F.linear(x, p["w1"])), p["w2"]) ** 2).mean()


SPECS = {"w1": P("tp", None), "w2": P(None, "tp")}


def _mlp_body(mesh: fs.Mesh, grad_kind: str, check_vma: bool) -> dict[str, Any]:
    """A dp x tp MLP step (loss and gradients in one shard_map) by ``fs.value_and_grad`` or torch.func, its
    counters on the second call, and how it compares with the unsharded step."""
    x, params = _data()

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        p = fs.pvary(p, "dp")  # both gradients summed over dp in one bucketed all-reduce
        xin = x if check_vma else fs.pvary(x, "tp")
        h = torch.tanh(F.linear(xin, p["w1"]))  # [b/dp, d] @ [d, h/tp] -> [b/dp, h/tp]
        out = fs.psum(F.linear(h, p["w2"]), "tp")  # [b/dp, h/tp] @ [h/tp, d] -> [b/dp, d]
        return fs.pmean((out**2).mean(), "dp")

    def step(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if grad_kind == "vag":
            return fs.value_and_grad(loss)(p, x)
        grads, value = torch.func.grad_and_value(loss)(p, x)
        return value, grads

    f = fs.shard_map(step, mesh=mesh, in_specs=(SPECS, P("dp")), out_specs=(P(), SPECS), check_vma=check_vma)
    f(params, x)  # first call: specs checked and cached
    with _Counts() as counts, fs.comm_stats() as stats:
        value, grads = f(params, x)
    ref_grads, ref_value = torch.func.grad_and_value(_ref_loss)(params, x)
    close = torch.allclose(fs.device_get(value), ref_value, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(fs.device_get(grads[k]), ref_grads[k], rtol=1e-5, atol=1e-6) for k in params
    )
    return {
        "close": close,
        "signature": counts.n["signature"],
        "psum_calls": stats.calls("psum"),
        "psum_dp_bytes": stats.bytes("psum", "dp"),
    }


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("grad_kind", ["vag", "func"])
def test_step_equals_unsharded_without_signature_binding(run, backend, grad_kind, check_vma) -> None:
    shape = {"dp": 2, "tp": 2} if backend == "sim" else {"dp": 1, "tp": 2}
    for r in run(_mlp_body, shape, grad_kind, check_vma):
        assert r["close"], r
        assert r["signature"] == 0, r  # no inspect.signature per collective call, torch.func or not
        # the forward psum over tp and the dp bucket's one all-reduce of both gradients (x takes no gradient)
        assert r["psum_calls"] == 2, r
        # a bucket over a group of one (dist: dp=1) is still counted as the all-reduce of both gradients
        per_dev = (16 * 8 // 2 + 8 * 16 // 2) * 4
        assert r["psum_dp_bytes"] == per_dev, r


def _chain_counts(mesh: fs.Mesh, n: int) -> collections.Counter[str]:
    """torch pytree flattens / unflattens and signature bindings of one call whose torch.func.grad body makes
    ``n`` psums (and their ``n`` backward collectives)."""

    def loss(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            x = fs.psum(x, "tp") * 0.5  # [4] -> [4]
        return x.sum()

    def ref(xf: torch.Tensor) -> torch.Tensor:  # the global function: a psum adds the blocks (or the copies)
        y = (xf[:2] + xf[2:]) * 0.5
        for _ in range(n - 1):
            y = (2 * y) * 0.5
        return y.sum()

    f = fs.shard_map(lambda x: torch.func.grad(loss)(x), mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    x = torch.arange(4.0)
    f(x)
    with _Counts() as counts:
        g = f(x)
    assert torch.allclose(fs.device_get(g), torch.func.grad(ref)(x)), (fs.device_get(g), torch.func.grad(ref)(x))
    return counts.n


def test_pytree_round_trips_per_collective_are_bounded() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    a, b = _chain_counts(mesh, 2), _chain_counts(mesh, 6)
    per_call = {k: (b[k] - a[k]) / (4 * 2 * mesh.size) for k in ("tree_flatten", "tree_unflatten")}
    assert b["signature"] == 0, b
    # torch 2.13's custom_function_call at one grad level: 8 flattens, 2 unflattens per collective call (forward
    # or backward); the profile found 9,816 unflattens in one step
    assert per_call["tree_flatten"] <= 8, per_call
    assert per_call["tree_unflatten"] <= 2, per_call


def _vma_lookups_body(mesh: fs.Mesh) -> dict[str, Any]:
    """Counts the vma mode's slow tag lookups over 50 ops on tagged operands."""
    import threading

    from funcshard._src.collectives import vma as _vma

    slow: collections.Counter[str] = collections.Counter()
    real = _vma.get_vma
    counting = threading.local()  # only within the ops below, on the device's own thread

    def counted(t: torch.Tensor) -> frozenset[str]:
        if getattr(counting, "on", False):
            slow["get_vma"] += 1
        return real(t)

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x
        counting.on = True
        for _ in range(10):
            y = torch.tanh(y * 1.01 + x)  # [b/dp, d], tagged dp
            y = y - y.mean()
            y = y + 0.0 * y.sum(dim=0, keepdim=True)
        counting.on = False
        slow["tag:" + ",".join(sorted(real(y)))] += 1
        return y @ w  # [b/dp, d] @ [d, d] -> [b/dp, d]: w (invariant) is pvary'd here

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen)
    f = fs.shard_map(body, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    with mock.patch.object(_vma, "get_vma", counted):
        out = fs.device_get(f(x, w))
    blocks = []
    for xb in x.chunk(2):  # per device: its own block, its own mean
        yb = xb
        for _ in range(10):
            yb = torch.tanh(yb * 1.01 + xb)
            yb = yb - yb.mean()
            yb = yb + 0.0 * yb.sum(dim=0, keepdim=True)
        blocks.append(yb)
    ref = torch.cat(blocks) @ w
    return {
        "slow": slow["get_vma"],
        "tags": sorted(k for k in slow if k.startswith("tag:")),
        "close": torch.allclose(out, ref, atol=1e-5),
    }


def test_vma_mode_reads_tags_inline(run, backend) -> None:
    for r in run(_vma_lookups_body, {"dp": 2}):
        assert r["close"] and r["tags"] == ["tag:dp"], r
        assert r["slow"] == 0, r  # every operand of the 50 ops carries its own tag: no slow lookup


def test_sim_all_reduce_reduces_once_per_group() -> None:
    from funcshard._src.runtime.backends import sim

    calls = collections.Counter()
    real_reduce, real_exchange = sim._reduce, sim.SimWorld.exchange

    def reduce(vals: list[torch.Tensor], op: str) -> torch.Tensor:
        calls["reduce"] += 1
        return real_reduce(vals, op)

    def exchange(self: Any, *a: Any, **kw: Any) -> Any:
        calls["exchange"] += 1
        return real_exchange(self, *a, **kw)

    mesh = fs.make_mesh({"dp": 1, "tp": 4}, backend="sim")
    f = fs.shard_map(
        lambda x: (fs.psum(x, "tp"), fs.pmax(x, "tp"), fs.psum(x, "dp")),
        mesh=mesh,
        in_specs=(P("tp"),),
        out_specs=(P(), P(), P("tp")),
        check_vma=False,
    )
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    with mock.patch.object(sim, "_reduce", reduce), mock.patch.object(sim.SimWorld, "exchange", exchange):
        s, m, same = f(x)
    blocks = x.chunk(4)
    assert torch.equal(fs.device_get(s), blocks[0] + blocks[1] + blocks[2] + blocks[3])  # the same order
    assert torch.equal(fs.device_get(m), torch.stack(blocks).amax(0))
    assert torch.equal(fs.device_get(same), x)  # over dp (one device): the value itself
    assert calls["reduce"] == 2, calls  # psum and pmax over tp: once per group, not once per member
    assert calls["exchange"] == 2 * 4, calls  # each member deposits; the group of one over dp exchanges nothing


def test_pvary_bucket_over_a_group_of_one_has_no_concatenation() -> None:
    mesh = fs.make_mesh({"dp": 1}, backend="sim")
    x, params = _data()
    real_cat = torch.cat
    cats = collections.Counter()

    def cat(*a: Any, **kw: Any) -> torch.Tensor:
        cats["n"] += 1
        return real_cat(*a, **kw)

    def step(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return fs.value_and_grad(lambda p: fs.pmean(_ref_loss(fs.pvary(p, "dp"), x), "dp"))(p)

    f = fs.shard_map(step, mesh=mesh, in_specs=({"w1": P(), "w2": P()}, P()), out_specs=(P(), P()))
    with mock.patch.object(torch, "cat", cat), fs.comm_stats() as stats:
        value, grads = f(params, x)
    ref_grads, ref_value = torch.func.grad_and_value(_ref_loss)(params, x)
    assert torch.allclose(fs.device_get(value), ref_value)
    for k in params:
        assert torch.allclose(fs.device_get(grads[k]), ref_grads[k], rtol=1e-6, atol=1e-7)
    assert cats["n"] == 0, cats
    assert stats.calls("psum", "dp") == 1 and stats.bytes("psum", "dp") == (16 * 8 + 8 * 16) * 4, stats.table()
