"""What a ``shard_map`` call flattens (counted, not timed): the common trees of a call (a tuple of arguments, a
``(loss, grads)`` output) are flattened without optree, into the very leaves and structure optree gives, with a
key equal only between equal structures; a call with another structure is planned again, and the results equal
the unsharded function's, sim and dist."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple
from unittest import mock

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.shard_map.io import flatten

pytestmark = pytest.mark.counters


class _Pair(NamedTuple):
    a: Any
    b: Any


def _trees() -> list[Any]:
    x, y = torch.ones(2), torch.zeros(3)
    p = torch.nn.Parameter(torch.ones(1))
    mesh = fs.make_mesh({"dp": 1}, backend="sim")
    arr = fs.device_put(torch.ones(2), mesh, P())
    return [
        x,
        p,
        arr,
        3,
        2.5,
        True,
        (),
        ((),),
        (x,),
        (x, y),
        (x, arr, 1.0),
        (x, (y, x)),
        (x, (y, x), (), (p,)),
        ((x, y), (x,)),
        (x, None),
        (x, (y, None)),
        (None,),
        None,
        [x, y],
        (x, [y]),
        {"a": x, "b": y},
        (x, {"a": y}),
        _Pair(x, y),
        (x, _Pair(x, y)),
        (x, ((y,),)),
        "s",
        (x, "s"),
        (x, 1 + 2j),
    ]


def test_flatten_is_optrees_flatten() -> None:
    for tree in _trees():
        leaves, treedef, _ = flatten(tree)
        want_leaves, want_def = optree.tree_flatten(tree)
        assert treedef == want_def, tree
        assert len(leaves) == len(want_leaves) and all(a is b for a, b in zip(leaves, want_leaves, strict=True))


def test_flatten_keys_equal_only_where_structures_do() -> None:
    # (the converse need not hold: a tree of the same structure with a leaf of another type, a string, takes
    # optree's path and its structure as key: it is planned once more, never confused with another)
    trees = [*_trees(), *_trees()]  # twice: fresh objects of the same structures
    got = [flatten(t) for t in trees]
    for (_, d1, k1), t1 in zip(got, trees, strict=True):
        for (_, d2, k2), t2 in zip(got, trees, strict=True):
            if k1 == k2:
                assert d1 == d2 and hash(k1) == hash(k2), (t1, t2)
            if type(k1) is not type(d1) and type(k2) is not type(d2):  # both flattened without optree
                assert (k1 == k2) == (d1 == d2), (t1, t2)


def _structure_body(mesh: fs.Mesh) -> dict[str, Any]:
    calls: collections.Counter[str] = collections.Counter()
    real = optree.tree_flatten

    def counted(*a: Any, **kw: Any) -> Any:
        calls["tree_flatten"] += 1
        return real(*a, **kw)

    def f(*args: Any) -> Any:
        flat = [t for t in optree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        total = fs.psum(sum(t.sum() for t in flat), "dp")
        return total, tuple(t * 2 for t in flat)

    gen = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(4, 3, generator=gen) for _ in range(3))
    counts, results = [], []
    for args, specs in (
        ((x, y, z), (P("dp"), P("dp"), P("dp"))),
        ((x, (y, z)), (P("dp"), (P("dp"), P("dp")))),
        (((x, y), z), ((P("dp"), P("dp")), P("dp"))),
        ((x, {"y": y, "z": z}), (P("dp"), {"y": P("dp"), "z": P("dp")})),
    ):
        g = fs.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(P(), (P("dp"),) * 3))
        with mock.patch.object(optree, "tree_flatten", counted):
            calls.clear()
            total, doubled = g(*args)
            counts.append(calls["tree_flatten"])
        results.append(
            torch.allclose(fs.device_get(total), x.sum() + y.sum() + z.sum())
            and all(torch.allclose(fs.device_get(d), 2 * t) for d, t in zip(doubled, (x, y, z), strict=True))
        )
    return {"counts": counts, "results": results}


def test_common_trees_skip_optree_and_others_still_work(run, backend) -> None:
    for r in run(_structure_body, {"dp": 2}):
        assert all(r["results"]), r
        # tuples of tensors (and of tuples of tensors) in and out: no optree flatten in the call (f's own
        # tree_leaves aside, which is not tree_flatten); a dict argument: optree flattens the arguments
        assert r["counts"][:3] == [0, 0, 0], r
        assert r["counts"][3] >= 1, r
