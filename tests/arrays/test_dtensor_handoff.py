"""``fs.to_dtensor`` / ``fs.from_dtensor`` under ``"dist"`` (gloo workers), checked against DTensor itself."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.oracle

SPECS = [P(), P("tp"), P(None, "tp"), P("dp", "tp"), P(("dp", "tp")), P(None, ("dp", "tp"))]


def _round_trip(mesh: fs.Mesh) -> str:
    from torch.distributed.tensor import Replicate, Shard

    w = torch.arange(64.0).reshape(8, 8)
    dms = set()
    for spec in SPECS:
        a = fs.device_put(w, mesh, spec)
        dt = fs.to_dtensor(a)
        dms.add(id(dt.device_mesh))
        assert torch.equal(dt.full_tensor(), w), spec
        assert torch.equal(dt.to_local(), a.local), spec
        back = fs.from_dtensor(dt)
        assert back.spec == spec and back.mesh == mesh, (back.spec, spec)
        assert torch.equal(fs.device_get(back), w)
    assert len(dms) == 1  # one DeviceMesh per mesh, shared by every DTensor
    # DTensor's own ops work on what funcshard handed over
    dt = fs.to_dtensor(fs.device_put(w, mesh, P("dp")))
    moved = dt.redistribute(dt.device_mesh, [Replicate(), Shard(1)])
    assert fs.from_dtensor(moved).spec == P(None, "tp")
    assert torch.equal(fs.device_get(fs.from_dtensor(moved)), w)
    return "ok"


def _partial_and_foreign(mesh: fs.Mesh) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    dm = fs.to_dtensor(fs.device_put(torch.zeros(4), mesh, P())).device_mesh
    part = DTensor.from_local(torch.ones(4), dm, [Partial(), Replicate()])  # sums to dp=2 copies
    got = fs.from_dtensor(part)
    assert got.spec == P() and torch.equal(fs.device_get(got), torch.full((4,), 2.0))
    foreign = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # torch's own groups
    x = torch.arange(16.0).reshape(4, 4)
    dt = distribute_tensor(x, foreign, [Replicate(), Replicate()])
    a = fs.from_dtensor(dt)
    assert a.spec == P() and torch.equal(fs.device_get(a), x)
    return "ok"


def _errors(mesh: fs.Mesh) -> str:
    a = fs.device_put(torch.zeros(8), mesh, P(("tp", "dp")))
    with pytest.raises(fs.ShardingError, match="mesh order"):
        fs.to_dtensor(a)
    with pytest.raises(fs.ShardingError, match=r"expected an fs\.Array"):
        fs.to_dtensor(torch.zeros(2))
    with pytest.raises(fs.ShardingError, match="expected a torch DTensor"):
        fs.from_dtensor(torch.zeros(2))
    # tensor_split's uneven blocks are not DTensor's (torch.chunk's): refused, not mislabelled
    with pytest.raises(fs.ShardingError, match=r"dim 0 .* split unevenly .*\[3, 2\].*torch\.chunk"):
        fs.to_dtensor(fs.device_put(torch.zeros(5, 2), mesh, P("tp")))
    return "ok"


@pytest.mark.dist
@pytest.mark.parametrize("body", [_round_trip, _partial_and_foreign, _errors])
def test_dtensor_hand_off_dist(body) -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", body, {"dp": 2, "tp": 2})) == {"ok"}


def test_to_dtensor_on_sim_mesh_says_why() -> None:
    mesh = fs.make_mesh({"tp": 2}, backend="sim")
    with pytest.raises(fs.ShardingError, match="torchrun"):
        fs.to_dtensor(fs.device_put(torch.zeros(4), mesh, P("tp")))
