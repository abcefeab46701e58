"""The fuzzer's reference: a :class:`Program` run on every device explicitly, in plain torch (no funcshard).

A value is a list with one tensor per device (rank order); each collective is a sum / stack / cat / index over
that list; the outputs are assembled by their specs. It is plain differentiable torch on the full inputs, so
autograd through it gives the gradient of the global function.

Gradients taken inside the body (``torch.func.grad`` / ``vjp`` / ``grad_and_value`` of ``f(w)``) mean what they
mean in JAX's shard_map: a value stands for one distinct value per class of devices that agree on the axes it
varies over. The loss is the sum over the distinct values of the output (``sum(L_d) / copies``), and the
gradient of a distinct ``w`` is the sum of the per-device partials over the devices holding that ``w``. So a
``w`` invariant over an axis where the loss varies gets the sum over that axis (the transpose of the ``pvary``
where they meet), and a loss invariant over an axis counts once, not once per device.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from _fuzz_program import Axes, Entry, Op, Program, axes_tuple, evaluate, spec_axes

# --------------------------------------------------------------------------------------------------------
# The reference: every device explicitly, plain torch
# --------------------------------------------------------------------------------------------------------


class RefMesh:
    """Devices in rank order (row-major coordinates) and the groups of a collective over a tuple of axes."""

    def __init__(self, shape: dict[str, int]) -> None:
        self.names = tuple(shape)
        self.shape = dict(shape)
        self.coords = [dict(zip(self.names, c)) for c in itertools.product(*(range(shape[a]) for a in self.names))]
        self.size = len(self.coords)

    def count(self, axes: Any) -> int:
        return math.prod(self.shape[a] for a in axes_tuple(axes))

    def index(self, rank: int, axes: Any) -> int:
        """The row-major index of device ``rank`` over ``axes`` in the order given (major first)."""
        idx = 0
        for a in axes_tuple(axes):
            idx = idx * self.shape[a] + self.coords[rank][a]
        return idx

    def groups(self, axes: Any) -> list[tuple[list[int], int]]:
        """Per device: the ranks of its group over ``axes`` in index order, and its own index."""
        ax = axes_tuple(axes)
        out = []
        for r in range(self.size):
            peers = [
                q
                for q in range(self.size)
                if all(self.coords[q][a] == self.coords[r][a] for a in self.names if a not in ax)
            ]
            members = sorted(peers, key=lambda q: self.index(q, ax))
            out.append((members, self.index(r, ax)))
        return out

    def holders(self, vma: frozenset[str]) -> list[list[int]]:
        """Per device: the devices holding the same distinct value as it, for a value varying over ``vma``."""
        return [
            [q for q in range(self.size) if all(self.coords[q][a] == self.coords[r][a] for a in vma)]
            for r in range(self.size)
        ]


class RefDevice:
    """What a per-device expression may ask of ``fs`` in the reference: its index on an axis, and a
    collective of a Python number (the same on every device, so a psum is ``n`` copies; as in JAX, the
    collectives that do not reduce take it as a 0-dim value)."""

    def __init__(self, rm: RefMesh, rank: int) -> None:
        self.rm, self.rank = rm, rank

    def axis_index(self, axes: Axes) -> torch.Tensor:
        return torch.tensor(self.rm.index(self.rank, axes))

    def psum(self, c: float, axes: Axes) -> float:
        return c * self.rm.count(axes)

    def pmean(self, c: float, axes: Axes) -> float:
        return c

    pmax = pmin = pmean

    def all_gather(self, c: float, axes: Axes) -> torch.Tensor:
        return torch.full((self.rm.count(axes),), c)

    def ppermute(self, c: float, axes: Axes, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return torch.tensor(c if self.rm.index(self.rank, axes) in [d for _, d in perm] else 0.0)


def _each(fn: Callable[[list[torch.Tensor], int], torch.Tensor]) -> Any:
    """A reference collective from ``fn(group values in index order, own index)``."""

    def ref(xs: list[torch.Tensor], rm: RefMesh, axes: Axes, **params: Any) -> list[torch.Tensor]:
        return [fn([xs[m] for m in members], i, **params) for members, i in rm.groups(axes)]

    return ref


def _sum(vs: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.add, vs)


def _scatter(vs, i, dim, tiled):
    total = _sum(vs)
    return total.chunk(len(vs), dim)[i] if tiled else total.select(dim, i)


def _all_to_all(vs, i, split_dim, concat_dim, tiled):
    if tiled:
        return torch.cat([v.chunk(len(vs), split_dim)[i] for v in vs], concat_dim)
    return torch.stack([v.select(split_dim, i) for v in vs], concat_dim)


def _ppermute(vs, i, perm):
    for src, dst in perm:
        if dst == i:
            return vs[src]
    return torch.zeros_like(vs[i])


REF_COLLECTIVE = {
    "psum": _each(lambda vs, i: _sum(vs)),
    "pmean": _each(lambda vs, i: _sum(vs) / len(vs)),
    "pmax": _each(lambda vs, i: torch.stack(vs).amax(0)),
    "pmin": _each(lambda vs, i: torch.stack(vs).amin(0)),
    "pvary": _each(lambda vs, i: vs[i]),
    "all_gather": _each(lambda vs, i, dim, tiled: (torch.cat if tiled else torch.stack)(vs, dim)),
    "all_gather_invariant": _each(lambda vs, i, dim, tiled: (torch.cat if tiled else torch.stack)(vs, dim)),
    "psum_scatter": _each(_scatter),
    "all_to_all": _each(_all_to_all),
    "ppermute": _each(_ppermute),
}


def block(shape: tuple[int, ...], entries: tuple[Entry, ...], rm: RefMesh, rank: int) -> tuple[slice, ...]:
    """The slices of a global value of ``shape`` laid out by ``entries`` that device ``rank`` holds."""
    dims = spec_axes(entries) + [()] * (len(shape) - len(entries))
    out = []
    for s, axes in zip(shape, dims, strict=True):
        size = s // rm.count(axes)
        i = rm.index(rank, axes)
        out.append(slice(i * size, (i + 1) * size))
    return tuple(out)


def assemble(vals: list[torch.Tensor], entries: tuple[Entry, ...], rm: RefMesh) -> torch.Tensor:
    """The global value from the devices' blocks (the first holder of each block)."""
    ndim = vals[0].dim()
    dims = spec_axes(entries) + [()] * (ndim - len(entries))
    blocks: dict[tuple[int, ...], torch.Tensor] = {}
    for r in range(rm.size):
        blocks.setdefault(tuple(rm.index(r, d) for d in dims), vals[r])

    def build(prefix: tuple[int, ...]) -> torch.Tensor:
        d = len(prefix)
        if d == ndim:
            return blocks[prefix]
        return torch.cat([build((*prefix, i)) for i in range(rm.count(dims[d]))], d)

    return build(())


def run_reference(prog: Program, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The program's global outputs, every device run explicitly on (its own copy of) its blocks."""
    rm = RefMesh(prog.mesh)
    env = {
        inp.var.id: [x[block(inp.shape, inp.spec, rm, r)].clone() for r in range(rm.size)]
        for inp, x in zip(prog.inputs, xs, strict=True)
    }
    with torch.enable_grad():
        _run_ref_ops(prog.ops, env, rm)
    return [assemble(env[v.id], entries, rm) for v, entries in prog.outputs]


def _run_ref_ops(ops: tuple[Op, ...], env: dict[int, list[Any]], rm: RefMesh) -> None:
    for op in ops:
        xs = [env[a.id] for a in op.args]
        if op.sub:
            outs = _ref_transform(op, env, rm)
        elif op.kind in REF_COLLECTIVE:
            outs = (REF_COLLECTIVE[op.kind](xs[0], rm, **op.params),)
        else:
            outs = ([evaluate(op, [x[r] for x in xs], RefDevice(rm, r)) for r in range(rm.size)],)
        for v, val in zip(op.outs, outs, strict=True):
            env[v.id] = val


def _ref_transform(op: Op, env: dict[int, list[Any]], rm: RefMesh) -> tuple[list[torch.Tensor], ...]:
    sub = op.sub
    assert sub is not None

    def f(ws: list[torch.Tensor]) -> list[torch.Tensor]:
        inner = {**env, sub.arg.id: ws}
        _run_ref_ops(sub.ops, inner, rm)
        return inner[sub.out.id]

    w = env[op.args[0].id]
    if op.kind == "vmap":
        per_row = [f([t[i] for t in w]) for i in range(w[0].shape[0])]
        return ([torch.stack([row[r] for row in per_row]) for r in range(rm.size)],)
    # a fresh alias of w: the transform differentiates through its argument only, not through outer values
    # computed from w that the function reads
    wa = [t.view_as(t) if t.requires_grad else t.detach().requires_grad_() for t in w]
    out = f(wa)
    if op.kind == "jvp":
        return out, _ref_jvp(out, wa, [torch.cos(t) for t in w])
    if op.kind == "vjp":
        return out, _ref_vjp(rm, out, wa, [torch.cos(o) for o in out], sub.out.vma, sub.arg.vma)
    loss = [o.sum() for o in out]
    g = _ref_vjp(rm, loss, wa, [torch.ones_like(v) for v in loss], sub.out.vma, sub.arg.vma)
    return (g,) if op.kind == "grad" else (g, loss)


def _ref_vjp(rm, outs, ins, cts, out_vma, in_vma) -> list[torch.Tensor]:
    """JAX's vjp inside shard_map: the loss is the sum over the distinct output values (each is held by
    ``copies`` devices), and each distinct input's cotangent is summed over the devices that hold it."""
    copies = rm.count([a for a in rm.names if a not in out_vma])
    pairs = [(o, c / copies) for o, c in zip(outs, cts, strict=True) if o.requires_grad]
    gs: Any = [None] * len(ins)
    if pairs:
        gs = torch.autograd.grad(
            [o for o, _ in pairs], ins, [c for _, c in pairs], create_graph=True, allow_unused=True
        )
    gs = [torch.zeros_like(x) if g is None else g for g, x in zip(gs, ins, strict=True)]
    return [_sum([gs[q] for q in held]) for held in rm.holders(in_vma)]


def _ref_jvp(outs, ins, tangents) -> list[torch.Tensor]:
    """The directional derivative of ``outs`` along ``tangents``, by transposing a vjp (double backward)."""
    zeros = [torch.zeros_like(o) for o in outs]
    us = [torch.zeros_like(o, requires_grad=True) for o in outs]
    live = [(o, u) for o, u in zip(outs, us, strict=True) if o.requires_grad]
    if not live:
        return zeros
    gs = torch.autograd.grad([o for o, _ in live], ins, [u for _, u in live], create_graph=True, allow_unused=True)
    keep = [(g, t) for g, t in zip(gs, tangents, strict=True) if g is not None and g.requires_grad]
    if not keep:
        return zeros
    ts = torch.autograd.grad([g for g, _ in keep], us, [t for _, t in keep], create_graph=True, allow_unused=True)
    return [z if t is None else t for t, z in zip(ts, zeros, strict=True)]
