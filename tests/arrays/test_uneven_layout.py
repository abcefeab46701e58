"""Uneven dims (API §14): a dim its axes do not divide is split as ``torch.tensor_split`` splits it.

``device_put`` / ``device_get`` / ``reshard`` round trips against the unsharded tensor, ``shard_map`` on blocks of
different local shapes and outputs assembled from them, under ``"sim"``, ``"dist"`` and ``"abstract"``.
"""

from __future__ import annotations

import math

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.extend import axis_index_int, shard_shape, shard_slices

SPECS = [P(), P("a"), P(None, "a"), P("b", "a"), P(("a", "b")), P(None, ("b", "a"))]
#: dims that 2 and 4 do not divide, and dims smaller than the axes (some devices hold no rows)
SHAPES = [(10, 7), (3, 5), (5, 2), (1, 3)]


def _expected_block(x: torch.Tensor, spec: P, mesh: fs.Mesh, coords: tuple[int, ...]) -> torch.Tensor:
    """The block of ``x`` that ``torch.tensor_split`` gives the device at ``coords`` (dim by dim)."""
    at = dict(zip(mesh.axis_names, coords, strict=True))
    for d, axes in enumerate(spec.dim_axes(x.dim())):
        if axes:
            i = 0
            for a in axes:
                i = i * mesh.shape[a] + at[a]
            x = torch.tensor_split(x, math.prod(mesh.shape[a] for a in axes), dim=d)[i]
    return x


def _roundtrip_body(mesh: fs.Mesh) -> int:
    n = 0
    for shape in SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        for s in SPECS:
            a = fs.device_put(x, mesh, s)
            assert a.shape == shape and a.spec == s
            for c, block in a.shards.items():
                assert torch.equal(block, _expected_block(x, s, mesh, c)), (shape, s, c)
            assert torch.equal(fs.device_get(a), x), (shape, s)
            for d in SPECS:
                b = fs.reshard(a, d)
                assert b.spec == d and b.shape == shape
                for c, block in b.shards.items():
                    assert torch.equal(block, _expected_block(x, d, mesh, c)), (shape, s, d, c)
                assert torch.equal(fs.device_get(b), x), (shape, s, d)
                n += 1
    return n


def test_uneven_reshard_every_pair(run) -> None:
    assert set(run(_roundtrip_body, {"a": 2, "b": 2})) == {len(SHAPES) * len(SPECS) ** 2}


def _shard_map_body(mesh: fs.Mesh) -> str:
    x = torch.randn(10, 7, generator=torch.Generator().manual_seed(0))
    for spec in (P("a"), P(None, ("a", "b")), P("b", "a"), P(("a", "b"))):

        def f(t: torch.Tensor, spec: P = spec) -> tuple[torch.Tensor, torch.Tensor]:
            local = shard_shape(x.shape, spec, mesh.shape, {a: axis_index_int(a) for a in mesh.axis_names})
            assert tuple(t.shape) == local, (tuple(t.shape), local)  # each device sees its own local shape
            return t * 2, t.sum().reshape(1)

        out = fs.shard_map(f, mesh=mesh, in_specs=(spec,), out_specs=(spec, P(spec.axes)))
        y, sums = out(x)  # a full tensor in: each device cuts its block
        assert y.shape == (10, 7) and torch.equal(fs.device_get(y), x * 2), spec
        y2, _ = out(fs.device_put(x, mesh, spec))  # an Array laid out so
        assert torch.equal(fs.device_get(y2), x * 2)
        y3, _ = out(fs.device_put(x, mesh, P()))  # an Array laid out otherwise: resharded on the devices
        assert torch.equal(fs.device_get(y3), x * 2)
        assert sums.shape == (math.prod(mesh.shape[a] for a in spec.axes),)
    return "ok"


def test_shard_map_uneven_inputs_and_outputs(run) -> None:
    assert set(run(_shard_map_body, {"a": 2, "b": 2})) == {"ok"}


def _rows_smaller_than_axis_body(mesh: fs.Mesh) -> str:
    x = torch.arange(6.0).reshape(3, 2)  # 3 rows over 4 devices: blocks of 1, 1, 1, 0 rows
    f = fs.shard_map(lambda t: t + 1, mesh=mesh, in_specs=(P(("a", "b")),), out_specs=P(("a", "b")))
    y = f(x)
    assert [tuple(y.shards[c].shape) for c in y.shards] == [
        shard_shape((3, 2), P(("a", "b")), mesh.shape, dict(zip(mesh.axis_names, c, strict=True))) for c in y.shards
    ]
    assert torch.equal(fs.device_get(y), x + 1)
    return "ok"


def test_rows_smaller_than_axis(run) -> None:
    assert set(run(_rows_smaller_than_axis_body, {"a": 2, "b": 2})) == {"ok"}


def test_shard_shapes_are_tensor_split() -> None:
    mesh_shape = {"a": 2, "b": 3}
    for size in range(0, 14):
        for axes in (("a",), ("b",), ("a", "b"), ("b", "a")):
            n = math.prod(mesh_shape[a] for a in axes)
            want = [t.shape[0] for t in torch.tensor_split(torch.empty(size), n)]
            got = []
            starts = []
            for i in range(n):
                coords = {}
                j = i
                for a in reversed(axes):
                    j, coords[a] = divmod(j, mesh_shape[a])
                coords = {**dict.fromkeys(mesh_shape, 0), **coords}
                got.append(shard_shape((size,), P(axes), mesh_shape, coords)[0])
                starts.append(shard_slices((size,), P(axes), mesh_shape, coords)[0].start)
            assert got == want, (size, axes)
            assert starts == [sum(want[:i]) for i in range(n)]


def test_sim_gradients_through_uneven_layouts() -> None:
    mesh = fs.make_mesh({"a": 2, "b": 2}, backend="sim")
    x = torch.randn(10, 3, requires_grad=True)
    w = torch.randn(10, 3)
    a = fs.device_put(x, mesh, P(("a", "b")))
    b = fs.reshard(a, P(None, "a"))
    f = fs.shard_map(lambda t, u: (t * u).sum().reshape(1), mesh=mesh, in_specs=(P("b"), P("b")), out_specs=P("b"))
    (g,) = torch.autograd.grad(fs.device_get(f(b, w)).sum(), x)  # [2] (one sum per block of "b") -> []
    assert torch.allclose(g, w)


def test_blocks_not_tensor_split_raise() -> None:
    mesh = fs.make_mesh({"a": 4}, backend="sim")
    # blocks of 1, 2, 3, 4 rows: not torch.tensor_split's blocks of any size
    f = fs.shard_map(lambda t: torch.zeros(axis_index_int("a") + 1, 2), mesh=mesh, in_specs=(P(),), out_specs=P("a"))
    with pytest.raises(fs.ShardingError, match=r"at 'out'.*sizes \[1, 2, 3, 4\].*tensor_split"):
        f(torch.zeros(1))
    g = fs.shard_map(lambda t: torch.zeros(2, axis_index_int("a") + 1), mesh=mesh, in_specs=(P(),), out_specs=P("a"))
    with pytest.raises(fs.ShardingError, match=r"at 'out'.*differ only along the dims"):
        g(torch.zeros(1))


def test_abstract_uneven_shapes() -> None:
    mesh = fs.make_mesh({"a": 2, "b": 4}, backend="abstract")
    a = fs.device_put(fs.ShapeDtype((10, 6), torch.float32), mesh, P("b", "a"))
    f = fs.shard_map(lambda t: t * 2, mesh=mesh, in_specs=(P(("b", "a")),), out_specs=P(("b", "a")))
    y = f(a)
    assert y.shape == (10, 6)
    for c in [(i, j) for i in range(2) for j in range(4)]:
        at = dict(zip(mesh.axis_names, c, strict=True))
        assert tuple(a.shards[c].shape) == shard_shape((10, 6), P("b", "a"), mesh.shape, at)
        assert tuple(y.shards[c].shape) == shard_shape((10, 6), P(("b", "a")), mesh.shape, at)
    assert fs.device_get(y).shape == (10, 6)


def test_visualize_names_uneven_blocks() -> None:
    mesh = fs.make_mesh({"a": 4}, backend="sim")
    pic = fs.visualize(fs.device_put(torch.zeros(10, 4), mesh, P("a")), show=False)
    assert "dim 0 split unevenly: blocks of [3, 3, 2, 2]" in pic.splitlines()[0]


def _uneven_outputs_of_even_inputs_body(mesh: fs.Mesh) -> str:
    """A body whose inputs split evenly but whose outputs do not (it slices by its device index): each call's
    global shapes are the sum of the blocks, under ``"dist"`` too (where no process sees the others' blocks)."""
    n = mesh.shape["a"]

    def f(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = (n - axis_index_int("a")) // 2 + int(k)  # n=2: 1 + k, 0 + k rows; tensor_split's blocks
        return x[:rows], x.sum(0, keepdim=True)  # [rows, 3]; [1, 3], even

    step = fs.shard_map(f, mesh=mesh, in_specs=(P("a"), P()), out_specs=(P("a"), P("a")))
    x = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    for k in (1, 2, 1):  # the second call's blocks differ from the first's: the shapes are exchanged again
        out, sums = step(x, torch.tensor(k))
        blocks = [x[4 * i : 4 * i + (n - i) // 2 + k] for i in range(n)]
        assert out.shape == (sum(len(b) for b in blocks), 3), (k, out.shape)
        assert torch.equal(fs.device_get(out), torch.cat(blocks)), k
        assert sums.shape == (n, 3) and torch.equal(fs.device_get(sums), x.reshape(n, 4, 3).sum(1))
    bad = fs.shard_map(lambda t: torch.zeros(axis_index_int("a") + 1, 2), mesh=mesh, in_specs=(P(),), out_specs=P("a"))
    with pytest.raises(fs.ShardingError, match=r"tensor_split"):
        bad(torch.zeros(1))  # blocks of 1 and 2 rows: not tensor_split's, refused on every process
    return "ok"


def test_uneven_outputs_of_even_inputs(run) -> None:
    assert set(run(_uneven_outputs_of_even_inputs_body, {"a": 2})) == {"ok"}
