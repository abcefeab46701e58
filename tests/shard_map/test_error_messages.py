"""Bad inputs raise ``fs.MeshError`` / ``fs.ShardingError`` whose message says where (leaf path, axis) and what.

One plain test per case. ``_has(...)`` builds a ``pytest.raises(match=...)`` regex that requires every given
fragment to appear in the message, in any order, so each test states exactly what the message must name.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard import P

FAST = 5.0  # seconds within which a broken collective pattern must be reported (FUNCSHARD_TIMEOUT is far longer)


def _has(*fragments: str) -> str:
    """A regex that matches when every fragment occurs in the message (literally, in any order)."""
    return "(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments)


def _mesh() -> fs.Mesh:
    return fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")


def test_errors_are_value_errors() -> None:
    assert issubclass(fs.MeshError, ValueError)
    assert issubclass(fs.ShardingError, ValueError)


# -- specs -------------------------------------------------------------------------------------------------


def test_spec_unknown_axis() -> None:
    mesh = _mesh()
    with pytest.raises(
        fs.ShardingError, match=_has("device_put", "at 'w'", "'xx'", "(4, 4)", "P('xx')", "'dp': 2", "'tp': 2")
    ):
        fs.device_put({"w": torch.zeros(4, 4)}, mesh, {"w": P("xx")})


def test_spec_axis_used_twice() -> None:
    mesh = _mesh()
    with pytest.raises(fs.ShardingError, match=_has("at 'w'", "'dp'", "twice", "(4, 4)", "P('dp', 'dp')")):
        fs.device_put({"w": torch.zeros(4, 4)}, mesh, {"w": P("dp", "dp")})


def test_spec_axis_used_twice_within_one_entry() -> None:
    mesh = _mesh()
    with pytest.raises(fs.ShardingError, match=_has("at 'w'", "'tp'", "twice")):
        fs.device_put({"w": torch.zeros(8)}, mesh, {"w": P(("tp", "tp"))})


def test_spec_dim_not_divisible_splits_unevenly() -> None:
    """A dim its axes do not divide is no error: it is split as torch.tensor_split splits it (API §14)."""
    mesh = _mesh()
    out = fs.device_put({"layers": [torch.zeros(4, 4), torch.arange(12.0).reshape(3, 4)]}, mesh, P("dp"))
    assert [tuple(out["layers"][1].shards[(i, 0)].shape) for i in range(2)] == [(2, 4), (1, 4)]
    w = fs.device_put({"w": torch.zeros(2, 6)}, mesh, {"w": P(None, ("dp", "tp"))})["w"]
    assert [w.shards[c].shape[1] for c in sorted(w.shards)] == [2, 2, 1, 1]


def test_spec_more_entries_than_dims() -> None:
    mesh = _mesh()
    with pytest.raises(fs.ShardingError, match=_has("at 'b'", "3 entries", "1 dims", "(4,)", "P('dp', None, None)")):
        fs.device_put({"b": torch.zeros(4)}, mesh, {"b": P("dp", None, None)})


def test_spec_tree_dict_keys_differ() -> None:
    mesh = _mesh()
    t = torch.zeros(4)
    with pytest.raises(fs.ShardingError, match=_has("not a prefix", "at 'layer'", "['a', 'c']", "['a', 'b']")):
        fs.device_put({"layer": {"a": t, "b": t}}, mesh, {"layer": {"a": P(), "c": P()}})


def test_spec_tree_list_length_differs() -> None:
    mesh = _mesh()
    t = torch.zeros(4)
    with pytest.raises(fs.ShardingError, match=_has("not a prefix", "at 'layers'", "length 2", "length 3")):
        fs.device_put({"layers": [t, t, t]}, mesh, {"layers": [P(), P()]})


def test_spec_entry_not_a_string() -> None:
    with pytest.raises(fs.ShardingError, match=_has("P:", "entry 3", "P(None, 'tp')")):
        P(3)  # type: ignore[arg-type]


def test_spec_not_a_p() -> None:
    mesh = _mesh()
    with pytest.raises(fs.ShardingError, match=_has("device_put", "at 'w'", "str", "P(")):
        fs.device_put({"w": torch.zeros(4)}, mesh, {"w": "dp"})


# -- meshes ------------------------------------------------------------------------------------------------


def test_mesh_size_zero() -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "axis 'tp'", "size 0", "positive int")):
        fs.make_mesh({"dp": 2, "tp": 0}, backend="sim")


def test_mesh_negative_size() -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "axis 'dp'", "size -2", "positive int")):
        fs.make_mesh({"dp": -2}, backend="sim")


@pytest.mark.parametrize("size", [2.0, "2", True, None])
def test_mesh_non_int_size(size: object) -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "axis 'dp'", f"size {size!r}", "positive int")):
        fs.make_mesh({"dp": size}, backend="sim")  # type: ignore[dict-item]


def test_mesh_empty_dict() -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "non-empty dict", "{}")):
        fs.make_mesh({}, backend="sim")


def test_mesh_not_a_dict() -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "dict", "[2, 2]")):
        fs.make_mesh([2, 2], backend="sim")  # type: ignore[arg-type]


def test_mesh_non_str_axis_name() -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "axis names", "strings", "found 0")):
        fs.make_mesh({0: 2}, backend="sim")  # type: ignore[dict-item]


def test_mesh_unknown_backend() -> None:
    with pytest.raises(fs.MeshError, match=_has("make_mesh", "'gpu'", "'sim'", "'dist'")):
        fs.make_mesh({"dp": 2}, backend="gpu")


def test_mesh_axis_size_unknown_axis() -> None:
    with pytest.raises(fs.MeshError, match=_has("axis_size", "'pp'", "['dp', 'tp']")):
        _mesh().axis_size("pp")


def test_mesh_dist_without_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    with pytest.raises(fs.MeshError, match=_has("backend='dist'", "RANK", "WORLD_SIZE", "torchrun", "'sim'")):
        fs.make_mesh({"dp": 2}, backend="dist")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_mesh_dist_world_size_mismatch(tmp_path) -> None:
    """A one-process gloo group (no spawning) and a mesh of 4 devices."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(fs.MeshError, match=_has("make_mesh", "4 devices", "1 processes", "'dp': 2", "'tp': 2")):
            fs.make_mesh({"dp": 2, "tp": 2}, backend="dist")
    finally:
        dist.destroy_process_group()


# -- collectives -------------------------------------------------------------------------------------------

_X = torch.ones(4)
_OUTSIDE = {
    "psum": lambda: fs.psum(_X, "dp"),
    "pmean": lambda: fs.pmean(_X, "dp"),
    "pmax": lambda: fs.pmax(_X, "dp"),
    "pmin": lambda: fs.pmin(_X, "dp"),
    "pvary": lambda: fs.pvary(_X, "dp"),
    "all_gather": lambda: fs.all_gather(_X, "dp"),
    "psum_scatter": lambda: fs.psum_scatter(_X, "dp", tiled=True),
    "all_to_all": lambda: fs.all_to_all(_X, "dp", 0, 0),
    "ppermute": lambda: fs.ppermute(_X, "dp", [(0, 1), (1, 0)]),
    "axis_index": lambda: fs.axis_index("dp"),
    "axis_size": lambda: fs.axis_size("dp"),
}


@pytest.mark.parametrize("name", sorted(_OUTSIDE))
def test_collective_outside_shard_map(name: str) -> None:
    with pytest.raises(fs.ShardingError, match=_has(f"{name}: called outside shard_map", "fs.shard_map")):
        _OUTSIDE[name]()


def _run(f, *args, in_specs=None, out_specs=None, check_vma: bool = True):
    """``f`` under shard_map on the dp=2 x tp=2 sim mesh; by default every argument is P("dp"), the output P()."""
    in_specs = (P("dp"),) * len(args) if in_specs is None else in_specs
    out_specs = P() if out_specs is None else out_specs
    return fs.shard_map(f, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)(*args)


def test_collective_axis_not_in_mesh() -> None:
    with pytest.raises(fs.ShardingError, match=_has("psum", "axis 'pp'", "['dp', 'tp']")):
        _run(lambda x: fs.psum(x, "pp"), torch.ones(4))


def test_collective_axis_not_a_name() -> None:
    with pytest.raises(fs.ShardingError, match=_has("all_gather", "found 0", "['dp', 'tp']")):
        _run(lambda x: fs.all_gather(x, 0), torch.ones(4), out_specs=P("dp"))


def test_collective_axis_named_twice() -> None:
    with pytest.raises(fs.ShardingError, match=_has("psum", "('dp', 'dp')", "twice")):
        _run(lambda x: fs.psum(x, ("dp", "dp")), torch.ones(4))


def test_ppermute_repeated_destination() -> None:
    with pytest.raises(fs.ShardingError, match=_has("ppermute", "[(0, 1), (1, 1)]", "('tp',)", "repeats")):
        _run(lambda x: fs.ppermute(x, "tp", [(0, 1), (1, 1)]), torch.ones(4), out_specs=P("dp"))


def test_ppermute_index_out_of_range() -> None:
    with pytest.raises(fs.ShardingError, match=_has("ppermute", "('tp',)", "size 2", "out of range: [(0, 2)]")):
        _run(lambda x: fs.ppermute(x, "tp", [(0, 2)]), torch.ones(4), out_specs=P("dp"))


def test_psum_scatter_tiled_not_divisible_splits_unevenly() -> None:
    """A dim the axis does not divide is scattered as torch.tensor_split splits it (API §14)."""
    y = _run(lambda x: fs.psum_scatter(x, "tp", tiled=True), torch.ones(3, 2), in_specs=(P(),), out_specs=P("tp"))
    assert [tuple(y.shards[(0, j)].shape) for j in range(2)] == [(2, 2), (1, 2)]
    assert torch.equal(fs.device_get(y), torch.full((3, 2), 2.0))


def test_psum_scatter_untiled_wrong_size() -> None:
    with pytest.raises(
        fs.ShardingError, match=_has("psum_scatter(tiled=False)", "(3, 2)", "size 2 of ('tp',)", "tiled=True")
    ):
        _run(lambda x: fs.psum_scatter(x, "tp", tiled=False), torch.ones(3, 2), in_specs=(P(),), out_specs=P("tp"))


def test_all_to_all_split_dim_not_divisible_splits_unevenly() -> None:
    """A split_dim the axis does not divide is cut as torch.tensor_split cuts it (API §14)."""
    x = torch.arange(6.0).reshape(2, 3)
    y = _run(lambda x: fs.all_to_all(x, "tp", 1, 0), x, in_specs=(P(),), out_specs=P(None, "tp"))
    assert [tuple(y.shards[(0, j)].shape) for j in range(2)] == [(4, 2), (4, 1)]  # [2, 3] -> [2 x 2, 3 / 2]
    assert torch.equal(fs.device_get(y), torch.cat([x, x]))


def test_all_to_all_untiled_wrong_size() -> None:
    with pytest.raises(fs.ShardingError, match=_has("all_to_all", "split_dim 1", "(2, 3)", "size 3", "('tp',)")):
        _run(lambda x: fs.all_to_all(x, "tp", 1, 0, tiled=False), torch.ones(2, 3), in_specs=(P(),), out_specs=P("tp"))


# -- shard_map: outputs ------------------------------------------------------------------------------------


def test_varying_output_under_replicated_out_spec() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'out/y'", "axis 'dp'", "P()", "psum")):
        _run(lambda x: {"y": x}, torch.ones(4, 2), out_specs={"y": P()})


def test_varying_output_missing_one_of_two_axes() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'out'", "axis 'tp'", "P('dp')")):
        _run(lambda x: x, torch.ones(4, 2), in_specs=(P("dp", "tp"),), out_specs=P("dp"))


def test_replicated_output_differs_without_check_vma() -> None:
    def f(x):
        return x * (1 + fs.axis_index("dp"))  # devices of dp differ by up to 2.5

    with pytest.raises(fs.ShardingError, match=_has("at 'out'", "axis 'dp'", "differ by up to 2.5", "P()")):
        _run(f, torch.tensor([1.0, 2.5]), in_specs=(P(),), out_specs=P(), check_vma=False)


def test_out_spec_unknown_axis() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'out/y'", "'xx'", "['dp', 'tp']")):
        _run(lambda x: {"y": x}, torch.ones(4), out_specs={"y": P("xx")})


def test_out_specs_not_a_prefix_of_output() -> None:
    with pytest.raises(fs.ShardingError, match=_has("out_specs", "not a prefix", "['a', 'b']", "['a']")):
        _run(lambda x: {"a": x, "b": x}, torch.ones(4), out_specs={"a": P("dp")})


def test_non_tensor_output_with_sharded_spec() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'out/n'", "int", "P('dp')", "P()")):
        _run(lambda x: {"n": 3}, torch.ones(4), out_specs={"n": P("dp")})


def test_devices_return_different_structures() -> None:
    def f(x):
        return {"a": x} if fs.axis_index("dp") == 0 else {"b": x}

    with pytest.raises(fs.ShardingError, match=_has("different output structures", "(0, 0)", "(1, 0)")):
        _run(f, torch.ones(4), out_specs=P("dp"))


def test_devices_return_tensor_and_int_at_one_leaf() -> None:
    def f(x):
        return {"y": x if fs.axis_index("dp") == 0 else 3}

    with pytest.raises(fs.ShardingError, match=_has("at 'out/y'", "Tensor", "int", "(1, 0)")):
        _run(f, torch.ones(4), out_specs=P("dp"))


def test_devices_return_int_and_tensor_at_one_leaf() -> None:
    def f(x):
        return {"y": 3 if fs.axis_index("dp") == 0 else x}

    with pytest.raises(fs.ShardingError, match=_has("at 'out/y'", "Tensor", "int", "(1, 0)")):
        _run(f, torch.ones(4), out_specs=P())


def test_devices_return_different_dtypes() -> None:
    def f(x):
        return {"y": x if fs.axis_index("dp") == 0 else x.double()}

    with pytest.raises(fs.ShardingError, match=_has("at 'out/y'", "float32", "float64", "(1, 0)")):
        _run(f, torch.ones(4), out_specs=P("dp"))


def test_devices_return_different_python_values_under_replicated_spec() -> None:
    def f(x):
        return {"i": fs.axis_index("dp")}  # a per-device int under P(): the devices disagree

    with pytest.raises(fs.ShardingError, match=_has("at 'out/i'", "'dp'", "P()")):
        _run(f, torch.ones(4), out_specs=P(), check_vma=False)


def test_devices_return_different_shapes() -> None:
    def f(x):
        return {"y": x[: 1 + fs.axis_index("dp")]}

    with pytest.raises(fs.ShardingError, match=_has("at 'out/y'", "device (1, 0)", "shape (2,)", "(1,)")):
        _run(f, torch.ones(4), out_specs=P("dp"))


# -- shard_map: inputs and misuse --------------------------------------------------------------------------


def test_in_specs_length_differs_from_args() -> None:
    with pytest.raises(fs.ShardingError, match=_has("in_specs has 2 entries", "1 positional")):
        _run(lambda x: x, torch.ones(4), in_specs=(P("dp"), P()))


def test_in_specs_not_a_tuple() -> None:
    with pytest.raises(fs.ShardingError, match=_has("in_specs must be a tuple", "in_specs=(P(...),)")):
        _run(lambda x, y: x, torch.ones(4), torch.ones(4), in_specs=P("dp"))


def test_in_spec_does_not_fit_argument() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'args[1]/w'", "2 entries", "P('dp', None)", "(3,)")):
        _run(lambda a, p: a, torch.ones(4), {"w": torch.ones(3)}, in_specs=(P(), {"w": P("dp", None)}))


def test_in_specs_tree_not_a_prefix_of_argument() -> None:
    with pytest.raises(fs.ShardingError, match=_has("in_specs[0]", "not a prefix", "['w']", "['v']")):
        _run(lambda p: p["w"], {"w": torch.ones(4)}, in_specs=({"v": P()},))


def test_shard_map_mesh_not_a_mesh() -> None:
    with pytest.raises(fs.ShardingError, match=_has("shard_map", "fs.Mesh", "dict")):
        fs.shard_map(lambda x: x, mesh={"dp": 2}, in_specs=(P(),), out_specs=P())  # type: ignore[arg-type]


def test_array_on_another_mesh() -> None:
    other = fs.make_mesh({"dp": 2}, backend="sim")
    a = fs.device_put(torch.ones(4), other, P("dp"))
    with pytest.raises(
        fs.ShardingError, match=_has("at 'args[0]/w'", "{'dp': 2}", "{'dp': 2, 'tp': 2}", "fs.device_put")
    ):
        _run(lambda p: p["w"], {"w": a}, in_specs=({"w": P("dp")},), out_specs=P("dp"))


def test_sharded_spec_on_int_argument() -> None:
    with pytest.raises(fs.ShardingError, match=_has("at 'args[0]/n'", "int", "P('dp')", "P()")):
        _run(lambda p: torch.ones(2), {"n": 3}, in_specs=({"n": P("dp")},))


def test_nested_shard_map() -> None:
    mesh = _mesh()

    def inner(x):
        return x

    def outer(x):
        return fs.shard_map(inner, mesh=mesh, in_specs=(P(),), out_specs=P())(x)

    with pytest.raises(fs.ShardingError, match=_has("shard_map(inner)", "inside another shard_map")):
        fs.shard_map(outer, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(torch.ones(4))


def test_inplace_widening_of_tensor_requiring_grad() -> None:
    w = torch.zeros(2, requires_grad=True)

    def f(w, x):
        w.add_(x)  # w is replicated and requires grad; x varies over dp
        return w

    with pytest.raises(fs.ShardingError, match=_has("add_", "['dp']", "requires grad", "pvary")):
        _run(f, w, torch.ones(4), in_specs=(P(), P("dp")), out_specs=P())


# -- Arrays ------------------------------------------------------------------------------------------------


def test_array_local_under_sim() -> None:
    a = fs.device_put(torch.ones(4), _mesh(), P("dp"))
    with pytest.raises(fs.ShardingError, match=_has("Array.local", "'sim'", ".shards[", "device_get")):
        _ = a.local


def test_device_put_non_tensor_leaf() -> None:
    with pytest.raises(fs.ShardingError, match=_has("device_put at 'n'", "torch.Tensor", "int", "torch.as_tensor")):
        fs.device_put({"w": torch.ones(4), "n": 3}, _mesh(), P())


def test_device_put_mesh_not_a_mesh() -> None:
    with pytest.raises(fs.ShardingError, match=_has("device_put", "fs.Mesh", "dict")):
        fs.device_put(torch.ones(4), {"dp": 2}, P())  # type: ignore[arg-type]


def test_reshard_bad_spec() -> None:
    a = fs.device_put({"w": torch.ones(4, 4)}, _mesh(), {"w": P("dp")})
    with pytest.raises(fs.ShardingError, match=_has("reshard at 'w'", "'xx'", "(4, 4)", "['dp', 'tp']")):
        fs.reshard(a, {"w": P("xx")})


def test_reshard_not_divisible_splits_unevenly() -> None:
    a = fs.device_put({"w": torch.arange(24.0).reshape(4, 6)}, _mesh(), {"w": P("dp")})
    b = fs.reshard(a, {"w": P(None, ("dp", "tp"))})["w"]
    assert [b.shards[c].shape[1] for c in sorted(b.shards)] == [2, 2, 1, 1]
    assert torch.equal(fs.device_get(b), torch.arange(24.0).reshape(4, 6))


def test_reshard_non_array_leaf() -> None:
    with pytest.raises(fs.ShardingError, match=_has("reshard at 'w'", "fs.Array", "Tensor", "device_put")):
        fs.reshard({"w": torch.ones(4)}, P())


# -- simulated devices that disagree -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_collective_mismatch_between_devices() -> None:
    """The message names the collectives as the user called them (psum, not the primitive all_reduce)."""

    def f(x):
        if fs.axis_index("dp") == 0:
            return fs.psum(x, "dp")
        return fs.all_gather(x, "dp", tiled=True)[:2]

    t0 = time.monotonic()
    with pytest.raises(fs.ShardingError, match=_has("collective mismatch", "('dp',)", "psum", "all_gather")):
        _run(f, torch.ones(4), out_specs=P("dp"), check_vma=False)
    assert time.monotonic() - t0 < FAST


@pytest.mark.timeout(30)
def test_collective_deadlock_raises_fast() -> None:
    """The message names the collective as the user called it (psum) and the device left waiting."""

    def f(x):
        if fs.axis_index("dp") == 0 and fs.axis_index("tp") == 0:
            x = fs.psum(x, "dp")  # its dp peer never calls psum
        return x

    t0 = time.monotonic()
    with pytest.raises(fs.ShardingError, match=_has("deadlock", "psum", "('dp',)", "dp=0, tp=0")):
        _run(f, torch.ones(4), out_specs=P("dp"), check_vma=False)
    assert time.monotonic() - t0 < FAST
