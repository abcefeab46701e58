"""Collectives over blocks of different sizes (``torch.tensor_split``'s), forward and backward, against a
single-device reference built from full tensors, under ``sim`` and ``dist`` with the same body.

Forward: the assembled output equals the reference. Backward: the gradient of ``sum(output * r)`` with respect to
the full input, taken from outside shard_map, and the gradient of the global sum taken inside it on the local
shards, equal the reference's (the gradients are those of the global function).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.extend import split_invariant
from funcshard.ops import sequence_gather, sequence_scatter


def _split(x: torch.Tensor, n: int, dim: int = 0) -> list[torch.Tensor]:
    return list(torch.tensor_split(x, n, dim))


def _sum_of_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    return sum(x.chunk(n))  # equal blocks of the (even) input, summed: what psum_scatter reduces


@dataclass(frozen=True)
class Case:
    mesh: dict[str, int]
    shape: tuple[int, ...]
    in_spec: P
    out_spec: P
    local: Callable[[torch.Tensor], torch.Tensor]
    ref: Callable[[torch.Tensor], torch.Tensor]


CASES: dict[str, Case] = {
    # all_gather (tiled) of tensor_split blocks: the whole dim on every device
    "all_gather_dim0": Case(
        {"tp": 4},
        (10, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=0, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_dim1": Case(
        {"tp": 4},
        (3, 10),
        P(None, "tp"),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=1, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_fewer_rows_than_devices": Case(
        {"tp": 4}, (3, 2), P("tp"), P("tp"), lambda x: fs.all_gather(x, "tp", tiled=True), lambda x: x.repeat(4, 1)
    ),
    "all_gather_two_axes": Case(
        {"dp": 2, "tp": 2},
        (7, 3),
        P(("dp", "tp")),
        P(("dp", "tp")),
        lambda x: fs.all_gather(x, ("dp", "tp"), tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_invariant": Case(
        {"tp": 4}, (10, 3), P("tp"), P(), lambda x: fs.lax.all_gather_invariant(x, "tp", tiled=True), lambda x: x
    ),
    "all_gather_one_axis_of_two": Case(
        {"dp": 2, "tp": 4},
        (5, 10),
        P("dp", "tp"),
        P("dp", None),
        lambda x: fs.lax.all_gather_invariant(x, "tp", dim=1, tiled=True),
        lambda x: x,
    ),
    # psum_scatter (tiled) of a dim the axis does not divide: tensor_split's blocks of the sum
    "psum_scatter": Case(
        {"tp": 4},
        (40, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=0, tiled=True),
        lambda x: _sum_of_blocks(x, 4),
    ),
    "psum_scatter_dim1_fewer": Case(
        {"tp": 4},
        (8, 3),
        P("tp"),
        P(None, "tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=1, tiled=True),
        lambda x: _sum_of_blocks(x, 4),
    ),
    "psum_scatter_two_axes": Case(
        {"dp": 2, "tp": 2},
        (20, 3),
        P(("dp", "tp")),
        P(("dp", "tp")),
        lambda x: fs.psum_scatter(x, ("dp", "tp"), tiled=True),
        lambda x: _sum_of_blocks(x, 4),
    ),
    # the two transposes in a row: scatter a sum unevenly, gather it back
    "psum_scatter_then_all_gather": Case(
        {"tp": 4},
        (28, 2),
        P("tp"),
        P(),
        lambda x: fs.lax.all_gather_invariant(fs.psum_scatter(x, "tp", tiled=True), "tp", tiled=True),
        lambda x: _sum_of_blocks(x, 4),
    ),
    # split_invariant (all_gather_invariant's transpose) into tensor_split blocks, and back
    "split_invariant": Case(
        {"tp": 4},
        (10, 3),
        P(),
        P("tp"),
        lambda x: split_invariant(x, "tp", dim=0),
        lambda x: x,
    ),
    "sequence_scatter_then_gather": Case(
        {"tp": 4},
        (2, 7, 3),
        P(),
        P("tp"),  # the gathered value varies over tp (all_gather's): one copy per device
        lambda x: sequence_gather(sequence_scatter(x * 2, "tp", 1), "tp", 1),  # [b, 7, d] -> [b, 7/4, d] -> back
        lambda x: (x * 2).repeat(4, 1, 1),
    ),
    # all_to_all of tensor_split chunks: blocks that differ along split_dim and concat_dim
    "all_to_all_rows_to_cols": Case(
        {"tp": 4},
        (10, 7),
        P("tp"),
        P(None, "tp"),
        lambda x: fs.all_to_all(x, "tp", 1, 0, tiled=True),  # [10/4, 7] -> [10, 7/4]
        lambda x: x,
    ),
    "all_to_all_cols_to_rows": Case(
        {"dp": 2, "tp": 2},
        (5, 9),
        P(None, ("dp", "tp")),
        P(("dp", "tp")),
        lambda x: fs.all_to_all(x, ("dp", "tp"), 0, 1, tiled=True),  # [5, 9/4] -> [5/4, 9]
        lambda x: x,
    ),
    "all_to_all_same_dim": Case(
        {"tp": 4},
        (10, 2),
        P("tp"),
        P(),  # blocks of 4, 4, 2, 0 rows (not tensor_split's), gathered whole
        lambda x: fs.lax.all_gather_invariant(fs.all_to_all(x, "tp", 0, 0, tiled=True), "tp", tiled=True),
        lambda x: torch.cat([torch.cat([torch.tensor_split(b, 4)[j] for b in _split(x, 4)]) for j in range(4)]),
    ),
    # ppermute of blocks of different shapes: each device receives its sender's block (zeros of its own shape
    # where nothing arrives)
    "ppermute_partial": Case(
        {"tp": 4},
        (10, 3),
        P("tp"),
        P("tp"),
        lambda x: fs.ppermute(x, "tp", [(0, 1), (2, 3)]),  # blocks of 3, 3, 2, 2 rows stay so
        lambda x: torch.cat([torch.zeros(3, 3), _split(x, 4)[0], torch.zeros(2, 3), _split(x, 4)[2]]),
    ),
    "ppermute_ring": Case(
        {"tp": 4},
        (10, 3),
        P("tp"),
        P(),  # blocks of 2, 3, 3, 2 rows (not tensor_split's), gathered whole
        lambda x: fs.lax.all_gather_invariant(
            fs.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]), "tp", tiled=True
        ),
        lambda x: torch.cat([_split(x, 4)[(j - 1) % 4] for j in range(4)]),
    ),
}


def _held(mesh: fs.Mesh, spec: P, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The block this process holds under dist (None under sim: it holds everything), by torch.tensor_split."""
    if not mesh.is_multiprocess:
        return None
    at = mesh.local_device_coords()[0]
    out = []
    for size, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        i, n = 0, 1
        for a in axes:
            i, n = i * mesh.shape[a] + at[a], n * mesh.shape[a]
        starts = [0]
        for b in torch.tensor_split(torch.empty(size), n):
            starts.append(starts[-1] + b.shape[0])
        out.append(slice(starts[i], starts[i + 1]))
    return tuple(out)


def _case_body(mesh: fs.Mesh, name: str, check_vma: bool) -> str:
    case = CASES[name]
    x = torch.randn(case.shape, generator=torch.Generator().manual_seed(len(name)), dtype=torch.float64)
    ref = case.ref(x)
    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    f = fs.shard_map(case.local, mesh=mesh, in_specs=(case.in_spec,), out_specs=case.out_spec, check_vma=check_vma)
    out = f(x)
    assert out.shape == tuple(ref.shape), (out.shape, ref.shape)
    torch.testing.assert_close(fs.device_get(out), ref, rtol=1e-12, atol=1e-12)
    # backward from outside shard_map
    xg = x.clone().requires_grad_(True)
    (fs.device_get(f(xg)) * r).sum().backward()
    xr = x.clone().requires_grad_(True)
    (case.ref(xr) * r).sum().backward()
    held = _held(mesh, case.in_spec, case.shape)
    torch.testing.assert_close(
        xg.grad if held is None else xg.grad[held], xr.grad if held is None else xr.grad[held], rtol=1e-12, atol=1e-12
    )
    out_axes = case.out_spec.axes

    def inner(xl: torch.Tensor, rl: torch.Tensor) -> torch.Tensor:  # the global loss's gradient, on the shards
        xl = xl.detach().requires_grad_(True)
        loss = (case.local(xl) * rl).sum()
        if out_axes:
            loss = fs.psum(loss, out_axes)
        (g,) = torch.autograd.grad(loss, xl)
        return g

    g = fs.shard_map(inner, mesh=mesh, in_specs=(case.in_spec, case.out_spec), out_specs=case.in_spec)(x, r)
    torch.testing.assert_close(fs.device_get(g), xr.grad, rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_uneven_collective_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _case_body, CASES[name].mesh, name, check_vma) == ["ok"]


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(CASES))
def test_uneven_collective_dist(name: str) -> None:
    from _dist_pool import run_body

    results = run_body("dist", _case_body, CASES[name].mesh, name, True)
    assert results == ["ok"] * len(results)


def test_even_calls_keep_their_comm_counts() -> None:
    """An even call learns no sizes: one all_gather, as before uneven dims existed."""
    mesh = fs.make_mesh({"tp": 4}, backend="sim")
    f = fs.shard_map(lambda x: fs.all_gather(x, "tp", tiled=True), mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    with fs.comm_stats() as stats:
        f(torch.randn(8, 2))
    assert stats.calls() == stats.calls("all_gather", "tp") == 1


def test_abstract_uneven_psum_scatter_shapes() -> None:
    mesh = fs.make_mesh({"tp": 4}, backend="abstract")
    f = fs.shard_map(lambda x: fs.psum_scatter(x, "tp", tiled=True), mesh=mesh, in_specs=(P(),), out_specs=P("tp"))
    y = f(fs.ShapeDtype((10, 3), torch.float32))
    assert y.shape == (10, 3)
    assert [tuple(y.shards[(i,)].shape) for i in range(4)] == [(3, 3), (3, 3), (2, 3), (2, 3)]
