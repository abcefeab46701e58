"""The fuzzer's program generator: :func:`generate` draws a random :class:`Program` from a ``random.Random``.

It tracks each value's local shape and the set of mesh axes it varies over (vma), and that is the oracle:
an op's result varies over the union of its operands' axes; psum / pmean / pmax / pmin and
all_gather_invariant remove their axes; all_gather / psum_scatter / all_to_all / ppermute / pvary add them;
``fs.axis_index`` varies over its axes; an input varies over the axes its spec names; a gradient varies like
its primal. From it, out_specs name every axis an output varies over (the error tests omit one), and under
``check_vma=False`` the program writes ``fs.pvary`` where a careful user would: on every operand that is
invariant over an axis another operand (or the collective, or the out_spec) varies over.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from typing import Any

from _fuzz_program import Axes, Entry, Input, Op, Program, Sub, Var, axes_tuple, global_shape

NAME_SETS = (("a", "b", "c"), ("dp", "tp", "fsdp"), ("x", "y", "z"))
MAX_NUMEL = 64  # elements per device and value: keeps programs small and fast
MAX_DEPTH = 2  # transforms nested at most this deep

# --------------------------------------------------------------------------------------------------------
# The generator
# --------------------------------------------------------------------------------------------------------

UNARY = ("sin", "tanh", "exp", "square", "scale")
BINARY = ("add", "mul", "sub", "div")
REDUCING = ("psum", "pmean", "pmax", "pmin")
TRANSFORMS = ("grad", "vmap", "vjp", "grad_and_value", "jvp")
# category -> weight; a category is also what a test can switch off, and what a failure is attributed to
CATEGORIES = {
    "elementwise": 6,
    "collective": 7,
    "reduce": 2,
    "reshape": 2,
    "matmul": 2,
    "pvary": 1,
    "custom": 2,
    "axis_index": 2,
    "number": 1,
    "inplace": 2,
    "inplace_input": 2,
    "transform": 3,
    "tiled_out": 0,  # not an op: out_specs that name axes the output is invariant over
}
CORE = frozenset({"elementwise", "collective", "reduce", "reshape", "matmul", "pvary"})
FEATURES = tuple(c for c in CATEGORIES if c not in CORE)
IN_SUB = {"inplace", "inplace_input"}  # not inside a transformed function


class Gen:
    """Draws one program. ``pool`` holds the values an op may read; ``ops`` is the list being written (the
    program's, or a transformed function's while one is drawn)."""

    def __init__(self, rnd: random.Random, mode: str, total: int | None, focus: str | None) -> None:
        self.rnd, self.mode = rnd, mode
        self.weights = dict(CATEGORIES)
        if focus is not None:  # the core ops and this one feature, often
            self.weights = {c: w for c, w in CATEGORIES.items() if c in CORE or c == focus}
            if self.weights.get(focus):  # about a third of the ops
                self.weights[focus] = sum(CATEGORIES[c] for c in CORE) // 2
        self.cats = list(self.weights)
        if mode == "lazy":  # inside a transform, JAX's check_vma=False gradients are local: not compared here
            self.cats = [c for c in self.cats if c != "transform"]
        self.mesh = gen_mesh(rnd, total)
        self.names = tuple(self.mesh)
        self.ids = itertools.count()
        self.ops: list[Op] = []
        self.pool: list[Var] = []
        self.depth = 0
        self.used: set[int] = set()
        self.inputs: list[Input] = []
        self.may_raise: list[str] = []
        if mode == "lazy":
            self.may_raise.append("check_vma=False with no pvary before collectives: JAX's answer, or an error")

    # -- helpers ---------------------------------------------------------------------------------------
    def var(self, shape: tuple[int, ...], vma: frozenset[str]) -> Var:
        return Var(next(self.ids), tuple(shape), frozenset(vma))

    def emit(self, kind: str, args: list[Var], outs: list[Var], sub: Sub | None = None, **params: Any) -> Var:
        self.ops.append(Op(kind, tuple(args), tuple(outs), params, sub))
        self.used.update(a.id for a in args)
        self.pool.extend(outs)
        return outs[0]

    def emit1(self, kind: str, args: list[Var], shape: tuple[int, ...], vma: frozenset[str], **params: Any) -> Var:
        return self.emit(kind, args, [self.var(shape, vma)], **params)

    def chance(self, p: float) -> bool:
        """True with probability ``p`` (from an integer draw: hypothesis' floats crowd near 0)."""
        return self.rnd.randrange(100) < p * 100

    def pick(self, ok: Callable[[Var], bool], first: Var | None = None) -> Var | None:
        if first is not None:
            return first if ok(first) else None
        cands = [v for v in self.pool if ok(v)]
        if not cands:
            return None
        return cands[-1] if self.chance(0.5) else self.rnd.choice(cands)  # chains of ops, mostly

    def axes(self, exclude: frozenset[str] = frozenset(), prefer: frozenset[str] = frozenset()) -> Axes | None:
        """A collective's axis: one name, or a tuple in random order (so often not the mesh order); often
        only from ``prefer`` when it has some."""
        avail = [a for a in self.names if a not in exclude]
        if any(a in prefer for a in avail) and self.chance(0.5):
            avail = [a for a in avail if a in prefer]
        if not avail:
            return None
        picked = self.rnd.sample(avail, self.rnd.randint(1, len(avail)))
        return picked[0] if len(picked) == 1 and self.chance(0.7) else tuple(picked)

    def n(self, axes: Axes) -> int:
        return math.prod(self.mesh[a] for a in axes_tuple(axes))

    def ordered(self, axes: frozenset[str]) -> Axes:
        t = tuple(a for a in self.names if a in axes)
        return t[0] if len(t) == 1 else t

    def pvary(self, v: Var, axes: frozenset[str]) -> Var:
        return self.emit1("pvary", [v], v.shape, v.vma | axes, axes=self.ordered(axes))

    def agree(self, vs: list[Var], want: frozenset[str]) -> list[Var]:
        """With check_vma=False, what a careful user writes: ``fs.pvary`` on each operand that is invariant
        over an axis of ``want`` (check_vma=True inserts the same itself)."""
        if self.mode == "vma":
            return vs
        return [self.pvary(v, want - v.vma) if want - v.vma else v for v in vs]

    # -- the program -------------------------------------------------------------------------------------
    def gen_inputs(self) -> None:
        """1 to 3 inputs of 0 to 3 dims, each dim replicated or sharded over 1 or 2 axes. (The first choice of
        each draw is the likeliest under hypothesis: two 2-d inputs, dims sharded over one axis.)"""
        for i in range(self.rnd.choice((2, 1, 3))):
            ndim = self.rnd.choice((2, 1, 0, 3))
            local = tuple(self.rnd.choice((2, 3, 1, 4)) for _ in range(ndim))
            free = list(self.names)
            entries: list[Entry] = []
            for _ in range(ndim):
                k = self.rnd.choice((1, 0, 2, 0) if i % 2 else (0, 1, 0, 2)) if free else 0
                picked = self.rnd.sample(free, min(k, len(free)))
                free = [a for a in free if a not in picked]
                entries.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
            while entries and entries[-1] is None:
                entries.pop()
            vma = frozenset(a for e in entries for a in axes_tuple(e))
            v = self.var(local, vma)
            spec = tuple(entries)
            self.inputs.append(Input(v, global_shape(local, spec, self.mesh), spec, self.chance(0.75)))
            self.pool.append(v)

    def step(self, first: Var | None = None) -> bool:
        """Emit one op (reading ``first`` if given); False when none fits."""
        cats = [c for c in self.cats if not (self.depth and c in IN_SUB)]
        if self.depth >= MAX_DEPTH:
            cats = [c for c in cats if c != "transform"]
        # inside a transformed function, collectives twice as often: their transposes and batching are the point
        weight = {**self.weights, "collective": self.weights["collective"] * (2 if self.depth else 1)}
        weighted = [c for c in cats for _ in range(weight[c])]
        for _ in range(12):
            if getattr(self, "op_" + self.rnd.choice(weighted))(first):
                return True
        return first is not None and self.op_elementwise(first, unary=True)

    def gen_outputs(self, error: str | None) -> tuple[tuple[Var, tuple[Entry, ...]], ...]:
        # the values no op read (so that most ops reach an output), the latest first, and at times another
        sinks = [v for v in reversed(self.pool) if v.id not in self.used]
        picked = sinks[: self.rnd.randint(1, 3)]
        if self.chance(0.2):
            other = self.rnd.choice(self.pool)
            if other not in picked:
                picked.append(other)
        if error == "out_spec" and not any(v.vma for v in picked):
            v = picked[0]
            if "axis_index" in self.cats and self.chance(0.5):
                picked[0] = self.op_axis_index(v)
            else:
                picked[0] = self.pvary(v, frozenset({self.rnd.choice(self.names)}))
        picked = [self.emit1("unsqueeze", [v], (1,), v.vma) if v.vma and not v.shape else v for v in picked]
        omit = [None] * len(picked)
        if error == "out_spec":
            k = self.rnd.choice([i for i, v in enumerate(picked) if v.vma])
            omit[k] = self.rnd.choice(sorted(picked[k].vma))
        outputs = []
        for v, o in zip(picked, omit, strict=True):
            spec = self.out_spec(v, o)
            # an axis the spec names but v is invariant over: the output holds copies, and their gradients
            # must be summed (check_vma=True does it; a careful user writes the pvary)
            (v,) = self.agree([v], v.vma | {a for e in spec for a in axes_tuple(e)})
            outputs.append((v, spec))
        return tuple(outputs)

    def out_spec(self, v: Var, omit: str | None) -> tuple[Entry, ...]:
        """Every axis ``v`` varies over (but ``omit``), and ("tiled_out") some it does, each on a random dim."""
        axes = [a for a in self.names if a in v.vma and a != omit]
        if v.shape and "tiled_out" in self.cats:
            axes += [a for a in self.names if a not in v.vma and self.chance(0.25)]
        self.rnd.shuffle(axes)
        per_dim: list[list[str]] = [[] for _ in v.shape]
        for a in axes:
            per_dim[self.rnd.randrange(len(v.shape))].append(a)
        entries = [None if not p else p[0] if len(p) == 1 and self.chance(0.7) else tuple(p) for p in per_dim]
        while entries and entries[-1] is None:
            entries.pop()
        return tuple(entries)

    # -- op categories: each returns the value it wrote, or None when nothing fits ------------------------
    def partner(self, a: Var) -> Var:
        """A second operand for ``a`` (same shape, or 0-dim on one side): mostly one that varies over other
        axes (a 0-dim sum of one when no shape fits), so that invariant and varying values meet."""
        fits = lambda b: b.shape == a.shape or not b.shape or not a.shape  # noqa: E731
        if self.chance(0.7):
            b = self.pick(lambda b: fits(b) and b.vma != a.vma)
            other = None if b else self.pick(lambda b: b.vma != a.vma)
            b = b or (other and self.emit1("sum_all", [other], (), other.vma))
            if b is not None:
                return b
        b = self.pick(fits)
        assert b is not None  # a itself fits
        return b

    def binary(self, kind: str, a: Var, b: Var) -> Var:
        if self.chance(0.5):
            a, b = b, a
        a, b = self.agree([a, b], a.vma | b.vma)
        return self.emit1(kind, [a, b], a.shape or b.shape, a.vma | b.vma)

    def op_elementwise(self, first: Var | None, unary: bool = False) -> Var | None:
        a = self.pick(lambda v: True, first)
        if a is None:
            return None
        if unary or self.chance(0.4):
            return self.emit1(self.rnd.choice(UNARY), [a], a.shape, a.vma)
        return self.binary(self.rnd.choice(BINARY), a, self.partner(a))

    def op_custom(self, first: Var | None) -> Var | None:
        a = self.pick(lambda v: True, first)
        return a and self.binary("custom_mul", a, self.partner(a))

    def op_matmul(self, first: Var | None) -> Var | None:
        a = self.pick(lambda v: len(v.shape) == 2, first)
        b = a and self.pick(lambda b: len(b.shape) == 2 and a.shape[1] in b.shape)
        if a is None or b is None:
            return None
        t = b.shape[1] == a.shape[1] and (b.shape[0] != a.shape[1] or self.chance(0.5))
        shape = (a.shape[0], b.shape[0] if t else b.shape[1])
        a, b = self.agree([a, b], a.vma | b.vma)
        return self.emit1("mm_t" if t else "mm", [a, b], shape, a.vma | b.vma)

    def op_reduce(self, first: Var | None) -> Var | None:
        v = self.pick(lambda v: len(v.shape) >= 1, first)
        if v is None:
            return None
        kind = self.rnd.choice(("sum", "mean", "sum_all"))
        if kind == "sum_all":
            return self.emit1(kind, [v], (), v.vma)
        d = self.rnd.randrange(len(v.shape))
        keep = kind == "sum" and self.chance(0.5)
        shape = tuple(1 if i == d else s for i, s in enumerate(v.shape) if keep or i != d)
        dim = d - len(v.shape) if self.chance(0.3) else d
        return self.emit1(kind, [v], shape, v.vma, dim=dim, **({"keepdim": keep} if kind == "sum" else {}))

    def op_reshape(self, first: Var | None) -> Var | None:
        v = self.pick(lambda v: True, first)
        if v is None:
            return None
        s = v.shape
        kinds = ["unsqueeze"] if len(s) <= 2 else []
        if len(s) >= 2:
            kinds += ["transpose", "flatten"]
        split = [d for d, n in enumerate(s) if n in (4, 6, 8, 9, 12, 16)]
        if split:
            kinds.append("unflatten")
        if not kinds:
            return None
        kind = self.rnd.choice(kinds)
        if kind == "unsqueeze":
            return self.emit1(kind, [v], (1, *s), v.vma)
        if kind == "flatten":
            return self.emit1(kind, [v], (math.prod(s),), v.vma)
        if kind == "transpose":
            d0, d1 = self.rnd.sample(range(len(s)), 2)
            shape = list(s)
            shape[d0], shape[d1] = s[d1], s[d0]
            return self.emit1(kind, [v], tuple(shape), v.vma, dim0=d0, dim1=d1)
        d = self.rnd.choice(split)
        p = self.rnd.choice([p for p in (2, 3, 4) if s[d] % p == 0 and s[d] > p])
        sizes = (p, s[d] // p)
        return self.emit1(kind, [v], (*s[:d], *sizes, *s[d + 1 :]), v.vma, dim=d, sizes=sizes)

    def op_pvary(self, first: Var | None) -> Var | None:
        v = self.pick(lambda v: len(v.vma) < len(self.names), first)
        axes = v and self.axes(exclude=v.vma)
        if v is None or axes is None:
            return None
        return self.emit1("pvary", [v], v.shape, v.vma | set(axes_tuple(axes)), axes=axes)

    def op_axis_index(self, first: Var | None) -> Var | None:
        v = self.pick(lambda v: True, first)
        if v is None:
            return None
        axes = self.axes()
        want = v.vma | set(axes_tuple(axes))
        (v,) = self.agree([v], want)
        return self.emit1(self.rnd.choice(("index_mul", "index_add")), [v], v.shape, want, axes=axes)

    def op_number(self, first: Var | None) -> Var | None:
        v = self.pick(lambda v: True, first)
        if v is None:
            return None
        coll, c, axes = (
            self.rnd.choice((*REDUCING, "all_gather", "ppermute")),
            self.rnd.choice((3.0, 0.5, 2.0)),
            self.axes(),
        )
        if coll in REDUCING:
            return self.emit1("number", [v], v.shape, v.vma, coll=coll, c=c, axes=axes)
        want = v.vma | set(axes_tuple(axes))  # a gathered or sent number varies over the axes, as in JAX
        (v,) = self.agree([v], want)
        if coll == "all_gather":
            return self.emit1("number_gather", [v], v.shape, want, c=c, axes=axes)
        _, params = self.collective_params("ppermute", (), self.n(axes))
        return self.emit1("number_ppermute", [v], v.shape, want, c=c, axes=axes, **params)

    def op_collective(self, first: Var | None) -> Var | None:
        v = self.pick(lambda v: True, first)
        if v is None:
            return None
        kind = self.rnd.choice(
            (*REDUCING, "all_gather", "psum_scatter", "all_to_all", "ppermute", "all_gather_invariant")
        )
        axes = self.axes(prefer=frozenset(self.names) - v.vma)  # often over axes v is invariant over
        n, ax = self.n(axes), frozenset(axes_tuple(axes))
        made = self.collective_params(kind, v.shape, n)
        if made is None:
            return None
        shape, params = made
        if math.prod(shape) > MAX_NUMEL:
            return None
        if self.mode != "lazy":  # a lazy user (check_vma=False) writes no pvary before a collective
            (v,) = self.agree([v], v.vma | ax)
        vma = v.vma - ax if kind in (*REDUCING, "all_gather_invariant") else v.vma | ax
        return self.emit1(kind, [v], shape, vma, axes=axes, **params)

    def collective_params(self, kind: str, s: tuple[int, ...], n: int) -> tuple[tuple[int, ...], dict] | None:
        """The output shape and the params of collective ``kind`` on a ``s``-shaped value over ``n`` devices."""
        rnd, nd = self.rnd, len(s)
        if kind in REDUCING:
            return s, {}
        if kind == "ppermute":
            k = rnd.randint(1, n)
            return s, {"perm": tuple(zip(rnd.sample(range(n), k), rnd.sample(range(n), k)))}
        tiled = nd >= 1 and self.chance(0.6)
        if kind in ("all_gather", "all_gather_invariant"):
            d = rnd.randrange(nd if tiled else nd + 1)
            shape = (*s[:d], s[d] * n, *s[d + 1 :]) if tiled else (*s[:d], n, *s[d:])
            if self.chance(0.3):
                d -= nd if tiled else nd + 1
            return shape, {"dim": d, "tiled": tiled}
        ok = [d for d in range(nd) if (s[d] % n == 0 if tiled else s[d] == n)]
        if not ok:
            return None
        d = rnd.choice(ok)
        if kind == "psum_scatter":
            shape = (*s[:d], s[d] // n, *s[d + 1 :]) if tiled else s[:d] + s[d + 1 :]
            return shape, {"dim": d, "tiled": tiled}
        c = rnd.randrange(nd)
        if tiled:
            mid = [x // n if i == d else x for i, x in enumerate(s)]
            mid[c] *= n
            return tuple(mid), {"split_dim": d, "concat_dim": c, "tiled": True}
        rest = s[:d] + s[d + 1 :]
        return (*rest[:c], n, *rest[c:]), {"split_dim": d, "concat_dim": c, "tiled": False}

    def op_inplace(self, first: Var | None) -> Var | None:
        """``a.clone().add_(b)`` and friends: an in-place op on a fresh tensor."""
        a = self.pick(lambda v: True, first)
        b = a and self.pick(lambda b: b.shape == a.shape or not b.shape)
        if a is None or b is None:
            return None
        kinds = ["iadd_fresh", "imul_fresh"] + (["setitem_fresh"] if a.shape else [])
        want = a.vma | b.vma
        if self.mode == "vma" and want - a.vma:
            if self.chance(0.5):
                a = self.pvary(a, want - a.vma)
            else:
                self.may_raise.append(f"an in-place op makes a copy of {a.name} vary over {sorted(want - a.vma)}")
        a, b = self.agree([a, b], want)
        return self.emit1(self.rnd.choice(kinds), [a, b], a.shape, want)

    def op_inplace_input(self, first: Var | None) -> Var | None:
        """``x.add_(b)`` and friends on an input that does not require grad, before any other use of it."""
        fresh = {i.var.id for i in self.inputs if not i.grad} - self.used
        x = None if first else self.pick(lambda v: v.id in fresh)
        if x is None:
            return None
        kind = self.rnd.choice(("iadd_input", "imul_input", "setitem_input", "iadd1_input"))
        b = self.pick(lambda b: b.id != x.id and (b.shape == x.shape or not b.shape))
        if (kind == "setitem_input" and not x.shape) or b is None:
            kind = "iadd1_input"
        if kind == "iadd1_input":
            self.pool.remove(x)
            return self.emit1(kind, [x], x.shape, x.vma)
        (b,) = self.agree([b], x.vma | b.vma)
        self.pool.remove(x)  # x is changed in place: later ops read the op's result
        return self.emit1(kind, [x, b], x.shape, x.vma | b.vma)

    def op_transform(self, first: Var | None) -> Var | None:
        kind = self.rnd.choice(TRANSFORMS)
        w = self.pick((lambda v: len(v.shape) >= 1) if kind == "vmap" else (lambda v: True), first)
        if w is None:
            return None
        arg = self.var(w.shape[1:] if kind == "vmap" else w.shape, w.vma)
        outer_ops, outer_pool = self.ops, self.pool
        self.ops, self.pool = [], [*outer_pool, arg]
        self.depth += 1
        for i in range(self.rnd.randint(1, 3)):
            self.step(arg if i == 0 else None)
        out = self.ops[-1].outs[0] if self.ops else arg
        sub = Sub(arg, tuple(self.ops), out)
        self.ops, self.pool = outer_ops, outer_pool
        self.depth -= 1
        if kind == "vmap":
            outs = [self.var((w.shape[0], *out.shape), out.vma)]
        elif kind in ("vjp", "jvp"):  # (f(w), cotangent of w) / (f(w), tangent of f(w))
            outs = [
                self.var(out.shape, out.vma),
                self.var(*((w.shape, w.vma) if kind == "vjp" else (out.shape, out.vma))),
            ]
        else:  # grad / grad_and_value: (gradient of w, [sum f(w)])
            outs = [self.var(w.shape, w.vma)] + ([self.var((), out.vma)] if kind == "grad_and_value" else [])
        return self.emit(kind, [w], outs, sub=sub)


def gen_mesh(rnd: random.Random, total: int | None) -> dict[str, int]:
    """1 to 3 axes of sizes 1, 2, 4 with at most 8 devices (exactly ``total`` if given)."""
    names = list(rnd.choice(NAME_SETS))
    k = rnd.randint(1, 3)
    rnd.shuffle(names)
    options = [
        s
        for s in itertools.product((2, 1, 4), repeat=k)
        if (math.prod(s) == total if total else math.prod(s) <= 8) and (k == 1 or max(s) > 1)
    ]
    if not options:
        return gen_mesh(rnd, total)
    return dict(zip(names[:k], rnd.choice(options), strict=True))


def generate(
    rnd: random.Random,
    mode: str,
    *,
    total: int | None = None,
    focus: str | None = None,
    error: str | None = None,
    max_ops: int = 7,
) -> Program:
    """A random program. ``mode``: "vma" (check_vma=True), "careful" (check_vma=False, pvary written where a
    careful user would), "lazy" (check_vma=False, no pvary before collectives: JAX's answer or an error).
    ``focus``: a feature category (see ``FEATURES``): only the core ops and that one, often ("core": the core
    ops alone); None: everything.
    ``error``: None for a valid program; "out_spec" (an output varying over an axis its spec omits) or
    "number" (psum_scatter / all_to_all of a Python number): the call must raise ShardingError."""
    g = Gen(rnd, mode, total, focus)
    g.gen_inputs()
    for _ in range(rnd.randint(2, max_ops)):
        g.step()
    expect = None
    if error == "number":  # a number is a 0-dim value: it has no dim to scatter or split
        v = rnd.choice(g.pool)
        coll = rnd.choice(("psum_scatter", "all_to_all"))
        dims = "split_dim=0, concat_dim=0" if coll == "all_to_all" else "dim=0"
        g.emit1("number_bad", [v], v.shape, v.vma, coll=coll, axes=g.names[0], dims=dims)
        expect = f"fs.{coll} of a Python number"
    outputs = g.gen_outputs(error)
    if error == "out_spec":
        expect = "an output varies over an axis its out_spec omits"
    return Program(
        mesh=g.mesh,
        mode=mode,
        inputs=tuple(g.inputs),
        ops=tuple(g.ops),
        outputs=outputs,
        data_seed=rnd.randrange(2**16),
        may_raise=tuple(g.may_raise),
        expect_error=expect,
    )
