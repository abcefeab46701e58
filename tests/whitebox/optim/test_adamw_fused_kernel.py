"""``fs.optim.adamw``'s update of float32 CPU leaves by torch's fused AdamW kernel (one call for every leaf).

- Its numbers are ``torch.optim.AdamW(fused=True)``'s, bit for bit, sharded (sim and dist), donated or not.
- They do not depend on the layout: a stacked leaf's strided gradient (a view of the layers' bucket buffer, cut
  into rows), a contiguous one, shards, odd sizes (tails padded to a whole SIMD vector) all give the numbers of the
  unsharded leaf in one piece; and they are within float32 rounding of the single-tensor path's.
- The kernel is called once per step, for all the leaves; a step recorded for compilation, low-precision leaves
  and leaves that are differentiated take the op-by-op path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P, optim
from funcshard.optim import _adamw

pytestmark = [pytest.mark.oracle, pytest.mark.counters]

# every local and full leaf a whole number of 16-element vectors: torch's fused kernel has no scalar tail
SPECS = {"w": P(None, "tp"), "layers": P(None, "tp", None), "b": P("tp"), "n": P()}
SHAPES = {"w": (3, 64), "layers": (4, 32, 16), "b": (96,), "n": (32,)}
HYPER = {"lr": 1e-2, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _rand(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def _torch(params: dict[str, torch.Tensor], grads_seq: list[dict[str, torch.Tensor]], **kw: Any) -> tuple[Any, ...]:
    """torch.optim.AdamW on the unsharded leaves: (params, exp_avg, exp_avg_sq) after the steps."""
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    h = HYPER
    opt = torch.optim.AdamW(
        list(ref.values()), lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["weight_decay"], **kw
    )
    for grads in grads_seq:
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
    return (
        {k: p.detach() for k, p in ref.items()},
        {k: opt.state[p]["exp_avg"] for k, p in ref.items()},
        {k: opt.state[p]["exp_avg_sq"] for k, p in ref.items()},
    )


def _sharded_body(mesh: fs.Mesh, donate: tuple[int, ...]) -> tuple[bool, bool, bool]:
    params = _rand(SHAPES, 0)
    grads_seq = [_rand(SHAPES, k + 1) for k in range(3)]
    opt = optim.adamw(HYPER["lr"], b1=HYPER["b1"], b2=HYPER["b2"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    sspecs = opt.state_specs(SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(SPECS, SPECS, sspecs),
        out_specs=(SPECS, sspecs),
        donate=donate,
    )
    calls = []
    fused = _adamw._FUSED
    _adamw._FUSED = lambda *a, **kw: (calls.append(len(a[0])), fused(*a, **kw))
    try:
        p = fs.device_put(params, mesh, SPECS)
        state = fs.shard_map(opt.init, mesh=mesh, in_specs=(SPECS,), out_specs=sspecs)(p)
        for g in grads_seq:
            p, state = step(p, g, state)
    finally:
        _adamw._FUSED = fused
    got = (fs.device_get(p), fs.device_get(state.mu), fs.device_get(state.nu))
    want = _torch(params, grads_seq, fused=True)
    exact = all(torch.equal(got[i][k], want[i][k]) for i in range(3) for k in SHAPES)
    single = _torch(params, grads_seq, foreach=False)  # the single-tensor path: within float32 rounding
    close = all(torch.allclose(got[i][k], single[i][k], rtol=1e-6, atol=1e-7) for i in range(3) for k in SHAPES)
    per_process = mesh.size if mesh.backend == "sim" else 1  # devices whose steps this process runs
    return exact, close, len(calls) == 3 * per_process


@pytest.mark.parametrize("donate", [(0, 2), ()], ids=["donated", "not_donated"])
def test_fused_update_is_torch_fused_adamw_bit_for_bit(run, donate: tuple[int, ...]) -> None:
    for exact, close, once in run(_sharded_body, {"tp": 2}, donate):
        assert exact  # params and both moments: torch.optim.AdamW(fused=True)'s, bit for bit
        assert close
        assert once  # one kernel call per device and step, for all the leaves


def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, donated: bool) -> list[torch.Tensor]:
    opt = optim.adamw(HYPER["lr"], b1=HYPER["b1"], b2=HYPER["b2"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    state = _adamw.AdamWState(torch.tensor(2), m, v)
    if not donated:
        new, s = opt.update(g, state, p)
        return [new, s.mu, s.nu]
    mesh = fs.make_mesh({"dp": 1}, backend="sim")
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(P(), P(), opt.state_specs(P())),
        out_specs=(P(), opt.state_specs(P())),
        donate=(0, 2),
    )
    new, s = step(p, g, state)
    return [fs.device_get(t) for t in (new, s.mu, s.nu)]


def test_fused_numbers_do_not_depend_on_the_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, n = 5, 1043  # odd rows: each a body of whole vectors and a padded tail
    p, m = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen) * 1e-2
    v = torch.rand(rows, n, generator=gen) * 1e-4
    buf = torch.randn(rows, n + 7, generator=gen)
    strided = buf[:, :n]  # a stacked leaf's gradient in the layers' bucket buffer: rows at a stride
    assert not strided.is_contiguous()
    whole = _update(p.clone(), strided.contiguous(), m.clone(), v.clone(), donated=False)
    for donated in (False, True):
        cut = _update(p.clone(), strided, m.clone(), v.clone(), donated)
        assert all(torch.equal(a, b) for a, b in zip(cut, whole, strict=True))
    halves = [_update(p[:, s].clone(), strided[:, s], m[:, s].clone(), v[:, s].clone(), False) for s in
              (slice(0, n // 2), slice(n // 2, n))]  # fmt: skip
    for i in range(3):  # two shards of the leaf: the leaf's numbers
        assert torch.equal(torch.cat((halves[0][i], halves[1][i]), dim=1), whole[i])
    # within float32 rounding of the op-by-op path
    saved, _adamw._FUSED = _adamw._FUSED, None
    try:
        ops = _update(p.clone(), strided.contiguous(), m.clone(), v.clone(), donated=False)
    finally:
        _adamw._FUSED = saved
    for a, b in zip(whole, ops, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_kernel_only_where_it_applies() -> None:
    calls = []
    saved = _adamw._FUSED
    _adamw._FUSED = lambda *a, **kw: (calls.append(len(a[0])), saved(*a, **kw))
    try:
        opt = optim.adamw(1e-2)
        p = {"a": torch.randn(4, 8), "b": torch.randn(16, dtype=torch.bfloat16)}
        g = {"a": torch.randn(4, 8), "b": torch.randn(16, dtype=torch.bfloat16)}
        new, _ = opt.update(g, opt.init(p), p)
        assert calls == [1]  # float32 "a" only: one call; bfloat16 "b" by the ops
        assert not torch.equal(new["a"], p["a"])  # not donated: the params are new, the inputs untouched
        calls.clear()
        w = torch.randn(4, 8, requires_grad=True)  # a differentiated step: the ops (the kernel has no derivative)
        new, _ = opt.update({"a": torch.randn(4, 8)}, opt.init({"a": w.detach()}), {"a": w * 1.0})
        assert calls == [] and new["a"].requires_grad
    finally:
        _adamw._FUSED = saved
