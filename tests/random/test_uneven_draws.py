"""``fs.random`` inside ``shard_map`` with a spec that splits a dim unevenly: each device draws its
``torch.tensor_split`` block, equal to that slice of the unsharded draw (API §5, §14), under ``sim``, ``dist`` and
``"abstract"``."""

from __future__ import annotations

import torch

import funcshard as fs
import funcshard.random as fsr
from funcshard import P


def _draws_body(mesh: fs.Mesh) -> str:
    key = fsr.key(3)
    for shape, spec, draw in [
        ((10, 3), P("tp"), fsr.normal),
        ((3, 7), P(None, ("dp", "tp")), fsr.uniform),
        ((5, 6), P(("tp", "dp")), fsr.normal),
    ]:
        f = fs.shard_map(
            lambda k, shape=shape, spec=spec, draw=draw: draw(k, shape, spec=spec),
            mesh=mesh,
            in_specs=(P(),),
            out_specs=spec,
        )
        got = f(key)
        assert got.shape == shape
        assert torch.equal(fs.device_get(got), draw(key, shape)), (shape, spec)
    return "ok"


def test_uneven_draws_equal_the_unsharded_draw(run) -> None:
    assert set(run(_draws_body, {"dp": 2, "tp": 2})) == {"ok"}


def test_uneven_draw_shapes_on_abstract_mesh() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 4}, backend="abstract")
    f = fs.shard_map(lambda k: fsr.normal(k, (10, 3), spec=P("tp")), mesh=mesh, in_specs=(P(),), out_specs=P("tp"))
    y = f(fsr.key(0))
    assert y.shape == (10, 3)
    assert [tuple(y.shards[(0, j)].shape) for j in range(4)] == [(3, 3), (3, 3), (2, 3), (2, 3)]
