"""Every collective inside shard_map on random uneven blocks (API §4, §14), under ``sim``, forward and backward.

Each example draws a mesh, a global shape, an in_spec that splits some dims unevenly (``torch.tensor_split``'s
blocks), the collective's axes (one axis or a tuple, any order) and its arguments. The reference is a plain-torch
single-device program: every device's block cut from the global tensor, the collective's per-device meaning
(JAX's, on blocks of different shapes), and the gradient by ``torch.autograd`` of the random linear functional
``sum_d <out_d, r_d>`` on the unsharded tensor. funcshard must give every device's output (shape and values), the
functional's value and its gradient (``fs.value_and_grad`` inside shard_map, assembled by the in_spec) equal to
it. Where the blocks of one group differ outside the dims the collective may change, the meaning is undefined and
funcshard must refuse the call with a ``ShardingError``.

Modes: ``vma`` (check_vma=True) and ``careful`` (check_vma=False, ``fs.pvary`` written where a careful user would).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from _uneven_strategies import blocks, dim_axes, fixed, group, index_on, meshes, probe, rank_coords, shapes, specs
from hypothesis import event, given
from hypothesis import strategies as st

import funcshard as fs
from funcshard import P

#: what a refusal says: the collective's own check, or the sim backend's check that a group's calls agree
REFUSAL = r"collective mismatch|which differ|must (be )?equal"


class Refused(Exception):
    """The reference has no meaning for these blocks (shapes that do not fit together)."""


@dataclass(frozen=True)
class Draw:
    mesh_shape: dict[str, int]
    shape: tuple[int, ...]
    spec: P
    axes: tuple[str, ...]  # the collective's axes
    seed: int
    check_vma: bool
    kw: dict  # the collective's own arguments

    @property
    def axis(self) -> str | tuple[str, ...]:
        """The collective's ``axis`` argument: a name alone, or a tuple of names."""
        return self.axes[0] if len(self.axes) == 1 else self.axes


#: a collective on one device's block, and the reference: every device's output from every device's block
Local = Callable[[torch.Tensor], torch.Tensor]
Ref = Callable[[list[torch.Tensor], Draw], list[torch.Tensor]]


def _evened(shape: tuple[int, ...], spec: P, mesh_shape: dict[str, int], axes: tuple[str, ...], keep: set[int]):
    """``shape`` with each dim outside ``keep`` whose spec entry holds one of ``axes`` cut to a multiple of the
    entry's size: a group over ``axes`` then holds blocks of one size there (uneven across other groups only)."""
    out = list(shape)
    for d, entry in enumerate(dim_axes(spec, len(shape))):
        if d not in keep and set(entry) & set(axes):
            n = math.prod(mesh_shape[a] for a in entry)
            out[d] -= out[d] % n
    return tuple(out)


#: the collective's own arguments for a rank: (keyword arguments, the dims that may stay uneven within a group)
Args = Callable[[int], st.SearchStrategy[tuple[dict, set[int]]]]


@st.composite
def draws(draw: st.DrawFn, args: Args) -> Draw:
    """A random example. In three examples of four, each dim outside the ``args``' uneven ones is evened within the
    groups of the collective's axes (the rest keep the drawn sizes: mostly calls that must be refused)."""
    mesh_shape = draw(meshes())
    shape = draw(shapes(max_rank=3, max_dim=11))
    spec = draw(specs(mesh_shape, len(shape)))
    k = draw(st.integers(1, len(mesh_shape)))
    axes = tuple(draw(st.permutations(tuple(mesh_shape)))[:k])
    kw, keep = draw(args(len(shape)))
    if draw(st.integers(0, 3)):
        shape = _evened(shape, spec, mesh_shape, axes, {k % len(shape) for k in keep})
    return Draw(mesh_shape, shape, spec, axes, draw(st.integers(0, 2**16)), draw(st.booleans()), kw)


def _groups(b: list[torch.Tensor], d: Draw) -> list[tuple[int, list[torch.Tensor]]]:
    """Per device (rank order): its index on the collective's axes and its group's blocks in index order."""
    return [
        (index_on(d.axes, d.mesh_shape, c), [b[r] for r in group(d.axes, d.mesh_shape, c)])
        for c in rank_coords(d.mesh_shape)
    ]


def _same_shapes(ts: list[torch.Tensor], but: tuple[int, ...] = ()) -> None:
    rank = ts[0].dim()
    keys = {tuple(s for k, s in enumerate(t.shape) if k not in {b % max(rank, 1) for b in but}) for t in ts}
    if len(keys) != 1:
        raise Refused(f"blocks {[tuple(t.shape) for t in ts]} differ outside dims {but}")


def _check(d: Draw, local: Local, ref: Ref, invariant_out: bool = False) -> None:
    """Run ``local`` on every device and compare outputs, the functional and its gradient with ``ref``."""
    mesh = fs.make_mesh(d.mesh_shape, backend="sim")
    every = tuple(d.mesh_shape)
    x = probe(d.shape, d.seed).requires_grad_(True)
    try:
        want = ref(blocks(x, d.spec, d.mesh_shape), d)
    except Refused:
        want = None
    f = fs.shard_map(
        _body(d, local, invariant_out, max((w.numel() for w in want), default=0) if want else 1),
        mesh=mesh,
        in_specs=(d.spec,),
        out_specs=(P(), d.spec, P(every), P(every)),
        check_vma=d.check_vma,
    )
    uneven_in = len({tuple(t.shape) for t in blocks(x, d.spec, d.mesh_shape)}) > 1
    uneven_out = want is not None and len({tuple(t.shape) for t in want}) > 1
    event("refused" if want is None else f"blocks in: {'uneven' if uneven_in else 'even'}")
    event("refused" if want is None else f"blocks out: {'uneven' if uneven_out else 'even'}")
    if want is None:
        with pytest.raises(fs.ShardingError, match=REFUSAL):
            f(x.detach())
        return
    value, grad, flat, sizes = f(x.detach())
    loss = (x * 0).sum() + sum((w * probe(tuple(w.shape), d.seed * 1000 + r + 1)).sum() for r, w in enumerate(want))
    (want_grad,) = torch.autograd.grad(loss, x)
    flat, sizes = fs.device_get(flat), fs.device_get(sizes)
    for r, w in enumerate(want):
        got_shape = tuple(int(s) for s in sizes[r] if s >= 0)
        assert got_shape == tuple(w.shape), (r, got_shape, tuple(w.shape))
        torch.testing.assert_close(flat[r, : w.numel()], w.detach().flatten(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fs.device_get(value), loss.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fs.device_get(grad), want_grad, rtol=1e-12, atol=1e-12)


def _body(d: Draw, local: Local, invariant_out: bool, width: int) -> Callable:
    """The shard_map body: ``local``'s output padded flat (and its shape), the functional and its gradient."""
    every = tuple(d.mesh_shape)
    missing = tuple(a for a in every if a not in d.spec.axes)

    def fwd(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not d.check_vma and missing:  # careful: the block is the same on the devices of the missing axes
            t = fs.pvary(t, missing)
        y = local(t)
        if not d.check_vma and invariant_out:  # careful: psum's result meets the varying probe
            y = fs.pvary(y, d.axes)
        me = int(fs.axis_index(every))
        r = fs.pvary(probe(tuple(y.shape), d.seed * 1000 + me + 1), every)
        return fs.psum((y * r).sum(), every), y  # [] (sum over the devices)

    def body(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        (value, y), g = fs.value_and_grad(fwd, has_aux=True)(t)
        sizes = torch.tensor([*y.shape, *([-1] * (5 - y.dim()))], dtype=torch.int64).unsqueeze(0)  # [1, 5]
        y = y.detach().flatten()[:width]
        flat = torch.cat([y, y.new_zeros(width - y.numel())]).unsqueeze(0)  # [1, width]
        return value, g, flat, sizes

    return body


def _no_args(rank: int) -> st.SearchStrategy[tuple[dict, set[int]]]:
    return st.just(({}, set()))


def _psum_ref(b: list[torch.Tensor], d: Draw) -> list[torch.Tensor]:
    out = []
    for _, grp in _groups(b, d):
        _same_shapes(grp)
        out.append(torch.stack(grp).sum(0))
    return out


@st.composite
def _psums(draw: st.DrawFn) -> Draw:
    """A psum draw; in most, a leading dim of a multiple of the axes' size sharded over them (blocks that vary over
    the axes, of one shape in a group) and the other dims split unevenly over the other axes."""
    d = draw(draws(_no_args))
    if not draw(st.integers(0, 3)):
        return d
    rest = tuple(a for a in d.mesh_shape if a not in d.axes)
    shape = (math.prod(d.mesh_shape[a] for a in d.axes) * draw(st.integers(1, 2)), *d.shape)
    spec = P(d.axes, *tuple(draw(specs(d.mesh_shape, len(d.shape), rest))))
    return Draw(**{**d.__dict__, "shape": shape, "spec": spec})


@fixed(60)
@given(_psums())
def test_psum(d: Draw) -> None:
    _check(d, lambda t: fs.psum(t, d.axis), _psum_ref, invariant_out=True)  # [*s] -> [*s]


def _gather_args(rank: int) -> st.SearchStrategy[tuple[dict, set[int]]]:
    tiled = st.integers(-rank, rank - 1).map(lambda k: ({"dim": k, "tiled": True}, {k}))
    stacked = st.integers(-rank - 1, rank).map(lambda k: ({"dim": k, "tiled": False}, set()))
    return st.one_of(tiled, stacked)


def _gather_ref(b: list[torch.Tensor], d: Draw) -> list[torch.Tensor]:
    dim, tiled = d.kw["dim"], d.kw["tiled"]
    out = []
    for _, grp in _groups(b, d):
        _same_shapes(grp, (dim,) if tiled else ())
        out.append(torch.cat(grp, dim) if tiled else torch.stack(grp, dim))
    return out


@fixed(80)
@given(draws(_gather_args))
def test_all_gather(d: Draw) -> None:
    # [.., s_i, ..] -> [.., sum s_i, ..] (tiled) or [.., n, .., s_i, ..] (stacked)
    _check(d, lambda t: fs.all_gather(t, d.axis, **d.kw), _gather_ref)


def _scatter_args(rank: int) -> st.SearchStrategy[tuple[dict, set[int]]]:
    return st.tuples(st.integers(-rank, rank - 1), st.booleans()).map(lambda a: ({"dim": a[0], "tiled": a[1]}, set()))


def _scatter_ref(b: list[torch.Tensor], d: Draw) -> list[torch.Tensor]:
    dim, tiled = d.kw["dim"], d.kw["tiled"]
    out = []
    for i, grp in _groups(b, d):
        _same_shapes(grp)
        total = torch.stack(grp).sum(0)
        if tiled:
            out.append(torch.tensor_split(total, len(grp), dim)[i])
        elif total.shape[dim] != len(grp):
            raise Refused(f"dim {dim} of {tuple(total.shape)} is not the axis size {len(grp)}")
        else:
            out.append(total.select(dim, i))
    return out


@st.composite
def _scatters(draw: st.DrawFn) -> Draw:
    """A psum_scatter draw; untiled ones mostly with the scattered dim replicated and of the axes' size."""
    d = draw(draws(_scatter_args))
    dim = d.kw["dim"] % len(d.shape)
    if d.kw["tiled"] or not draw(st.integers(0, 3)):
        return d
    shape = list(d.shape)
    shape[dim] = math.prod(d.mesh_shape[a] for a in d.axes)
    entries = [None if k == dim else e for k, e in enumerate(dim_axes(d.spec, len(shape)))]
    return Draw(**{**d.__dict__, "shape": tuple(shape), "spec": P(*[e or None for e in entries])})


@fixed(80)
@given(_scatters())
def test_psum_scatter(d: Draw) -> None:
    _check(d, lambda t: fs.psum_scatter(t, d.axis, **d.kw), _scatter_ref)  # [.., s, ..] -> [.., s/n, ..] or [..]


def _a2a_args(rank: int) -> st.SearchStrategy[tuple[dict, set[int]]]:
    dims = st.tuples(st.integers(0, rank - 1), st.integers(0, rank - 1))
    return dims.map(lambda a: ({"split_dim": a[0], "concat_dim": a[1]}, {a[1]}))


def _a2a_ref(b: list[torch.Tensor], d: Draw) -> list[torch.Tensor]:
    sd, cd = d.kw["split_dim"], d.kw["concat_dim"]
    out = []
    for i, grp in _groups(b, d):
        _same_shapes(grp, (sd, cd))
        chunks = [torch.tensor_split(t, len(grp), sd)[i] for t in grp]  # what each source sends to device i
        _same_shapes(chunks, (cd,))
        out.append(torch.cat(chunks, cd))
    return out


@fixed(80)
@given(draws(_a2a_args))
def test_all_to_all(d: Draw) -> None:
    # [.., s_sd, .., s_cd, ..] -> [.., s_sd/n, .., sum of the arrivals' s_cd, ..]
    _check(d, lambda t: fs.all_to_all(t, d.axis, d.kw["split_dim"], d.kw["concat_dim"], tiled=True), _a2a_ref)


@st.composite
def _perms(draw: st.DrawFn) -> Draw:
    """A draw with a random partial permutation of the collective's axes as ``perm``."""
    d = draw(draws(lambda rank: st.just(({}, set(range(rank))))))
    n = math.prod(d.mesh_shape[a] for a in d.axes)
    srcs = draw(st.permutations(range(n)))
    dsts = draw(st.permutations(range(n)))
    k = draw(st.integers(0, n))
    return Draw(**{**d.__dict__, "kw": {"perm": list(zip(srcs[:k], dsts[:k]))}})


def _ppermute_ref(b: list[torch.Tensor], d: Draw) -> list[torch.Tensor]:
    frm = {dst: src for src, dst in d.kw["perm"]}
    return [
        grp[frm[i]] if i in frm else torch.zeros_like(b[r]) for r, (i, grp) in enumerate(_groups(b, d))
    ]  # each device gets its sender's block, zeros of its own shape where nothing arrives


@fixed(60)
@given(_perms())
def test_ppermute(d: Draw) -> None:
    _check(d, lambda t: fs.ppermute(t, d.axis, d.kw["perm"]), _ppermute_ref)  # [*s_i] -> [*s_src] (or zeros [*s_i])


def _index_ref(b: list[torch.Tensor], d: Draw) -> list[torch.Tensor]:
    return [b[r] * (i + 1) + i for r, (i, _) in enumerate(_groups(b, d))]


@fixed(30)
@given(draws(lambda rank: st.just(({}, set(range(rank))))))
def test_axis_index(d: Draw) -> None:
    def local(t: torch.Tensor) -> torch.Tensor:
        i = fs.axis_index(d.axis)  # [] int64, varying over the axes
        assert int(i) == index_on(d.axes, d.mesh_shape, {a: int(fs.axis_index(a)) for a in d.mesh_shape})
        return t * (i + 1) + i

    _check(d, local, _index_ref)
