"""Zero tangents and cotangents (torch's ZeroTensors) through every collective, under sim and dist.

torch uses a ``ZeroTensor`` (``torch._efficientzerotensor``: zeros with no memory behind them, immutable) where
it knows a tangent or cotangent is zero. One such place: the tangent rule of ``y / 2`` is ``t / 2 - z * y / 2``
with ``z`` the ZeroTensor tangent of the constant, so the gradient of a ``torch.func.jvp``'s tangent reaches the
primal ``y``'s own nodes with a ZeroTensor cotangent (their only one where the primal is unused), and their
transposes run the collectives on ZeroTensors (``pvary``'s backward a psum, ``all_gather``'s a psum_scatter, ...).
Every collective must take one (sum it, send it) without error and give the right numbers.

The fuzzer's program that found it (``tests/test_fuzz.py::test_vma[transform]`` with hypothesis 6.170.27)
is :func:`test_fuzz_program_jvp_of_pmean_then_grad`; the rest runs each collective four ways:

- ``jvp_grad``: ``sin`` of the tangent of ``jvp(v -> collective(sin(v)) / 2)`` (its primal unused), and its
  gradient taken from outside shard_map, as the fuzzer does: ZeroTensor cotangents reach the backward's collectives;
- ``jvp_zero``: the same ``jvp`` with a ZeroTensor tangent (its tangent is zeros), plus its primal;
- ``vjp_zero``: ``vjp`` of ``v -> collective(sin(v))`` pulled back from a ZeroTensor cotangent (zeros);
- ``zero_operand``: the collective applied to a ZeroTensor itself, added to it applied to ``x``.

Each is compared with an unsharded single-device reference on the full tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import funcshard as fs
from funcshard import P

MESH = {"a": 4, "b": 2}  # the fuzzer's mesh: a psum over 'a' adds four ZeroTensors (two add up without error)
N = MESH["a"]
RING = [(i, (i + 1) % N) for i in range(N)]


def _zeros(like: torch.Tensor) -> torch.Tensor:
    """A ZeroTensor of ``like``'s shape and dtype (what torch's autograd makes for a known-zero tangent)."""
    return torch._efficientzerotensor(like.shape, dtype=like.dtype)


def _held(mesh: fs.Mesh, spec: P, shape: tuple[int, ...]) -> torch.Tensor:
    """The flat indices of the block of a global value of ``shape`` and ``spec`` this process holds (under sim: all
    of it)."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    if mesh.backend == "sim":
        return index.flatten()
    return fs.device_put(index, mesh, spec).local.flatten()


# --------------------------------------------------------------------------------------------------------
# The fuzzer's program
# --------------------------------------------------------------------------------------------------------


def _fuzz_body(v0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def f4(v1: torch.Tensor) -> torch.Tensor:
        v2 = torch.sin(v1)  # v2: () invariant
        return fs.pmean(v2, "a")  # v3: () invariant (check_vma pvary's v2 over 'a' first)

    # v4 unused: the gradient of v5 reaches v3's nodes through pmean's ``/ n`` as a ZeroTensor cotangent
    _v4, v5 = torch.func.jvp(f4, (v0,), (torch.cos(v0),))
    return torch.sin(v5), v0


def _fuzz_program(mesh: fs.Mesh) -> str:
    gen = torch.Generator().manual_seed(0)  # the program's data (seed 0), as tests/_fuzz.py's make_data draws it
    x = torch.randn((), generator=gen, dtype=torch.float64)
    cts = [torch.randn((), generator=gen, dtype=torch.float64) for _ in range(2)]
    f = fs.shard_map(_fuzz_body, mesh=mesh, in_specs=(P(),), out_specs=(P(), P()), check_vma=True)
    xg = x.clone().requires_grad_(True)
    outs = [fs.device_get(o) for o in f(xg)]
    sum(o * c for o, c in zip(outs, cts, strict=True)).backward()

    xr = x.clone().requires_grad_(True)  # the reference: one device, pmean of an invariant value is itself
    _, t = torch.func.jvp(torch.sin, (xr,), (torch.cos(xr),))
    want = [torch.sin(t), xr]
    sum(o * c for o, c in zip(want, cts, strict=True)).backward()
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-12, atol=1e-12)
    return "ok"


def test_fuzz_program_jvp_of_pmean_then_grad(run) -> None:
    assert set(run(_fuzz_program, MESH)) == {"ok"}


# --------------------------------------------------------------------------------------------------------
# Each collective
# --------------------------------------------------------------------------------------------------------


Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]  # the global input's
    in_spec: P
    out_spec: P
    local: Fn  # the collective, on a device's block
    ref: Fn  # the same on the full tensor, on one device


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.chunk(N))


# ragged_all_to_all's counts: RAGGED[i][j] rows from device i to device j (4 rows each way on every device, so the
# blocks keep their shape), some of them none
RAGGED = [[2, 0, 1, 1], [0, 2, 1, 1], [1, 1, 0, 2], [1, 1, 2, 0]]
# the rows of the full input that land, in order, in the full output
_RAGGED_ROWS = [4 * j + sum(RAGGED[j][:i]) + k for i in range(N) for j in range(N) for k in range(RAGGED[j][i])]


def _ragged(x: torch.Tensor) -> torch.Tensor:
    i = int(fs.axis_index("a"))
    return fs.lax.ragged_all_to_all(x, RAGGED[i], [RAGGED[j][i] for j in range(N)], "a")  # [4, 3] -> [4, 3]


# The reductions and pvary take an invariant operand (P()): check_vma makes it varying with a pvary first, whose
# transpose (a psum) is what the ZeroTensor cotangents reach. The others take a block of 'a' (their transposes
# are collectives themselves). No spec names 'b': every value is replicated over it.
CASES: dict[str, Case] = {
    "psum": Case((4, 3), P(), P(), lambda x: fs.psum(x, "a"), lambda x: N * x),
    "pmean": Case((4, 3), P(), P(), lambda x: fs.pmean(x, "a"), lambda x: x),
    "pmax": Case((4, 3), P(), P(), lambda x: fs.pmax(x, "a"), lambda x: torch.stack([x] * N).amax(0)),
    "pmin": Case((4, 3), P(), P(), lambda x: fs.pmin(x, "a"), lambda x: torch.stack([x] * N).amin(0)),
    "pmax_varying": Case((8, 3), P("a"), P(), lambda x: fs.pmax(x, "a"), lambda x: torch.stack(_blocks(x)).amax(0)),
    "pvary": Case((4, 3), P(), P("a"), lambda x: fs.pvary(x, "a") * 1.5, lambda x: torch.cat([x * 1.5] * N)),
    "all_gather": Case(
        (8, 3), P("a"), P("a"), lambda x: fs.all_gather(x, "a"), lambda x: torch.stack(_blocks(x)).repeat(N, 1, 1)
    ),
    "all_gather_tiled": Case(
        (8, 3),
        P("a"),
        P("a"),
        lambda x: fs.all_gather(x, "a", dim=1, tiled=True),
        lambda x: x.reshape(N, 2, 3).permute(1, 0, 2).reshape(2, N * 3).repeat(N, 1),
    ),
    "psum_scatter": Case(
        (16, 3), P("a"), P("a"), lambda x: fs.psum_scatter(x, "a", tiled=True), lambda x: sum(_blocks(x))
    ),
    "psum_scatter_untiled": Case(
        (16, 3), P("a"), P("a"), lambda x: fs.psum_scatter(x, "a"), lambda x: sum(_blocks(x)).reshape(-1)
    ),
    "all_to_all": Case(
        (16, 3),
        P("a"),
        P("a"),
        lambda x: fs.all_to_all(x, "a", 0, 0),
        lambda x: x.reshape(N, N, 3).transpose(0, 1).reshape(16, 3),
    ),
    "ppermute": Case((8, 3), P("a"), P("a"), lambda x: fs.ppermute(x, "a", RING), lambda x: x.roll(2, 0)),
    "ragged_all_to_all": Case((16, 3), P("a"), P("a"), lambda x: _ragged(x), lambda x: x[_RAGGED_ROWS]),
}

MODES = ["jvp_grad", "jvp_zero", "vjp_zero", "zero_operand"]


def _mode(name: str, mode: str) -> tuple[Fn, Fn]:
    """The body of ``mode`` for collective ``name``, and its reference on the full tensor."""
    case = CASES[name]

    def jvp_grad(c: Fn) -> Fn:
        def f(x: torch.Tensor) -> torch.Tensor:
            # the tangent rule of ``y / 2`` has a ZeroTensor term (the 2 has no tangent) times the primal ``y``:
            # the gradient of the tangent reaches ``y``'s own nodes as a ZeroTensor cotangent (pmean's ``/ n``
            # in the fuzzer's program)
            _, t = torch.func.jvp(lambda v: c(torch.sin(v)) / 2, (x,), (torch.cos(x),))  # the primal is unused
            return torch.sin(t)

        return f

    def jvp_zero(c: Fn) -> Fn:
        def f(x: torch.Tensor) -> torch.Tensor:
            y, t = torch.func.jvp(lambda v: c(torch.sin(v)) / 2, (x,), (_zeros(x),))
            return y + t

        return f

    def vjp_zero(c: Fn) -> Fn:
        def f(x: torch.Tensor) -> torch.Tensor:
            y, pull = torch.func.vjp(lambda v: c(torch.sin(v)), x)
            return pull(_zeros(y))[0] + torch.cos(x)

        return f

    def zero_operand(c: Fn) -> Fn:
        def f(x: torch.Tensor) -> torch.Tensor:
            return c(_zeros(x)) + c(x)

        return f

    make = {"jvp_grad": jvp_grad, "jvp_zero": jvp_zero, "vjp_zero": vjp_zero, "zero_operand": zero_operand}[mode]
    return make(case.local), make(case.ref)


def _case_body(mesh: fs.Mesh, name: str, mode: str) -> str:
    case = CASES[name]
    body, ref = _mode(name, mode)
    x = torch.randn(case.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out_spec = case.in_spec if mode == "vjp_zero" else case.out_spec  # (a cotangent is laid out as the input)
    f = fs.shard_map(body, mesh=mesh, in_specs=(case.in_spec,), out_specs=out_spec)

    xr = x.clone().requires_grad_(True)
    want = ref(xr)
    r = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (want * r).sum().backward()

    xg = x.clone().requires_grad_(True)
    got = fs.device_get(f(xg))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} {mode} value: {m}")
    (got * r).sum().backward()
    held = _held(mesh, case.in_spec, case.shape)
    torch.testing.assert_close(
        xg.grad.flatten()[held],
        xr.grad.flatten()[held],
        rtol=1e-12,
        atol=1e-12,
        msg=lambda m: f"{name} {mode} gradient: {m}",
    )
    return "ok"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_tangent_through_collective(run, name: str, mode: str) -> None:
    assert set(run(_case_body, MESH, name, mode)) == {"ok"}


# --------------------------------------------------------------------------------------------------------
# A ZeroTensor returned from the body
# --------------------------------------------------------------------------------------------------------


def _zero_outputs_body(xl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, pull = torch.func.vjp(torch.sin, xl)
    return fs.pvary(_zeros(xl), "a"), pull(_zeros(y))[0]  # pvary of a ZeroTensor, and a zero cotangent


def _zero_outputs(mesh: fs.Mesh) -> str:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    f = fs.shard_map(_zero_outputs_body, mesh=mesh, in_specs=(P("a"),), out_specs=(P("a"), P("a")))
    a, b = f(x)
    for out in (a, b):
        torch.testing.assert_close(fs.device_get(out), torch.zeros_like(x), rtol=0, atol=0)
    # the blocks (no memory of their own) go on into another call as any block does
    s = fs.shard_map(lambda u, v: fs.psum(u + v + 1, "a"), mesh=mesh, in_specs=(P("a"), P("a")), out_specs=P())(a, b)
    torch.testing.assert_close(fs.device_get(s), torch.full((2, 3), float(N), dtype=torch.float64), rtol=0, atol=0)
    return "ok"


def test_zero_tensor_outputs(run) -> None:
    assert set(run(_zero_outputs, MESH)) == {"ok"}
