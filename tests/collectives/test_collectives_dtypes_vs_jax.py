"""Audit of the collectives against JAX's ``shard_map`` on what the fuzzer does not generate: dtypes other than
float64 (bool, integers, 16-bit floats) and the special floats (NaN, signed zeros) through the reductions.

Each body runs under ``sim`` and under ``dist`` (gloo); the oracle is ``jax.shard_map`` on 8 host devices
(``jax.lax.psum`` / ``pmean`` / ``pmax`` / ``pmin``: their values and dtypes) or, where JAX has no rule (the
gradient of ``pmax``) or its CPU collective differs from its own ``jnp.max`` (NaN), torch's reduction over
the stacked blocks.
"""

from __future__ import annotations

import os

import pytest
import torch

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.oracle

MESH = {"a": 2, "b": 4}
DTYPES = [torch.bool, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16]
# (name, axis, out_spec): a reduction over one axis and over a tuple out of mesh order
REDUCTIONS = [("psum", "b", P("a")), ("pmean", "b", P("a")), ("pmax", ("b", "a"), P()), ("pmin", "b", P("a"))]


def _value(dt: torch.dtype) -> torch.Tensor:
    """An [8, 4] value of ``dt`` with repeats (ties), negatives, and in int64 numbers float32 cannot hold."""
    x = torch.arange(32).reshape(8, 4) % 5 - 2
    if dt == torch.int64:
        return x + 2**40 + 1  # pmean must not round through float32
    return x.to(dt)


def _reductions_body(mesh: fs.Mesh) -> dict[tuple[str, str], torch.Tensor]:
    out = {}
    for dt in DTYPES:
        for name, axis, out_spec in REDUCTIONS:
            f = fs.shard_map(
                lambda v, name=name, axis=axis: getattr(fs, name)(v, axis),
                mesh=mesh,
                in_specs=(P(("a", "b")),),
                out_specs=out_spec,
            )
            out[str(dt), name] = fs.device_get(f(_value(dt)))
    return out


def _jax_reductions() -> dict[tuple[str, str], torch.Tensor]:
    """The same reductions by ``jax.shard_map`` (x64 on, so int64 stays int64 as in torch)."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    jax = pytest.importorskip("jax")
    import ml_dtypes
    import numpy as np
    from jax.sharding import PartitionSpec

    if len(jax.devices()) < 8:
        pytest.skip("jax was imported before XLA_FLAGS asked for 8 host devices")
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    out = {}
    with jax.enable_x64(True):
        for dt in DTYPES:
            x = _value(dt)
            a = x.float().numpy().astype(ml_dtypes.bfloat16) if dt == torch.bfloat16 else x.numpy()
            for name, axis, out_spec in REDUCTIONS:
                f = jax.shard_map(
                    lambda v, name=name, axis=axis: getattr(jax.lax, name)(v, axis),
                    mesh=mesh,
                    in_specs=(PartitionSpec(("a", "b")),),
                    out_specs=PartitionSpec(*out_spec),
                )
                r = np.asarray(f(jax.numpy.asarray(a)))
                got = torch.from_numpy(r.astype(np.float32)).bfloat16() if r.dtype == ml_dtypes.bfloat16 else None
                out[str(dt), name] = got if got is not None else torch.from_numpy(r.copy())
    return out


def test_reduction_dtypes_match_jax(run) -> None:
    """psum of bool counts the Trues in int32 (it was a logical or: pmean of bools gave 1/n), pmean of int64
    is float64 (it was float32: 2**40 + 1 rounded), other dtypes keep JAX's; the same under sim and dist."""
    want = _jax_reductions()
    for got in run(_reductions_body, MESH):
        for key, w in want.items():
            g = got[key]
            assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, w.dtype, g.shape, w.shape)
            assert torch.equal(g, w), (key, g, w)


def test_psum_scatter_of_bool_raises() -> None:
    """JAX refuses a bool psum_scatter; funcshard summed it as a logical or. Now a ShardingError with the fix."""
    mesh = fs.make_mesh(MESH, backend="sim")
    f = fs.shard_map(lambda v: fs.psum_scatter(v, "b", tiled=True), mesh=mesh, in_specs=(P(),), out_specs=P("b"))
    with pytest.raises(fs.ShardingError, match=r"psum_scatter: a bool tensor of shape \(8, 4\).*torch.int32"):
        f(torch.ones(8, 4, dtype=torch.bool))


def test_tiled_all_gather_of_a_scalar_raises() -> None:
    """JAX refuses to tile 0-dim values; funcshard raised torch's IndexError from inside. Untiled, they stack."""
    mesh = fs.make_mesh(MESH, backend="sim")
    x = torch.arange(8.0)
    tiled = fs.shard_map(
        lambda v: fs.all_gather(v.sum(), "b", tiled=True), mesh=mesh, in_specs=(P(("a", "b")),), out_specs=P("b")
    )
    with pytest.raises(fs.ShardingError, match=r"all_gather\(tiled=True\): a 0-dim value.*tiled=False"):
        tiled(x)
    stacked = fs.shard_map(
        lambda v: fs.all_gather(v.sum(), "b"), mesh=mesh, in_specs=(P(("a", "b")),), out_specs=P(("a", "b"))
    )  # [] -> [4] on each device: its row of the (a, b) grid
    assert torch.equal(fs.device_get(stacked(x)), x.reshape(2, 1, 4).expand(2, 4, 4).reshape(-1))


_SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0]
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _special_value(dt: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).to(dt)
    special = torch.tensor(_SPECIAL).to(dt)
    pick = torch.randint(0, len(_SPECIAL), (4, 64), generator=g)
    return torch.where(torch.rand(4, 64, generator=g) < 0.4, special[pick], x)


def _special_body(mesh: fs.Mesh) -> dict[tuple[str, str], torch.Tensor]:
    out = {}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for name in ("pmax", "pmin"):
            f = fs.shard_map(
                lambda v, name=name: getattr(fs, name)(v, "b"), mesh=mesh, in_specs=(P("b"),), out_specs=P()
            )
            out[str(dt), name] = fs.device_get(f(_special_value(dt)))[0]
    return out


def _special_ref(x: torch.Tensor, name: str) -> torch.Tensor:
    """torch.amax / amin over the blocks (NaN wins), with IEEE's order of the zeros (-0 < +0)."""
    ref = x.amax(0) if name == "pmax" else x.amin(0)
    pos0 = ((x == 0) & ~x.signbit()).any(0)
    neg0 = ((x == 0) & x.signbit()).any(0)
    zero = torch.where(pos0 if name == "pmax" else ~neg0, 0.0, -0.0).to(x.dtype)
    ref = torch.where(ref == 0, zero, ref)
    return torch.where(x.isnan().any(0), float("nan"), ref).to(x.dtype)


def test_pmax_pmin_nan_and_zeros(run) -> None:
    """pmax / pmin of floats with NaN, infinities, signed zeros and denormals: NaN wins as in torch.amax,
    bit for bit the same under sim and dist. gloo's own float max gave max(1, nan, 1, 2) = 1.0 and
    min(-inf, 1, 1, nan) = 1.0, where sim gave NaN."""
    for got in run(_special_body, {"b": 4}):
        for (dt, name), g in got.items():
            want = _special_ref(_special_value(getattr(torch, dt.split(".")[1])), name)
            assert torch.equal(g.view(_BITS[g.element_size()]), want.view(_BITS[want.element_size()])), (dt, name)


def _ties_body(mesh: fs.Mesh) -> dict[str, torch.Tensor]:
    """pmax / pmin over a tuple out of mesh order, with ties between devices: value and gradient."""
    x = torch.tensor([[1.0, 3, 3, 2], [3, 1, 2, 3]], dtype=torch.float64).repeat(4, 1)
    ct = torch.linspace(-1, 2, 4, dtype=torch.float64).reshape(1, 4)
    out = {}
    for name in ("pmax", "pmin"):
        f = fs.shard_map(
            lambda v, name=name: getattr(fs, name)(v, ("b", "a")),
            mesh=mesh,
            in_specs=(P(("a", "b")),),
            out_specs=P(),
        )
        xr = x.clone().requires_grad_(True)
        y = fs.device_get(f(xr))
        (g,) = torch.autograd.grad((y * ct).sum(), xr)
        out[name] = torch.cat([y.detach(), g])
    return out


def test_pmax_pmin_ties_gradient(run) -> None:
    """The cotangent is split evenly between the devices holding the extreme, as torch.amax's backward."""
    x = torch.tensor([[1.0, 3, 3, 2], [3, 1, 2, 3]], dtype=torch.float64).repeat(4, 1)
    ct = torch.linspace(-1, 2, 4, dtype=torch.float64).reshape(1, 4)
    results = run(_ties_body, MESH)
    for rank, got in enumerate(results):
        # under dist a process's gradient of the full input holds its own block only: row `rank` of P(("a", "b"))
        rows = slice(None) if len(results) == 1 else slice(rank, rank + 1)
        for name, red in (("pmax", torch.amax), ("pmin", torch.amin)):
            xr = x.clone().requires_grad_(True)
            y = red(xr, 0, keepdim=True)
            (g,) = torch.autograd.grad((y * ct).sum(), xr)
            torch.testing.assert_close(got[name][:1], y.detach(), rtol=0, atol=0)
            torch.testing.assert_close(got[name][1:][rows], g[rows], rtol=0, atol=1e-15)


def _outside_body(mesh: fs.Mesh) -> dict[str, object]:
    """torch.func transforms around a shard_map call (from outside): a ShardingError naming the alternatives;
    forward-mode torch.autograd.forward_ad from outside: the tangent of the global function."""
    import torch.autograd.forward_ad as fwad

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64, generator=g)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g)
    f = fs.shard_map(
        lambda x, w: fs.psum(torch.tanh(x @ w).sum(0), ("a", "b")),  # [8/n, 4] @ [4, 4] -> [4], summed
        mesh=mesh,
        in_specs=(P(("a", "b")), P()),
        out_specs=P(),
    )

    def loss(w: torch.Tensor) -> torch.Tensor:
        return fs.device_get(f(x, w)).pow(2).sum()

    out: dict[str, object] = {}
    for name, call in (
        ("grad", lambda: torch.func.grad(loss)(w)),
        ("jvp", lambda: torch.func.jvp(loss, (w,), (torch.ones_like(w),))),  # sim gave a zero tangent
        ("vmap", lambda: torch.func.vmap(loss)(torch.stack([w, 2 * w]))),
    ):
        try:
            call()
            out[name] = "no error"
        except fs.ShardingError as e:
            out[name] = str(e)
    with fwad.dual_level():
        out["tangent"] = fwad.unpack_dual(loss(fwad.make_dual(w, torch.ones_like(w)))).tangent
    wr = w.clone().requires_grad_(True)
    try:  # a second derivative from outside: dist gives it; sim raises (its devices' graphs are thread-local)
        (gw,) = torch.autograd.grad(loss(wr), wr, create_graph=True)
        out["hvp"] = torch.autograd.grad(gw.sum(), wr)[0]
    except fs.ShardingError as e:
        out["hvp"] = str(e)
    out["backend"] = mesh.backend
    return out


def test_torch_func_around_shard_map_raises(run) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64, generator=g)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g)
    ref = lambda w: torch.tanh(x @ w).sum(0).pow(2).sum()  # noqa: E731
    _, want = torch.func.jvp(ref, (w,), (torch.ones_like(w),))
    hvp = torch.func.grad(lambda w: torch.func.grad(ref)(w).sum())(w)
    for got in run(_outside_body, {"a": 2, "b": 2}):
        for name in ("grad", "jvp", "vmap"):
            assert "inside a torch.func transform" in got[name] and "torch.autograd" in got[name], got[name]
        torch.testing.assert_close(got["tangent"], want, rtol=1e-12, atol=1e-12)
        if got["backend"] == "sim":
            assert "second derivative" in got["hvp"] and 'backend="dist"' in got["hvp"], got["hvp"]
        else:
            torch.testing.assert_close(got["hvp"], hvp, rtol=1e-12, atol=1e-12)


BYTE_DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]


def _moves_body(mesh: fs.Mesh) -> dict[str, bool]:
    """all_gather (tiled and not), all_to_all and ppermute of dtypes gloo's gather / all-to-all refuse (moved as
    bytes under dist), bit for bit against the same moves of the values as int64 / float32."""
    out = {}
    for dt in BYTE_DTYPES:
        base = torch.arange(24).reshape(4, 6) * 3
        x = base.to(torch.float32).to(dt) if dt.is_floating_point else base.to(dt)
        wide = torch.float32 if dt.is_floating_point else torch.int64
        ops = {
            "all_gather": (lambda v: fs.all_gather(v, "dp"), P(), P("dp")),
            "all_gather tiled": (lambda v: fs.all_gather(v, "dp", dim=1, tiled=True), P(None, None), P(None, "dp")),
            "all_to_all": (lambda v: fs.all_to_all(v, "dp", 1, 0), P(None, "dp"), P("dp")),
            "ppermute": (lambda v: fs.ppermute(v, "dp", [(0, 1), (1, 0)]), P("dp"), P("dp")),
        }
        for name, (fn, out_spec, in_spec) in ops.items():
            f = fs.shard_map(fn, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec, check_vma=False)
            got = fs.device_get(f(x))
            want = fs.device_get(f(x.to(wide)))
            out[f"{dt} {name}"] = got.dtype == dt and torch.equal(got.to(wide), want)
    return out


def test_moves_of_dtypes_gloo_refuses(run) -> None:
    """int16 / uint16 / uint32 / uint64 / float8 through all_gather, all_to_all and ppermute under sim and dist
    (gloo's gather and all-to-all raised 'Invalid scalar type' for them)."""
    for r in run(_moves_body, {"dp": 2}):
        assert all(r.values()), [k for k, ok in r.items() if not ok]
