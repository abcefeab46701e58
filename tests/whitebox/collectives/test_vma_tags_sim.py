"""The varying-axes tags themselves (internal, read with ``get_vma``): they follow the ops of a body under the
simulated backend, and none is left on a value after its call."""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives.vma import get_vma


def test_vma_tags_follow_ops() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    seen = {}

    def f(w, x):
        seen["w"], seen["x"] = get_vma(w), get_vma(x)
        y = x @ w  # varies over dp (x) and tp (w)
        seen["y"] = get_vma(y)
        z = fs.psum(y, "tp")
        seen["z"] = get_vma(z)
        seen["c"] = get_vma(torch.zeros(2) + 1)
        return fs.pmean(z.sum(), "dp")

    fs.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P())(torch.ones(3, 4), torch.ones(4, 3))
    assert seen == {
        "w": {"tp"},
        "x": {"dp"},
        "y": {"dp", "tp"},
        "z": {"dp"},
        "c": frozenset(),
    }


def test_tags_do_not_leak_between_calls() -> None:
    """A tensor tagged as varying in one call is invariant when captured by a later call's closure."""
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    x = fs.device_put(torch.ones(4, 3), mesh, P("dp"))
    fs.shard_map(lambda v: v * 2, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x)
    captured = x.shards[(0,)]
    assert get_vma(captured) == frozenset()

    def f(w):
        return captured.sum() * w  # captured is a constant here: invariant, so the output is too

    out = fs.shard_map(f, mesh=mesh, in_specs=(P(),), out_specs=P())(torch.ones(()))
    assert fs.device_get(out).item() == 6.0
