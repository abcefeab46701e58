"""``fs.optim.adamw``: the donated and the non-donated update take the same path for the same leaves.

Whether torch's fused kernel takes a leaf is asked of the gradient as the update sees it: a gradient of lower (or
higher) precision than the float32 moments is converted first, so a bfloat16 gradient on float32 moments and
params gets the fused kernel's numbers whether the step donates them or not (before: the kernel when donated, the
op-by-op path when not, ~1 ulp apart in some elements). The non-donated update checks its arguments once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P, optim
from funcshard.optim import _adamw

pytestmark = pytest.mark.counters


def _steps(opt: Any, p: dict, grads: list[dict], donated: bool) -> dict:
    """Updates of ``p`` by ``grads`` inside shard_map (one device), donating params and moments or not (from the
    second step on: the first one's inputs, fresh from device_put and init, are not donated)."""
    mesh = fs.make_mesh({"dp": 1}, backend="sim")
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(P(), P(), opt.state_specs(P())),
        out_specs=(P(), opt.state_specs(P())),
        donate=(0, 2) if donated else (),
    )
    p = fs.device_put({k: v.clone() for k, v in p.items()}, mesh, P())  # Arrays: donated from the first step on
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(P(),), out_specs=opt.state_specs(P()))(p)
    for g in grads:
        p, state = step(p, g, state)
    return {k: fs.device_get(v) for k, v in {**p, **{f"mu.{k}": v for k, v in state.mu.items()}}.items()}


def test_low_precision_gradients_take_the_fused_path_donated_or_not(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(37, 5, generator=gen), "b": torch.randn(64, generator=gen)}
    dtypes = (torch.float32, torch.bfloat16, torch.bfloat16)  # (a first step that is not donated: see _steps)
    grads = [{k: torch.randn(v.shape, generator=gen).to(dt) for k, v in p.items()} for dt in dtypes]
    grads[2]["b"] = grads[2]["b"].double()  # a float64 gradient is converted too
    opt = optim.adamw(1e-2, b2=0.95, weight_decay=0.1)
    calls: list[int] = []
    saved = _adamw._FUSED
    _adamw._FUSED = lambda *a, **kw: (calls.append(len(a[0])), saved(*a, **kw))
    try:
        plain = _steps(opt, p, grads, donated=False)
        n_plain = len(calls)
        in_place = []
        real = _adamw._AdamW._apply_in_place
        monkeypatch.setattr(_adamw._AdamW, "_apply_in_place", lambda self, *a: (in_place.append(1), real(self, *a))[1])
        donated = _steps(opt, p, grads, donated=True)
    finally:
        _adamw._FUSED = saved
    assert n_plain == 3 and len(calls) == 6, calls  # the kernel in every step, donated or not
    assert len(in_place) == 2  # the low-precision steps of the second run donated
    for k in plain:
        assert torch.equal(plain[k], donated[k]), k


def test_non_donated_update_checks_its_arguments_once(monkeypatch) -> None:
    opt = optim.adamw(1e-2)
    seen: list[str] = []
    plain = _adamw._AdamW._checked

    def counted(self, *a: Any) -> Any:
        seen.append(a[-1])
        return plain(self, *a)

    monkeypatch.setattr(_adamw._AdamW, "_checked", counted)
    for dtype in (torch.float32, torch.float64):  # the fused path and the op-by-op path
        p = {"w": torch.randn(4, 8, dtype=dtype)}
        seen.clear()
        new, state = opt.update({"w": torch.randn(4, 8, dtype=dtype)}, opt.init(p), p)
        assert len(seen) == 1, (dtype, seen)
        assert int(state.count) == 1 and not torch.equal(new["w"], p["w"])
