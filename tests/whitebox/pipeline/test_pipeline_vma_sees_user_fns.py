"""``funcshard.pipeline.run`` under the vma mode (counted, not timed): the runtime's own tensor work does not go
through the mode's Python dispatch, only the user's stage and loss functions do (once per chunk and step).

White-box: it counts the calls of the vma mode's ``__torch_function__`` and ``pvary_to``."""

from __future__ import annotations

import pytest
from _pipeline_toy import MB, D, _data, _layer, _mse, _schedule

import funcshard as fs
from funcshard import P
from funcshard.pipeline import run
from funcshard.pipeline.runtime import stage_order

pytestmark = pytest.mark.counters


def _vma_ops_per_step(monkeypatch: pytest.MonkeyPatch, sched) -> tuple[int, int, int]:
    """One step under sim with check_vma: (ops the vma mode saw outside the user's functions, ops it saw inside
    them, pvary it inserted), summed over the devices."""
    import threading

    from funcshard._src.collectives import vma as _vma

    inside = threading.local()
    seen = {"out": 0, "in": 0, "pvary": 0}
    mode_fn, pvary_to = _vma.VmaMode.__torch_function__, _vma.pvary_to

    def counted(self, func, types, args=(), kwargs=None):
        seen["in" if getattr(inside, "on", False) else "out"] += 1
        return mode_fn(self, func, types, args, kwargs)

    def counted_pvary(x, want, dev):
        y = pvary_to(x, want, dev)
        seen["pvary"] += y is not x
        return y

    def user(fn):
        def wrapped(*args):
            inside.on = True
            try:
                return fn(*args)
            finally:
                inside.on = False

        return wrapped

    monkeypatch.setattr(_vma.VmaMode, "__torch_function__", counted)
    monkeypatch.setattr(_vma, "pvary_to", counted_pvary)
    p, v, m = sched.n_stages, sched.n_virtual, sched.n_microbatches
    w1, w2, x, t = _data(p * v, m * MB)
    mesh = fs.make_mesh({"pp": p}, backend="sim")
    f = fs.shard_map(
        lambda params, xs, ts: run(sched, user(_layer), params, xs, targets=ts, loss_fn=user(_mse)),
        mesh=mesh,
        in_specs=(P("pp"), P(), P()),
        out_specs=(P(), P("pp")),
    )
    args = ((w1[stage_order(sched)], w2[stage_order(sched)]), x.reshape(m, MB, D), t.reshape(m, MB, D))
    f(*args)
    seen.update(out=0, pvary=0)
    seen["in"] = 0
    f(*args)
    return seen["out"], seen["in"], seen["pvary"]


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_vma_mode_sees_only_the_user_functions(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The runtime's own tensor work (slicing microbatches, detaching, receive buffers, autograd.grad, gradient
    accumulation) does not go through the vma mode's Python dispatch: what the mode sees outside ``stage_fn`` /
    ``loss_fn`` is a fixed number of ops per step (shard_map's and the loss reduction's), not a number per action
    (about 20 per action before), and no pvary is inserted (the targets are tagged as the output they meet).
    The user's functions are tracked once per chunk and step (later microbatches replayed untracked)."""
    small = _vma_ops_per_step(monkeypatch, _schedule(name, 2, 4))
    large = _vma_ops_per_step(monkeypatch, _schedule(name, 2, 8))
    # the user's ops: tracked on the first microbatch of each chunk (stage_fn) and of loss_fn, the others replayed
    # untracked, so twice the microbatches show the mode no more ops
    assert large[1] == small[1] > 0
    assert large[0] == small[0] < 80  # the runtime's: the same for twice the actions (was ~20 per action)
    assert small[2] == large[2] == 0
