"""A ZeroTensor (torch's known-zero tangent, no memory behind it) through the core's own sums (internal:
``psum_owned``, which sums a temporary in its own buffer under dist, and ``psum_pending``), sim and dist; the rest
of the zero tangents: tests/collectives/test_zero_tangents_through_collectives.py."""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives.lax import psum_owned, psum_pending

MESH = {"a": 4, "b": 2}  # the fuzzer's mesh, as in tests/collectives/test_zero_tangents_through_collectives.py
N = MESH["a"]


def _zeros(like: torch.Tensor) -> torch.Tensor:
    """A ZeroTensor of ``like``'s shape and dtype (what torch's autograd makes for a known-zero tangent)."""
    return torch._efficientzerotensor(like.shape, dtype=like.dtype)


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.chunk(N))


def _owned_and_pending_sums(mesh: fs.Mesh) -> str:

    def body(xl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 32 KiB: a temporary dist sums in its own buffer, which a ZeroTensor does not have
        owned = psum_owned(_zeros(torch.empty(64, 64, dtype=xl.dtype)), "a")  # [64, 64] -> [64, 64]
        pending = psum_pending(_zeros(xl), "a") + psum_pending(xl, "a")  # [2, 3] -> [2, 3]: pending under dist
        return owned, pending

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    f = fs.shard_map(body, mesh=mesh, in_specs=(P("a"),), out_specs=(P(), P()))
    owned, pending = (fs.device_get(o) for o in f(x))
    torch.testing.assert_close(owned, torch.zeros(64, 64, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(pending, sum(_blocks(x)), rtol=1e-12, atol=1e-12)
    return "ok"


def test_zero_tensor_into_owned_and_pending_sums(run) -> None:
    assert set(run(_owned_and_pending_sums, MESH)) == {"ok"}
