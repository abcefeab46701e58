"""``pytree.broadcast_prefix``: the one-flatten fast path (a prefix with the value's very structure) gives what
the walk of both trees gives, on nested dict / list / tuple / namedtuple / None prefixes; error messages are the
walk's."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.tree import pytree
from funcshard._src.tree.spec import is_spec

Pair = namedtuple("Pair", ["a", "b"])

T = torch.zeros(2)

# (prefix, full): each a valid prefix of its value tree
CASES: list[tuple[Any, Any]] = [
    (P(), T),
    (P("x"), {"a": T, "b": [T, T]}),
    ({"a": P("x"), "b": [P(), P("y")]}, {"a": T, "b": [T, T]}),
    ({"b": [P(), P("y")], "a": P("x")}, {"a": T, "b": [T, T]}),  # other insertion order
    ({"a": P("x"), "b": P()}, {"a": T, "b": [T, T]}),  # a spec for a subtree
    ([P("x"), (P(), P("y"))], [T, (T, T)]),
    ((P("x"), [P(), P("y")]), (T, [T, T])),
    ([P("x"), P()], (T, T)),  # a list prefix of a tuple value: the walk accepts it
    ((P("x"), P()), [T, T]),
    (Pair(P("x"), P()), Pair(T, T)),
    (Pair(P("x"), P()), Pair(T, {"c": T, "d": [T]})),
    ({"a": None, "b": P()}, {"a": None, "b": T}),
    ((None, P("x")), (None, T)),
    ({"a": P(), "b": P("x")}, {"a": T, "b": None}),  # a spec for an empty subtree: no leaf
    ({"l": [{"w": P("x"), "b": P()}, {"w": P("y"), "b": P()}]}, {"l": [{"w": T, "b": T}, {"w": T, "b": T}]}),
    ([], []),
    ({}, {}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_equal_to_the_walk(case: int) -> None:
    prefix, full = CASES[case]
    want = pytree._broadcast_walk(prefix, full, is_spec, "spec tree", "")
    got = pytree.broadcast_prefix(prefix, full, prefix_is_leaf=is_spec)
    assert got == want
    assert len(got) == len(pytree.flatten(full)[0])
    assert all(g is w for g, w in zip(got, want, strict=True))  # the prefix's very spec objects
    _, treedef = pytree.flatten(full)
    assert pytree.broadcast_prefix(prefix, full, prefix_is_leaf=is_spec, full_treedef=treedef) == want


def test_fast_path_is_taken_for_a_full_spec_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_walk(*args: Any) -> list[Any]:
        raise AssertionError("walked")

    monkeypatch.setattr(pytree, "_broadcast_walk", no_walk)
    full = {"a": T, "b": [T, (T, T)]}
    specs = {"a": P("x"), "b": [P(), (P("y"), P())]}
    assert pytree.broadcast_prefix(specs, full, prefix_is_leaf=is_spec) == [P("x"), P(), P("y"), P()]
    with pytest.raises(AssertionError, match="walked"):  # a subtree spec needs the walk
        pytree.broadcast_prefix({"a": P("x"), "b": P()}, full, prefix_is_leaf=is_spec)


# (prefix, full, the location named, the message's description of the prefix and of the value)
BAD: list[tuple[Any, Any, str, str, str]] = [
    ({"a": P()}, {"a": T, "b": T}, "<root>", "a dict with keys ['a']", "a dict with keys ['a', 'b']"),
    ([P(), P()], [T, T, T], "<root>", "a list of length 2", "a list of length 3"),
    ({"a": [P(), P()]}, {"a": [T]}, "a", "a list of length 2", "a list of length 1"),
    ({"a": "x"}, {"a": T}, "a", "the string 'x' (write P('x') for a spec)", "a leaf of type Tensor"),
    ([P(), None], [T, T], "1", "None", "a leaf of type Tensor"),
    ({"a": 3}, {"a": T}, "a", "a leaf of type int", "a leaf of type Tensor"),
    (Pair(P(), P()), (T, T), "<root>", "a Pair of length 2", "a tuple of length 2"),
    ([P(), [P()]], [T, T], "1", "a list of length 1", "a leaf of type Tensor"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_errors_are_the_walks(case: int) -> None:
    prefix, full, loc, has, value = BAD[case]
    with pytest.raises(fs.ShardingError) as walked:
        pytree._broadcast_walk(prefix, full, is_spec, "spec tree", "device_put: ")
    with pytest.raises(fs.ShardingError) as got:
        pytree.broadcast_prefix(prefix, full, prefix_is_leaf=is_spec, where="device_put: ")
    assert str(got.value) == str(walked.value)
    msg = str(got.value)
    assert msg.startswith(f"device_put: spec tree is not a prefix of the value tree at '{loc}': ")
    assert f"the spec tree has {has} where the value has {value}." in msg


def test_fsdp_gather_uses_it_and_keeps_its_error() -> None:
    mesh = fs.make_mesh({"fsdp": 2}, backend="sim")
    params = {"w": torch.arange(8.0).reshape(4, 2), "b": torch.ones(2)}
    specs = {"w": P("fsdp", None), "b": P()}
    arr = fs.device_put(params, mesh, specs)

    def body(p: Any) -> Any:
        return fs.ops.fsdp_gather(p, specs, axis="fsdp")

    out = fs.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False)(arr)
    assert torch.equal(fs.device_get(out["w"]), params["w"])

    def bad(p: Any) -> Any:
        return fs.ops.fsdp_gather(p, {"w": P("fsdp", None)}, axis="fsdp")

    with pytest.raises(fs.ShardingError, match=r"^fsdp_gather: spec tree is not a prefix of the value tree at"):
        fs.shard_map(bad, mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False)(arr)
