"""Arrays: device_put / device_get round trips, reshard between every pair of specs, visualize."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P

SPECS = [P(), P("a"), P(None, "a"), P("b", "a"), P(("a", "b"))]


def _roundtrip_body(mesh: fs.Mesh) -> int:
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    n = 0
    for s in SPECS:
        a = fs.device_put(x, mesh, s)
        assert a.shape == (8, 12) and a.dtype == x.dtype and a.spec == s and a.mesh == mesh
        assert torch.equal(fs.device_get(a), x)  # bitwise
        for d in SPECS:
            b = fs.reshard(a, d)
            assert b.spec == d
            assert torch.equal(fs.device_get(b), x), (s, d)
            n += 1
    return n


def test_reshard_every_pair(run) -> None:
    assert set(run(_roundtrip_body, {"a": 2, "b": 2})) == {25}


def _dtypes_body(mesh: fs.Mesh) -> str:
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        x = (torch.arange(48) - 7).reshape(4, 12).to(dt)
        a = fs.device_put(x, mesh, P(None, ("a", "b")))
        assert fs.device_get(a).dtype == dt
        assert torch.equal(fs.device_get(a), x)
        assert torch.equal(fs.device_get(fs.reshard(a, P("b"))), x)
    return "ok"


def test_device_put_get_dtypes(run) -> None:
    assert set(run(_dtypes_body, {"a": 2, "b": 2})) == {"ok"}


def test_tree_device_put_with_prefix_specs() -> None:
    mesh = fs.make_mesh({"a": 2, "b": 2}, backend="sim")
    tree = {"layers": [torch.randn(4, 4), torch.randn(4, 4)], "head": torch.randn(4)}
    out = fs.device_put(tree, mesh, {"layers": P("a"), "head": P()})
    assert [x.spec for x in out["layers"]] == [P("a"), P("a")]
    assert out["head"].spec == P()
    back = fs.device_get(out)
    assert torch.equal(back["layers"][1], tree["layers"][1])


def test_shards_are_the_right_blocks() -> None:
    mesh = fs.make_mesh({"a": 2, "b": 2}, backend="sim")
    x = torch.arange(16.0).reshape(4, 4)
    arr = fs.device_put(x, mesh, P("b", "a"))
    assert torch.equal(arr.shards[(0, 1)], x[2:, :2])  # a=0 -> cols 0:2, b=1 -> rows 2:4
    assert torch.equal(arr.shards[(1, 0)], x[:2, 2:])
    with pytest.raises(fs.ShardingError, match="shards"):
        _ = arr.local


def test_reshard_counts_bytes() -> None:
    mesh = fs.make_mesh({"a": 2, "b": 2}, backend="sim")
    x = fs.device_put(torch.randn(8, 8), mesh, P("a"))
    with fs.comm_stats() as st:
        fs.reshard(x, P(None, "a"))
    assert st.calls() == 1 and st.calls("all_to_all", "a") == 1
    assert st.bytes() == 4 * 8 * 4  # one device's [4, 8] float32 block
    with fs.comm_stats() as st:
        fs.reshard(x, P(("a", "b")))
    assert st.calls() == 0  # slicing only


def test_visualize_picture() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="sim")
    pic = fs.visualize(fs.device_put(torch.zeros(4, 8), mesh, P("dp", "tp")), show=False)
    lines = pic.splitlines()
    assert "P('dp', 'tp')" in lines[0]
    assert sum(line.count("dev ") for line in lines) == 8
    assert "dp=1 tp=3" in pic
    pic2 = fs.visualize(fs.device_put(torch.zeros(4, 8), mesh, P(None, "tp")), show=False)
    assert "dev 0,4" in pic2 and "dp=* tp=0" in pic2


def _visualize_body(mesh: fs.Mesh) -> tuple[str, str]:
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pic = fs.visualize(fs.device_put(torch.zeros(4, 8), mesh, P("dp")))
    return str(pic), printed.getvalue()


def test_visualize_prints_on_the_first_process_only(run) -> None:
    results = run(_visualize_body, {"dp": 2})
    assert all(pic == results[0][0] for pic, _ in results)  # every process returns the picture
    assert results[0][1].strip() == results[0][0]  # the first prints it
    assert all(printed == "" for _, printed in results[1:])  # the others print nothing


def _numpy_body(mesh: fs.Mesh) -> tuple[bool, bool]:
    """A tensor over memory torch does not own (``torch.from_numpy``) as a shard_map argument and its result."""
    import numpy as np

    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    x = torch.from_numpy(data)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)  # in place on the device's own block: never on the caller's memory

    out = fs.device_get(fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x))
    again = fs.device_get(fs.device_put(torch.from_numpy(data), mesh, P("dp")))  # owned from numpy memory too
    return torch.equal(out, 2 * torch.arange(8.0).reshape(4, 2)) and torch.equal(again, x), bool(
        (data == np.arange(8, dtype=np.float32).reshape(4, 2)).all()
    )


def test_numpy_backed_arguments(run) -> None:
    for right, untouched in run(_numpy_body, {"dp": 2}):
        assert right and untouched
