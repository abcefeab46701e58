"""Every collective, forward and backward, against a single-device reference built from full tensors.

Each case runs under ``sim`` and under ``dist`` (gloo workers) with the same body, with ``check_vma`` on
and off. Forward: the assembled output equals the reference. Backward: the gradient of
``sum(output * r)`` with respect to the full input (through shard_map from outside) equals the
reference's; a second check takes the gradient inside shard_map with ``torch.autograd.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from _blocks import shard_slices

import funcshard as fs
from funcshard import P


def _blocks(x: torch.Tensor, n: int, dim: int = 0) -> list[torch.Tensor]:
    return list(x.chunk(n, dim))


@dataclass(frozen=True)
class Case:
    mesh: dict[str, int]
    shape: tuple[int, ...]
    in_spec: P
    out_spec: P
    local: Callable[[torch.Tensor], torch.Tensor]
    ref: Callable[[torch.Tensor], torch.Tensor]


def _roll_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    b = _blocks(x, n)
    return torch.cat([b[-1], *b[:-1]])


def _partial_perm_ref(x: torch.Tensor, n: int) -> torch.Tensor:
    b = _blocks(x, n)
    out = [torch.zeros_like(b[0]) for _ in range(n)]
    out[1] = b[0]
    out[3] = b[2]
    return torch.cat(out)


CASES: dict[str, Case] = {
    # --- one axis of a 1-D mesh
    "psum": Case({"tp": 4}, (8, 3), P("tp"), P(), lambda x: fs.psum(x, "tp"), lambda x: sum(_blocks(x, 4))),
    "pmean": Case({"tp": 4}, (8, 3), P("tp"), P(), lambda x: fs.pmean(x, "tp"), lambda x: sum(_blocks(x, 4)) / 4),
    "pmax": Case(
        {"tp": 4}, (8, 3), P("tp"), P(), lambda x: fs.pmax(x, "tp"), lambda x: torch.stack(_blocks(x, 4)).amax(0)
    ),
    "pmin": Case(
        {"tp": 4}, (8, 3), P("tp"), P(), lambda x: fs.pmin(x, "tp"), lambda x: torch.stack(_blocks(x, 4)).amin(0)
    ),
    "all_gather_tiled_dim0": Case(
        {"tp": 4},
        (8, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=0, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_tiled_dim1": Case(
        {"tp": 4},
        (3, 8),
        P(None, "tp"),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=1, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_stacked_dim1": Case(
        {"tp": 4},
        (8, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=1),
        lambda x: torch.stack(_blocks(x, 4), dim=1).repeat(4, 1, 1),
    ),
    "psum_scatter_tiled": Case(
        {"tp": 4},
        (32, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=0, tiled=True),
        lambda x: sum(_blocks(x, 4)),
    ),
    "psum_scatter_tiled_dim1": Case(
        {"tp": 2},
        (3, 8),
        P(None, "tp"),
        P(None, "tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=1, tiled=True),
        lambda x: sum(_blocks(x, 2, 1)),
    ),
    "psum_scatter_untiled": Case(
        {"tp": 4},
        (16, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=0, tiled=False),
        lambda x: sum(_blocks(x, 4)).reshape(-1),
    ),
    "all_to_all_rows_to_cols": Case(
        {"tp": 4}, (8, 8), P("tp"), P(None, "tp"), lambda x: fs.all_to_all(x, "tp", 1, 0), lambda x: x
    ),
    "all_to_all_cols_to_rows": Case(
        {"tp": 2}, (4, 6), P(None, "tp"), P("tp"), lambda x: fs.all_to_all(x, "tp", 0, 1), lambda x: x
    ),
    "all_to_all_untiled": Case(
        {"tp": 2},
        (2, 4, 3),
        P(None, "tp"),
        P("tp"),
        lambda x: fs.all_to_all(x, "tp", 0, 0, tiled=False),
        lambda x: x.reshape(4, 2, 3),
    ),
    "ppermute_ring": Case(
        {"tp": 4},
        (8, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]),
        lambda x: _roll_blocks(x, 4),
    ),
    "ppermute_partial": Case(
        {"tp": 4},
        (8, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.ppermute(x, "tp", [(0, 1), (2, 3)]),
        lambda x: _partial_perm_ref(x, 4),
    ),
    "pvary_then_scale": Case(
        {"tp": 4},
        (2, 3),
        P(),
        P("tp"),
        lambda x: fs.pvary(x, "tp") * (fs.axis_index("tp") + 1),
        lambda x: torch.cat([x * (i + 1) for i in range(4)]),
    ),
    "axis_index_size": Case(
        {"tp": 2},
        (4, 3),
        P("tp"),
        P("tp"),
        lambda x: x * fs.axis_size("tp") + fs.axis_index("tp"),
        lambda x: x * 2 + torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]),
    ),
    # --- 2-D meshes: one axis, tuples of axes, tuples in non-mesh order
    "psum_one_axis_of_2d": Case(
        {"dp": 2, "tp": 2},
        (4, 6),
        P("dp", "tp"),
        P("dp"),
        lambda x: fs.psum(x, "tp"),
        lambda x: sum(_blocks(x, 2, 1)),
    ),
    "psum_tuple": Case(
        {"dp": 2, "tp": 2},
        (8, 3),
        P(("dp", "tp")),
        P(),
        lambda x: fs.psum(x, ("dp", "tp")),
        lambda x: sum(_blocks(x, 4)),
    ),
    "pmax_tuple": Case(
        {"dp": 2, "tp": 2},
        (8, 3),
        P(("tp", "dp")),
        P(),
        lambda x: fs.pmax(x, ("tp", "dp")),
        lambda x: torch.stack(_blocks(x, 4)).amax(0),
    ),
    "all_gather_tuple_reversed": Case(
        {"dp": 2, "tp": 2},
        (8, 3),
        P(("tp", "dp")),
        P(("dp", "tp")),
        lambda x: fs.all_gather(x, ("tp", "dp"), dim=0, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "psum_scatter_tuple": Case(
        {"dp": 2, "tp": 2},
        (16, 3),
        P(("dp", "tp")),
        P(("dp", "tp")),
        lambda x: fs.psum_scatter(x, ("dp", "tp"), dim=0, tiled=True),
        lambda x: sum(_blocks(x, 4)),
    ),
    "psum_scatter_tuple_reversed": Case(
        {"dp": 2, "tp": 2},
        (16, 3),
        P(("dp", "tp")),
        P(("tp", "dp")),
        lambda x: fs.psum_scatter(x, ("tp", "dp"), dim=0, tiled=True),
        lambda x: sum(_blocks(x, 4)),
    ),
    "all_to_all_2d": Case(
        {"dp": 2, "tp": 2}, (8, 4), P("dp", "tp"), P(("dp", "tp")), lambda x: fs.all_to_all(x, "tp", 0, 1), lambda x: x
    ),
    "all_to_all_tuple": Case(
        {"dp": 2, "tp": 2},
        (8, 8),
        P(("dp", "tp")),
        P(None, ("dp", "tp")),
        lambda x: fs.all_to_all(x, ("dp", "tp"), 1, 0),
        lambda x: x,
    ),
    "ppermute_2d": Case(
        {"dp": 2, "tp": 2},
        (4, 6),
        P("dp", "tp"),
        P("dp", "tp"),
        lambda x: fs.ppermute(x, "dp", [(0, 1), (1, 0)]),
        lambda x: torch.cat([x[2:], x[:2]]),
    ),
}

SIM_ONLY_MESH_4 = {k for k, c in CASES.items() if len(c.mesh) == 1 and c.mesh.get("tp") == 4}


def _global_input(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(case.shape) % 1000)
    return torch.randn(case.shape, generator=g, dtype=torch.float64)


def _held(mesh: fs.Mesh, spec: P, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The block this process holds under dist (None under sim: it holds everything)."""
    if mesh.backend == "sim":
        return None
    import torch.distributed as dist

    return shard_slices(shape, spec, mesh.shape, mesh.coords_of(dist.get_rank()))


def _case_body(mesh: fs.Mesh, name: str, check_vma: bool) -> str:
    case = CASES[name]
    x = _global_input(case)
    ref = case.ref(x)
    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    f = fs.shard_map(case.local, mesh=mesh, in_specs=(case.in_spec,), out_specs=case.out_spec, check_vma=check_vma)
    # forward
    out = fs.device_get(f(x))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # backward from outside shard_map
    xg = x.clone().requires_grad_(True)
    (fs.device_get(f(xg)) * r).sum().backward()
    xr = x.clone().requires_grad_(True)
    (case.ref(xr) * r).sum().backward()
    held = _held(mesh, case.in_spec, case.shape)
    want = xr.grad if held is None else xr.grad[held]
    got = xg.grad if held is None else xg.grad[held]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    # backward inside shard_map: grad of the global sum(out * r) w.r.t. the local shard
    out_axes = case.out_spec.axes

    def inner(xl: torch.Tensor, rl: torch.Tensor) -> torch.Tensor:
        xl = xl.detach().requires_grad_(True)
        y = case.local(xl)
        loss = (y * rl).sum()
        if out_axes:
            loss = fs.psum(loss, out_axes)
        # the output's replicated axes: every copy is the same value, count it once
        (g,) = torch.autograd.grad(loss, xl)
        return g

    g = fs.shard_map(inner, mesh=mesh, in_specs=(case.in_spec, case.out_spec), out_specs=case.in_spec, check_vma=True)(
        x, r
    )
    torch.testing.assert_close(fs.device_get(g), xr.grad, rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_collective_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _case_body, CASES[name].mesh, name, check_vma) == ["ok"]


DIST_CASES = sorted(CASES)


@pytest.mark.dist
@pytest.mark.parametrize("name", DIST_CASES)
def test_collective_dist(name: str) -> None:
    from _dist_pool import run_body

    results = run_body("dist", _case_body, CASES[name].mesh, name, True)
    assert results == ["ok"] * len(results)


GRADCHECK = [
    "psum",
    "pmax",
    "all_gather_stacked_dim1",
    "psum_scatter_tuple_reversed",
    "all_to_all_tuple",
    "ppermute_partial",
    "pvary_then_scale",
]


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck_sim(name: str) -> None:
    case = CASES[name]
    mesh = fs.make_mesh(case.mesh, backend="sim")
    f = fs.shard_map(case.local, mesh=mesh, in_specs=(case.in_spec,), out_specs=case.out_spec)
    x = _global_input(case).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: fs.device_get(f(v)), (x,))


def _transforms_body(mesh: fs.Mesh) -> str:
    """The same gradient through torch.func.grad, torch.func.vjp, autograd.grad and .backward()."""
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))

    manual = []  # check_vma=False: the replicated weight meets the dp-sharded batch, so pvary it by hand

    def loss_local(w, x):
        if manual:
            w = fs.pvary(w, "dp")
        h = fs.all_gather(w, "tp", dim=1, tiled=True)  # [6, 4/tp] -> [6, 4]
        y = torch.tanh(x @ h)  # [8/dp, 6] @ [6, 4] -> [8/dp, 4]
        return fs.pmean(fs.pmean(y.pow(2).mean(), "dp"), "tp")

    wr = w.clone().requires_grad_(True)
    torch.tanh(x @ wr).pow(2).mean().backward()
    specs = (P(None, "tp"), P("dp"))

    def by_func_grad(w, x):
        return torch.func.grad(loss_local)(w, x)

    def by_vjp(w, x):
        _, vjp = torch.func.vjp(lambda w: loss_local(w, x), w)
        return vjp(torch.ones(()))[0]

    def by_autograd(w, x):
        w = w.detach().requires_grad_(True)
        return torch.autograd.grad(loss_local(w, x), w)[0]

    def by_backward(w, x):
        w = w.detach().requires_grad_(True)
        loss_local(w, x).backward()
        return w.grad

    for fn in (by_func_grad, by_vjp, by_autograd, by_backward):
        for check_vma in (True, False):
            manual[:] = [] if check_vma else [True]
            g = fs.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"), check_vma=check_vma)(w, x)
            torch.testing.assert_close(
                fs.device_get(g), wr.grad, rtol=1e-5, atol=1e-6, msg=f"{fn.__name__} {check_vma}"
            )
    return "ok"


def test_grad_transforms(run) -> None:
    assert set(run(_transforms_body, {"dp": 2, "tp": 2})) == {"ok"}
