"""``shard_map(check_vma=False)`` audits its first call of each call signature under ``"dist"`` as ``"sim"`` audits
every call: a program whose gradient would be wrong without the varying-axes tracking (a ``pvary`` left out)
raises a ``ShardingError`` naming the axis instead of returning a per-device gradient; later calls run
unaudited (no vma mode: the cost of ``check_vma=False`` stays nil). ``FUNCSHARD_AUDIT=0`` turns the first-call
audit off, ``FUNCSHARD_AUDIT=1`` audits every call."""

from __future__ import annotations

import os

import torch

import funcshard as fs
from funcshard import P


def _grad_body(mesh: fs.Mesh, with_pvary: bool, audit: str | None) -> list[str]:
    """Three calls of a dp gradient step written with or without its pvary; what each call gave."""
    n = mesh.shape["dp"]
    w, x = torch.arange(3.0), torch.arange(4.0 * n * 3).reshape(4 * n, 3) / 10

    def step(w, x):
        def loss(w):
            return fs.psum((x @ (fs.pvary(w, "dp") if with_pvary else w)).sum(), "dp")

        return torch.func.grad(loss)(w)

    saved = os.environ.get("FUNCSHARD_AUDIT")
    if audit is None:
        os.environ.pop("FUNCSHARD_AUDIT", None)
    else:
        os.environ["FUNCSHARD_AUDIT"] = audit
    f = fs.shard_map(step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(), check_vma=False)
    seen = []
    try:
        for _ in range(3):
            try:
                g = fs.device_get(f(w, x))
            except fs.ShardingError as e:
                seen.append("raised 'dp'" if "'dp'" in str(e) else f"raised {e}")
                continue
            seen.append("full" if torch.allclose(g, x.sum(0)) else "partial")
    finally:
        if saved is None:
            os.environ.pop("FUNCSHARD_AUDIT", None)
        else:
            os.environ["FUNCSHARD_AUDIT"] = saved
    return seen


def test_missing_pvary_raises_on_the_first_call(run, backend: str) -> None:
    """Without its pvary the step raises on its first call under both backends (sim on every call)."""
    for seen in run(_grad_body, {"dp": 2}, False, None):
        assert seen[0] == "raised 'dp'", seen
        # sim audits every call; dist audited the signature once, and the call that raised does not count
        assert seen[1:] == (["raised 'dp'"] * 2 if backend == "sim" else ["raised 'dp'", "raised 'dp'"]), seen


def test_a_correct_program_passes_the_audit(run) -> None:
    for seen in run(_grad_body, {"dp": 2}, True, None):
        assert seen == ["full"] * 3, seen


def test_audit_off_and_on_under_dist(run, backend: str) -> None:
    """``FUNCSHARD_AUDIT=0``: dist runs the program as written (the per-device gradient, as JAX's
    ``check_vma=False``); ``=1``: every call audited."""
    off = run(_grad_body, {"dp": 2}, False, "0")
    on = run(_grad_body, {"dp": 2}, False, "1")
    for seen in on:
        assert seen == ["raised 'dp'"] * 3, seen
    for seen in off:
        assert seen == (["raised 'dp'"] * 3 if backend == "sim" else ["partial"] * 3), seen


def _odd_dtypes_body(mesh: fs.Mesh) -> dict[str, str]:
    """Replicated outputs of dtypes without torch.equal (float8, complex32) under check_vma=False: equal ones pass
    the replicas check, ones that differ over dp are refused with the check's ShardingError (not a torch error)."""
    out = {}
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32):
        x = torch.arange(4.0).to(torch.complex64 if dt == torch.complex32 else torch.float32).to(dt)
        same = fs.shard_map(lambda v: v, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=False)
        out[f"{dt} same"] = "ok" if fs.device_get(same(x)).view(torch.uint8).equal(x.view(torch.uint8)) else "bad"
        differ = fs.shard_map(
            lambda v, dt=dt: (
                v.to(torch.complex64 if dt == torch.complex32 else torch.float32) + fs.axis_index("dp")
            ).to(dt),
            mesh=mesh,
            in_specs=(P(),),
            out_specs=P(),
            check_vma=False,
        )
        try:
            differ(x)
            out[f"{dt} differ"] = "no error"
        except fs.ShardingError as e:
            out[f"{dt} differ"] = "ok" if "differ" in str(e) or "same on every device" in str(e) else str(e)
    return out


def test_replicas_check_takes_float8_and_complex32(run) -> None:
    for r in run(_odd_dtypes_body, {"dp": 2}):
        assert all(v == "ok" for v in r.values()), r
