"""The cast collectives (internal: ``all_gather_cast`` / ``pvary_cast``, what ``fs.Precision`` applies) equal the
composition of plain casts and collectives they stand for, exactly: forward, backward, jvp and vmap."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import lax


def _cast_body(mesh: fs.Mesh, grad_dtype: torch.dtype) -> list[bool]:
    """all_gather_cast / pvary_cast against the casts and collectives they fuse, exactly."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    c1 = torch.randn(16, 3, generator=torch.Generator().manual_seed(1)) * 1.7  # [8, 3] per device, varying over a
    c2 = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))  # [4, 3] per device, varying over a and b
    bf16 = torch.bfloat16

    def fused(x: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
        y = lax.all_gather_cast(x, "a", tiled=True, dtype=bf16, grad_dtype=grad_dtype)  # [8/n, 3] -> [8, 3] bf16
        z = lax.pvary_cast(x, "b", dtype=bf16, grad_dtype=grad_dtype)  # [8/n, 3] bf16, varying over b
        # the second term summed over b (psum's backward is the identity), so the first is not made varying
        return (y.float() * c1).sum() + fs.psum((z.float() * c2 * 3).sum(), "b")

    def reference(c1: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
        # the cotangents arrive in bf16 (the outputs' dtype), are summed in grad_dtype, come back in float32
        gy = lax.psum_scatter(c1.to(bf16).to(grad_dtype), "a", dim=0, tiled=True)  # [8, 3] -> [8/n, 3]
        gz = lax.psum((c2 * 3).to(bf16).to(grad_dtype), "b")  # [8/n, 3] -> [8/n, 3]
        return gy.float() + gz.float()

    in_specs = (P("a"), P("a"), P(("a", "b")))
    with fs.comm_stats() as stats:
        got = fs.shard_map(torch.func.grad(fused), mesh=mesh, in_specs=in_specs, out_specs=P("a"))(x, c1, c2)
    ref = fs.shard_map(reference, mesh=mesh, in_specs=in_specs[1:], out_specs=P("a"))(c1, c2)
    got, ref = fs.device_get(got), fs.device_get(ref)
    isz = torch.tensor([], dtype=grad_dtype).element_size()
    shard = (8 // mesh.shape["a"]) * 3
    return [
        torch.equal(got, ref),
        got.dtype == torch.float32,
        stats.bytes("all_gather", "a") == shard * 2,  # the shard, in bf16
        stats.bytes("psum_scatter", "a") == 8 * 3 * isz,  # the full cotangent, in grad_dtype
        stats.bytes("psum", "b") == 4 + shard * isz,  # the loss term's psum (float32), then the gradient's
    ]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cast_collectives_equal_their_composition(run, grad_dtype) -> None:
    for checks in run(_cast_body, {"a": 2, "b": 2}, grad_dtype):
        assert all(checks), checks


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward_ad's first use
def test_cast_collectives_under_jvp_and_vmap() -> None:
    mesh = fs.make_mesh({"a": 2}, backend="sim")
    x, t = torch.randn(4, 3), torch.randn(4, 3)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return lax.all_gather_cast(x, "a", tiled=True, dtype=torch.bfloat16, grad_dtype=torch.float32)

    def jvp(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.jvp(fused, (x,), (t,))

    f = fs.shard_map(jvp, mesh=mesh, in_specs=(P("a"), P("a")), out_specs=(P("a"), P("a")))
    y, ty = (fs.device_get(v) for v in f(x, t))
    ref = fs.shard_map(
        lambda x: lax.all_gather(x.to(torch.bfloat16), "a", tiled=True), mesh=mesh, in_specs=(P("a"),), out_specs=P("a")
    )
    assert torch.equal(y, fs.device_get(ref(x))) and torch.equal(ty, fs.device_get(ref(t)))
    vm = fs.shard_map(torch.vmap(fused), mesh=mesh, in_specs=(P(None, "a"),), out_specs=P(None, "a"))
    xs = torch.randn(5, 4, 3)
    want = fs.shard_map(
        torch.vmap(lambda x: lax.all_gather(x.to(torch.bfloat16), "a", tiled=True)),
        mesh=mesh,
        in_specs=(P(None, "a"),),
        out_specs=P(None, "a"),
    )(xs)
    assert torch.equal(fs.device_get(vm(xs)), fs.device_get(want))
