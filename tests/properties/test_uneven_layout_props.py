"""Properties of the uneven layout (API §14) on random meshes, shapes and specs, under ``sim``.

``device_put`` holds ``torch.tensor_split``'s block on every device, ``device_get`` gives the tensor back, and
``reshard`` to another random spec holds that spec's blocks and the same value; a shard_map on the Array sees each
device's own block and assembles its outputs into the global value.
"""

from __future__ import annotations

import torch
from _uneven_strategies import block, fixed, meshes, rank_coords, shapes, specs
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs


@st.composite
def layouts(draw: st.DrawFn) -> tuple[dict[str, int], tuple[int, ...], fs.P, fs.P]:
    """A mesh, a shape and two specs for it."""
    mesh_shape = draw(meshes())
    shape = draw(shapes())
    return mesh_shape, shape, draw(specs(mesh_shape, len(shape))), draw(specs(mesh_shape, len(shape)))


def _check_blocks(a: fs.Array, x: torch.Tensor, spec: fs.P, mesh: fs.Mesh) -> None:
    coords = rank_coords(dict(mesh.shape))
    assert sorted(a.shards) == sorted(tuple(c.values()) for c in coords)
    for c in coords:
        want = block(x, spec, dict(mesh.shape), c)
        got = a.shards[tuple(c.values())]
        assert got.shape == want.shape, (spec, c, tuple(got.shape), tuple(want.shape))
        assert torch.equal(got, want), (spec, c)


@fixed(150)
@given(layouts(), st.integers(0, 2**16))
def test_put_get_reshard_round_trip(layout: tuple, seed: int) -> None:
    mesh_shape, shape, s1, s2 = layout
    mesh = fs.make_mesh(mesh_shape, backend="sim")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    a = fs.device_put(x, mesh, s1)
    assert a.shape == shape
    _check_blocks(a, x, s1, mesh)
    assert torch.equal(fs.device_get(a), x)
    b = fs.reshard(a, s2)
    assert b.shape == shape
    _check_blocks(b, x, s2, mesh)
    assert torch.equal(fs.device_get(b), x)
    _check_blocks(fs.reshard(b, s1), x, s1, mesh)


@fixed(50)
@given(layouts(), st.integers(0, 2**16))
def test_shard_map_sees_each_block_and_assembles(layout: tuple, seed: int) -> None:
    mesh_shape, shape, s1, s2 = layout
    mesh = fs.make_mesh(mesh_shape, backend="sim")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}

    def body(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        seen[tuple(int(fs.axis_index(a)) for a in mesh_shape)] = tuple(t.shape)
        return t * u + 1.0  # [local] elementwise, both blocks of one spec

    f = fs.shard_map(body, mesh=mesh, in_specs=(s2, s2), out_specs=s2)
    y = f(fs.device_put(x, mesh, s1), w)  # an Array laid out by s1 (resharded to s2) and a full tensor (cut)
    assert seen == {tuple(c.values()): tuple(block(x, s2, mesh_shape, c).shape) for c in rank_coords(mesh_shape)}
    assert y.shape == shape
    torch.testing.assert_close(fs.device_get(y), x * w + 1.0, rtol=0, atol=0)
    xg = x.clone().requires_grad_(True)
    r = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    (g,) = torch.autograd.grad((fs.device_get(f(xg, w)) * r).sum(), xg)  # d/dx sum((x w + 1) r) = w r
    torch.testing.assert_close(g, w * r, rtol=0, atol=0)
