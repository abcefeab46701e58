"""The dist backend's synchronous in-place sums (``all_reduce_inplace`` and ``all_reduce_inplace_parts``, issue
#11): a plain ``try`` around the process group's call instead of the generator context manager (~3-5k
instructions a call), with the same error mapping: a peer that does not answer becomes ``peer_error``'s
``PeerError``, any other failure goes through unchanged; the sum is the process group's, in the caller's buffer.
Checked on a stand-in process group (the call and the error are the group's: no second process needed), and under
``dist`` on two processes against the sum computed here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.runtime.backends import dist as dist_backend
from funcshard._src.runtime.comm import PeerError


class _Group:
    """A process group whose ``allreduce`` doubles its buffer (a sum over two equal members) or fails."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail, self.calls = fail, 0

    def allreduce(self, bufs: list[torch.Tensor], opts: Any) -> Any:
        self.calls += 1
        if self.fail is not None:
            raise RuntimeError(self.fail)
        for b in bufs:
            b.mul_(2)
        return SimpleNamespace(wait=lambda: True)


def _device(group: _Group) -> Any:
    return SimpleNamespace(_group=lambda axes: (group, [0, 1], [0, 1], 0))


def _peer_error(what: str, axes: tuple[str, ...], members: list[int], err: BaseException) -> PeerError:
    return PeerError(f"{what} over {axes} ({members}): {err}")


@pytest.mark.parametrize("parts", [False, True])
def test_sync_inplace_sum_sums_in_the_buffer_and_maps_peer_errors(parts: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist_backend, "peer_error", _peer_error)

    def call(dev: Any, x: torch.Tensor) -> Any:
        if parts:
            return dist_backend.DistDevice.all_reduce_inplace_parts(dev, x, ("dp",), [torch.Size([2]), torch.Size([1])])
        return dist_backend.DistDevice.all_reduce_inplace(dev, x, ("dp",))

    ok = _Group()
    x = torch.tensor([1.0, 2.0, 3.0])
    out = call(_device(ok), x)
    assert ok.calls == 1
    if parts:
        assert [o.tolist() for o in out] == [[2.0, 4.0], [6.0]]
        assert all(o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in out)
    else:
        assert out.tolist() == [2.0, 4.0, 6.0] and out.data_ptr() == x.data_ptr()  # in the caller's buffer
    with pytest.raises(PeerError, match=r"psum over \('dp',\)"):
        call(_device(_Group("Connection closed by peer")), torch.ones(3))
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        call(_device(_Group("shape mismatch in the input")), torch.ones(3))
    assert type(info.value) is RuntimeError


def _dist_body(mesh: fs.Mesh) -> list[torch.Tensor]:
    dev = dist_backend.device_for(mesh)
    x = torch.arange(5, dtype=torch.float32) + torch.distributed.get_rank()
    whole = dev.all_reduce_inplace(x.clone(), ("dp",))  # [5] -> [5], summed over the two ranks
    parts = dev.all_reduce_inplace_parts(x.clone(), ("dp",), [torch.Size([3]), torch.Size([2])])  # [5] -> [3], [2]
    return [whole, torch.cat(parts)]


@pytest.mark.dist
def test_dist_inplace_sum_equals_the_sum() -> None:
    from _dist_pool import run_body

    want = torch.arange(5, dtype=torch.float32) * 2 + 1  # ranks 0 and 1
    for whole, parts in run_body("dist", _dist_body, {"dp": 2}):
        assert torch.equal(whole, want) and torch.equal(parts, want)
