"""``torch.vmap`` and forward-mode AD through every collective, against plain-torch references on full tensors.

Each case is a local function of local shards (built from one collective) and a reference: the same global
function written in plain torch on the full tensors. The first argument is the one batched and
differentiated; further arguments are constants. Inside ``shard_map``, for each case:

- ``torch.vmap`` over a leading batch dim equals the reference applied to each batch element, and makes
  the same collectives, as many times, as one unbatched call (one batched collective, not one per element);
- ``torch.func.jvp`` and ``torch.autograd.forward_ad`` give the reference's tangent;
- ``torch.func.jacfwd`` and ``jacrev`` give the reference's Jacobians, and agree with each other;
- ``torch.func.hessian`` of a global scalar gives the reference's Hessian.

What a Jacobian inside shard_map means: ``jacfwd`` perturbs local element ``k`` on every device at once,
so it is the global Jacobian times the tangent that tiles ``e_k`` over the input's sharded dims
(``Tin``); ``jacrev`` seeds ``e_j`` on every device's output, so it is the global transpose times the
cotangent that tiles ``e_j`` over the output's sharded dims (``Tout``). Both are blocks of one matrix:
``psum(jacfwd, out axes) == psum(jacrev, in axes) == Tout^T J Tin``.

All in float64, under ``sim`` for every case (check_vma on and off) and under ``dist`` for a sample.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch._functorch.eager_transforms as _eager
import torch.autograd.forward_ad as fwAD

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import lax as core_lax

B = 3  # the vmapped batch size

# torch.autograd.forward_ad.make_dual loads its jit-scripted decompositions on first use
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


@dataclass(frozen=True)
class Case:
    """``local(*shards)`` inside shard_map over ``mesh`` equals ``ref(*full)`` on full tensors."""

    mesh: dict[str, int]
    shapes: tuple[tuple[int, ...], ...]  # global shapes of the arguments; the first is batched / differentiated
    in_specs: tuple[P, ...]
    out_spec: P
    local: Callable[..., torch.Tensor]
    ref: Callable[..., torch.Tensor]
    vma_only: bool = False  # relies on check_vma=True inserting the pvary
    gen: Callable[[torch.Generator], torch.Tensor] | None = None  # the first argument, if not plain randn


# ---------------------------------------------------------------- plain-torch helpers for the references


def _blocks(x: torch.Tensor, n: int, dim: int = 0) -> list[torch.Tensor]:
    return list(x.chunk(n, dim))


def _roll(x: torch.Tensor, n: int) -> torch.Tensor:
    b = _blocks(x, n)
    return torch.cat([b[-1], *b[:-1]])


def _partial_perm(x: torch.Tensor, n: int) -> torch.Tensor:
    b = _blocks(x, n)
    out = [torch.zeros_like(b[0]) for _ in range(n)]
    out[1], out[3] = b[0], b[2]
    return torch.cat(out)


def _ties(g: torch.Generator) -> torch.Tensor:
    """[8, 3] in 4 blocks where blocks 0 and 1 tie for the max and blocks 2 and 3 tie for the min."""
    a = torch.randn(2, 3, generator=g, dtype=torch.float64)
    return torch.cat([a + 2, a + 2, a - 2, a - 2])


def _bucket(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    a, b, d = fs.pvary((x, x.sin(), c), "tp")  # one PvaryBucket of three leaves
    return a * d + b


def _bucket_ref(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (x * c + x.sin()).repeat(4, 1)


CASES: dict[str, Case] = {
    # --- one axis of a 1-D mesh
    "psum": Case(
        {"tp": 4}, ((8, 3),), (P("tp"),), P(), lambda x: fs.psum(x.sin(), "tp"), lambda x: sum(_blocks(x.sin(), 4))
    ),
    "pmean": Case({"tp": 4}, ((8, 3),), (P("tp"),), P(), lambda x: fs.pmean(x, "tp"), lambda x: sum(_blocks(x, 4)) / 4),
    "pmax": Case(
        {"tp": 4}, ((8, 3),), (P("tp"),), P(), lambda x: fs.pmax(x, "tp"), lambda x: torch.stack(_blocks(x, 4)).amax(0)
    ),
    "pmin": Case(
        {"tp": 4}, ((8, 3),), (P("tp"),), P(), lambda x: fs.pmin(x, "tp"), lambda x: torch.stack(_blocks(x, 4)).amin(0)
    ),
    "pmax_ties": Case(
        {"tp": 4},
        ((8, 3),),
        (P("tp"),),
        P(),
        lambda x: fs.pmax(x, "tp"),
        lambda x: torch.stack(_blocks(x, 4)).amax(0),
        gen=_ties,
    ),
    "pmin_ties": Case(
        {"tp": 4},
        ((8, 3),),
        (P("tp"),),
        P(),
        lambda x: fs.pmin(x, "tp"),
        lambda x: torch.stack(_blocks(x, 4)).amin(0),
        gen=_ties,
    ),
    "pvary": Case({"tp": 4}, ((2, 3),), (P(),), P("tp"), lambda x: fs.pvary(x, "tp"), lambda x: x.repeat(4, 1)),
    "pvary_bucket": Case({"tp": 4}, ((2, 3), (2, 3)), (P(), P()), P("tp"), _bucket, _bucket_ref),
    "auto_pvary_invariant_batched": Case(  # the invariant operand is the one vmapped / differentiated
        {"tp": 4}, ((3,), (8, 3)), (P(), P("tp")), P("tp"), lambda w, x: w * x, lambda w, x: w * x, vma_only=True
    ),
    "auto_pvary_varying_batched": Case(  # the varying operand is; the invariant one is a constant
        {"tp": 4}, ((8, 3), (3,)), (P("tp"), P()), P("tp"), lambda x, w: w * x, lambda x, w: w * x, vma_only=True
    ),
    "explicit_pvary": Case(
        {"tp": 4},
        ((3,), (8, 3)),
        (P(), P("tp")),
        P("tp"),
        lambda w, x: fs.pvary(w, "tp") * x,
        lambda w, x: w * x,
    ),
    "all_gather_tiled": Case(
        {"tp": 4},
        ((8, 3),),
        (P("tp"),),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=0, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_stacked_dim1": Case(
        {"tp": 4},
        ((8, 3),),
        (P("tp"),),
        P("tp"),
        lambda x: fs.all_gather(x, "tp", dim=1),
        lambda x: torch.stack(_blocks(x, 4), dim=1).repeat(4, 1, 1),
    ),
    "all_gather_invariant": Case(
        {"tp": 4},
        ((3, 8),),
        (P(None, "tp"),),
        P(),
        lambda x: fs.lax.all_gather_invariant(x, "tp", dim=1, tiled=True),
        lambda x: x,
    ),
    "split_invariant": Case(
        {"tp": 4},
        ((8, 3),),
        (P(),),
        P("tp"),
        lambda x: core_lax.split_invariant(x.sin(), "tp", dim=0),
        lambda x: x.sin(),
    ),
    "psum_scatter_tiled": Case(
        {"tp": 4},
        ((16, 3),),
        (P("tp"),),
        P("tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=0, tiled=True),
        lambda x: sum(_blocks(x, 4)),
    ),
    "psum_scatter_untiled": Case(
        {"tp": 4},
        ((16, 3),),
        (P("tp"),),
        P("tp"),
        lambda x: fs.psum_scatter(x, "tp", dim=0),
        lambda x: sum(_blocks(x, 4)).reshape(-1),
    ),
    "all_to_all_tiled": Case(
        {"tp": 4}, ((8, 8),), (P("tp"),), P(None, "tp"), lambda x: fs.all_to_all(x, "tp", 1, 0), lambda x: x
    ),
    "all_to_all_untiled": Case(
        {"tp": 2},
        ((2, 4, 3),),
        (P(None, "tp"),),
        P("tp"),
        lambda x: fs.all_to_all(x, "tp", 0, 0, tiled=False),
        lambda x: x.reshape(4, 2, 3),
    ),
    "ppermute_ring": Case(
        {"tp": 4},
        ((8, 3),),
        (P("tp"),),
        P("tp"),
        lambda x: fs.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]),
        lambda x: _roll(x, 4),
    ),
    "ppermute_partial": Case(
        {"tp": 4},
        ((8, 3),),
        (P("tp"),),
        P("tp"),
        lambda x: fs.ppermute(x, "tp", [(0, 1), (2, 3)]),
        lambda x: _partial_perm(x, 4),
    ),
    # --- 2-D meshes: one axis of two, tuples of axes (in and out of mesh order)
    "psum_one_axis_of_2d": Case(
        {"dp": 2, "tp": 2},
        ((4, 6),),
        (P("dp", "tp"),),
        P("dp"),
        lambda x: fs.psum(x, "tp"),
        lambda x: sum(_blocks(x, 2, 1)),
    ),
    "psum_tuple": Case(
        {"dp": 2, "tp": 2},
        ((8, 3),),
        (P(("dp", "tp")),),
        P(),
        lambda x: fs.psum(x.sin(), ("dp", "tp")),
        lambda x: sum(_blocks(x.sin(), 4)),
    ),
    "pmax_tuple_reversed": Case(
        {"dp": 2, "tp": 2},
        ((8, 3),),
        (P(("tp", "dp")),),
        P(),
        lambda x: fs.pmax(x, ("tp", "dp")),
        lambda x: torch.stack(_blocks(x, 4)).amax(0),
    ),
    "all_gather_tuple_reversed": Case(
        {"dp": 2, "tp": 2},
        ((8, 3),),
        (P(("tp", "dp")),),
        P(("dp", "tp")),
        lambda x: fs.all_gather(x, ("tp", "dp"), dim=0, tiled=True),
        lambda x: x.repeat(4, 1),
    ),
    "all_gather_invariant_tuple": Case(
        {"dp": 2, "tp": 2},
        ((8, 3),),
        (P(("dp", "tp")),),
        P(),
        lambda x: fs.lax.all_gather_invariant(x, ("dp", "tp"), dim=0, tiled=True),
        lambda x: x,
    ),
    "psum_scatter_tuple": Case(
        {"dp": 2, "tp": 2},
        ((16, 3),),
        (P(("dp", "tp")),),
        P(("tp", "dp")),
        lambda x: fs.psum_scatter(x, ("tp", "dp"), dim=0, tiled=True),
        lambda x: sum(_blocks(x, 4)),
    ),
    "all_to_all_tuple": Case(
        {"dp": 2, "tp": 2},
        ((8, 8),),
        (P(("dp", "tp")),),
        P(None, ("dp", "tp")),
        lambda x: fs.all_to_all(x, ("dp", "tp"), 1, 0),
        lambda x: x,
    ),
    "ppermute_2d": Case(
        {"dp": 2, "tp": 2},
        ((4, 6),),
        (P("dp", "tp"),),
        P("dp", "tp"),
        lambda x: fs.ppermute(x, "dp", [(0, 1), (1, 0)]),
        lambda x: torch.cat([x[2:], x[:2]]),
    ),
    "auto_pvary_2d": Case(  # an operand varying over tp only meets one varying over dp and tp
        {"dp": 2, "tp": 2},
        ((4,), (4, 4)),
        (P("tp"), P("dp", "tp")),
        P("dp", "tp"),
        lambda w, x: (w * x).tanh(),
        lambda w, x: (w * x).tanh(),
        vma_only=True,
    ),
}


# ---------------------------------------------------------------- specs as plain arithmetic on full tensors


def _dim_sizes(spec: P, ndim: int, mesh: dict[str, int]) -> list[int]:
    """How many blocks each dim is split into."""
    entries = [*spec, *([None] * (ndim - len(spec)))]
    out = []
    for e in entries:
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        out.append(math.prod(mesh[a] for a in axes))
    return out


def _axes(spec: P) -> tuple[str, ...]:
    return tuple(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


def _tile(u: torch.Tensor, spec: P, mesh: dict[str, int]) -> torch.Tensor:
    """The global tensor whose every block (of ``spec``) is ``u``: ``Tin``."""
    return u.repeat(_dim_sizes(spec, u.dim(), mesh))


def _block_sum(y: torch.Tensor, spec: P, mesh: dict[str, int]) -> torch.Tensor:
    """The sum of the blocks (of ``spec``) of the global ``y``: ``Tout^T``."""
    for d, k in reversed(list(enumerate(_dim_sizes(spec, y.dim(), mesh)))):
        if k > 1:
            y = y.unflatten(d, (k, -1)).sum(d)
    return y


def _local_shape(shape: tuple[int, ...], spec: P, mesh: dict[str, int]) -> tuple[int, ...]:
    return tuple(s // k for s, k in zip(shape, _dim_sizes(spec, len(shape), mesh)))


def _args(case: Case, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in case.shapes]
    if case.gen is not None:
        args[0] = case.gen(g)
    return args


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- the test body (sim and dist)


def _body(mesh: fs.Mesh, name: str, check_vma: bool) -> str:
    case = CASES[name]
    ms = mesh.shape
    seed = zlib.crc32(name.encode())
    args = _args(case, seed)
    x, rest = args[0], args[1:]
    spec0, out_spec = case.in_specs[0], case.out_spec
    in_local = _local_shape(x.shape, spec0, ms)
    none = lambda k: [None] * k  # noqa: E731

    def ref(x: torch.Tensor) -> torch.Tensor:
        return case.ref(x, *rest)

    def sm(fn: Callable[..., object], in_specs: tuple[P, ...], out_specs: object) -> Callable[..., object]:
        return fs.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    y = ref(x)
    out_nd = y.dim()
    batched = lambda s: P(None, *s)  # noqa: E731

    # -- vmap over a leading batch dim: per-element reference; one batched collective per unbatched one
    xs = torch.stack([_args(case, seed + 1 + b)[0] for b in range(B)])
    f1 = sm(lambda x, *r: case.local(x, *r), case.in_specs, out_spec)
    fb = sm(
        lambda xs, *r: torch.vmap(lambda xi: case.local(xi, *r))(xs),
        (batched(spec0), *case.in_specs[1:]),
        batched(out_spec),
    )
    with fs.comm_stats() as s1:
        _close(fs.device_get(f1(x, *rest)), y, "forward")
    with fs.comm_stats() as sb:
        _close(fs.device_get(fb(xs, *rest)), torch.stack([ref(xi) for xi in xs]), "vmap")
    calls = lambda s: {k: c for k, (c, _) in s.rows().items()}  # noqa: E731
    # the same collectives as one unbatched call, each carrying B times the payload
    assert calls(sb) == calls(s1) and sb.bytes() == B * s1.bytes(), (sb.table(), s1.table())

    # nested vmap: each level's rule moves its own batch dim; still one collective per unbatched one
    xss = torch.stack([xs, xs.flip(0)])  # [2, B, *shape]
    f2 = sm(
        lambda xss, *r: torch.vmap(torch.vmap(lambda xi: case.local(xi, *r)))(xss),
        (P(None, *batched(spec0)), *case.in_specs[1:]),
        P(None, *batched(out_spec)),
    )
    with fs.comm_stats() as s2:
        got = fs.device_get(f2(xss, *rest))
    _close(got, torch.stack([torch.stack([ref(xi) for xi in row]) for row in xss]), "vmap of vmap")
    assert calls(s2) == calls(s1) and s2.bytes() == 2 * B * s1.bytes(), (s2.table(), s1.table())

    # a trailing batch dim (each rule moves it into place before its collective)
    fl = sm(lambda xs, *r: torch.vmap(lambda xi: case.local(xi, *r), -1, -1)(xs), case.in_specs, out_spec)
    _close(fs.device_get(fl(xs.movedim(0, -1), *rest)), torch.stack([ref(xi) for xi in xs], -1), "vmap dim -1")

    # -- forward mode: torch.func.jvp, and dual tensors of torch.autograd.forward_ad
    t = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 99), dtype=torch.float64)
    want_t = torch.func.jvp(ref, (x,), (t,))[1]
    fj = sm(
        lambda x, t, *r: torch.func.jvp(lambda x: case.local(x, *r), (x,), (t,))[1],
        (spec0, spec0, *case.in_specs[1:]),
        out_spec,
    )
    _close(fs.device_get(fj(x, t, *rest)), want_t, "jvp")

    def dual(x: torch.Tensor, t: torch.Tensor, *r: torch.Tensor) -> torch.Tensor:
        return fwAD.unpack_dual(case.local(fwAD.make_dual(x, t), *r)).tangent

    with fwAD.dual_level():  # entered outside shard_map: every device (thread or process) uses it
        _close(fs.device_get(sm(dual, (spec0, spec0, *case.in_specs[1:]), out_spec)(x, t, *rest)), want_t, "fwAD")

    # -- Jacobians: jacfwd = J Tin (by out blocks), jacrev = J^T Tout (by in blocks), both sum to Tout^T J Tin
    u0 = torch.zeros(in_local, dtype=torch.float64)
    want_f = torch.func.jacfwd(lambda u: ref(x + _tile(u, spec0, ms)))(u0)
    want_r = torch.func.jacrev(lambda x: _block_sum(ref(x), out_spec, ms))(x)
    want_m = torch.func.jacfwd(lambda u: _block_sum(ref(x + _tile(u, spec0, ms)), out_spec, ms))(u0)
    out_axes, in_axes = _axes(out_spec), _axes(spec0)

    def jacobians(x: torch.Tensor, *r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fn = lambda x: case.local(x, *r)  # noqa: E731
        jf = torch.func.jacfwd(fn)(x)  # [*out_local, *in_local]
        jr = torch.func.jacrev(fn)(x)  # [*out_local, *in_local]
        # the transpose of the linearization t -> jvp(fn, x, t) runs each jvp rule's collective backwards
        jt = torch.func.jacrev(lambda t: torch.func.jvp(fn, (x,), (t,))[1])(torch.zeros_like(x))
        mf = fs.psum(jf, out_axes) if out_axes else jf
        mr = fs.psum(jr, in_axes) if in_axes else jr
        return jf, jr, jt, mf, mr

    rev_spec = P(*none(out_nd), *spec0)
    jac_specs = (P(*out_spec, *none(out_nd - len(out_spec))), rev_spec, rev_spec, P(), P())
    jf, jr, jt, mf, mr = sm(jacobians, case.in_specs, jac_specs)(x, *rest)
    _close(fs.device_get(jf), want_f, "jacfwd")
    _close(fs.device_get(jr), want_r, "jacrev")
    _close(fs.device_get(jt), want_r, "jacrev of the jvp in its tangent")
    _close(fs.device_get(mf), want_m, "psum(jacfwd)")
    _close(fs.device_get(mr), want_m, "psum(jacrev)")

    # -- second order: the Hessian (jacfwd of jacrev) of a global scalar
    def scalar_ref(x: torch.Tensor) -> torch.Tensor:
        return ref(x).sin().sum()

    # hessian = jacfwd(jacrev): the global gradient's block, perturbed by Tin; jacrev(jacfwd): its transpose
    want_h = torch.func.jacfwd(lambda u: torch.func.grad(scalar_ref)(x + _tile(u, spec0, ms)))(u0)

    want_rf = torch.func.jacrev(lambda x: torch.func.jacfwd(lambda u: scalar_ref(x + _tile(u, spec0, ms)))(u0))(x)

    def second(x: torch.Tensor, *r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def scalar(x: torch.Tensor) -> torch.Tensor:
            s = case.local(x, *r).sin().sum()
            return fs.psum(s, out_axes) if out_axes else s

        h = torch.func.hessian(scalar)(x)  # forward over reverse: [*in_local, *in_local]
        rf = torch.func.jacrev(torch.func.jacfwd(scalar))(x)  # reverse over forward: [*in_local, *in_local]
        return h, rf

    h, rf = sm(second, case.in_specs, (P(*spec0), P(*none(x.dim()), *spec0)))(x, *rest)
    _close(fs.device_get(h), want_h, "hessian")
    _close(fs.device_get(rf), want_rf, "jacrev(jacfwd)")
    return "ok"


SIM = [(n, v) for n, c in sorted(CASES.items()) for v in (True, False) if v or not c.vma_only]


@pytest.mark.parametrize(("name", "check_vma"), SIM, ids=[f"{n}-{'vma' if v else 'novma'}" for n, v in SIM])
def test_transforms_sim(name: str, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _body, CASES[name].mesh, name, check_vma) == ["ok"]


DIST = ["auto_pvary_2d", "pmax_ties", "psum_scatter_tuple", "all_to_all_tuple", "all_gather_invariant"]


@pytest.mark.dist
@pytest.mark.parametrize("name", DIST)
def test_transforms_dist(name: str) -> None:
    from _dist_pool import run_body

    results = run_body("dist", _body, CASES[name].mesh, name, True)
    assert results == ["ok"] * len(results)


# ---------------------------------------------------------------- per-sample gradients: vmap of grad


def _per_sample_body(mesh: fs.Mesh, check_vma: bool) -> str:
    """``vmap(grad(loss))`` over the samples of a dp-sharded batch, the weight column-parallel over tp.

    The weight is invariant over dp, so (the transpose of its pvary over dp being a psum) each device's
    per-sample gradient ``i`` is the sum over dp of the gradients of the samples ``i`` of every dp block:
    the gradient of the global function ``sum over dp blocks of loss(w, x_block[i])``.
    """
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    pv = (lambda v, a: v) if check_vma else fs.pvary  # check_vma=False: the pvarys written by hand

    def loss(w: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        h = xi @ pv(w, "dp")  # [6] @ [6, 4/tp] -> [4/tp]
        m = fs.pmax(h.max(), "tp")  # [] -> []
        lse = m + fs.psum((h - pv(m, "tp")).exp().sum(), "tp").log()  # [] -> []
        return lse + 0.5 * fs.psum(h.pow(2).sum(), "tp")

    def ref_loss(w: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        h = xi @ w
        return h.logsumexp(0) + 0.5 * h.pow(2).sum()

    def per_sample(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)  # [b/dp, 6, 4/tp]

    f = fs.shard_map(
        per_sample, mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P(None, None, "tp"), check_vma=check_vma
    )
    want = torch.vmap(torch.func.grad(ref_loss), in_dims=(None, 0))(w, x)  # [b, 6, 4]
    _close(fs.device_get(f(w, x)), want.unflatten(0, (2, -1)).sum(0), "per-sample grads")
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_per_sample_grads_sim(check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _per_sample_body, {"dp": 2, "tp": 2}, check_vma) == ["ok"]


@pytest.mark.dist
def test_per_sample_grads_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _per_sample_body, {"dp": 2, "tp": 2}, True)) == {"ok"}


# ---------------------------------------------------------------- what the sim backend still has to do


def _plain_jvp_body(mesh: fs.Mesh) -> str:
    f = fs.shard_map(
        lambda x: torch.func.jvp(lambda x: fs.psum(x, "tp"), (x,), (torch.ones_like(x),))[1],
        mesh=mesh,
        in_specs=(P("tp"),),
        out_specs=P(),
    )
    for _ in range(20):  # each call races with ~50% odds: 20 calls make the outcome certain
        _close(fs.device_get(f(torch.zeros(8, dtype=torch.float64))), torch.full((2,), 4.0, dtype=torch.float64), "")
    return "ok"


def test_sim_jvp_in_every_device_thread() -> None:
    from _dist_pool import run_body

    try:
        run_body("sim", _plain_jvp_body, {"tp": 4})
    finally:  # the shared level is left again: torch's process-wide forward-AD state is as it was
        assert fwAD._current_level == -1 and _eager.JVP_NESTING == 0, (fwAD._current_level, _eager.JVP_NESTING)
