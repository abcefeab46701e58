"""The language of the fuzzer's programs (``tests/shard_map/test_fuzz_vs_reference.py``): values, ops, programs, and
their listing.

A :class:`Program` is data: a mesh, inputs (global shape, spec, requires_grad), ops in SSA form and outputs with
their out_specs. Each op kind is a Python expression over its operands (:data:`TEMPLATES`); a transform op
(grad, vjp, grad_and_value, jvp, vmap) applies a :class:`Sub` function. A program's ``repr`` is its listing: the
shard_map body and call as Python code, so a failing example reads as the program that ran.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

Axes = str | tuple[str, ...]
Entry = None | str | tuple[str, ...]


def axes_tuple(axes: Axes | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


# --------------------------------------------------------------------------------------------------------
# The user code the programs call: a custom autograd Function, and an indexed assignment helper
# --------------------------------------------------------------------------------------------------------


class Mul(torch.autograd.Function):
    """A user's custom op: forward ``a * b``, backward ``(g * b, g * a)`` (with jvp and vmap for torch.func)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        return ta * b + a * tb


def setitem0(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``t[0] = v[0]`` (or ``= v`` for a 0-dim ``v``), in place; returns ``t``."""
    t[0] = v[0] if v.dim() else v
    return t


# --------------------------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Var:
    """A value of the program: its local (per-device) shape and the mesh axes it varies over."""

    id: int
    shape: tuple[int, ...]
    vma: frozenset[str]

    @property
    def name(self) -> str:
        return f"v{self.id}"


@dataclass(frozen=True)
class Input:
    var: Var
    shape: tuple[int, ...]  # global
    spec: tuple[Entry, ...]
    grad: bool


@dataclass(frozen=True)
class Sub:
    """The function a transform applies: argument ``arg``, body ``ops`` (reading outer values too), ``out``."""

    arg: Var
    ops: tuple[Op, ...]
    out: Var


@dataclass(frozen=True)
class Op:
    kind: str
    args: tuple[Var, ...]
    outs: tuple[Var, ...]
    params: dict[str, Any] = field(default_factory=dict)
    sub: Sub | None = None


@dataclass(frozen=True)
class Program:
    mesh: dict[str, int]
    mode: str  # "vma" (check_vma=True), "careful" (False, pvary written), "lazy" (False, none before collectives)
    inputs: tuple[Input, ...]
    ops: tuple[Op, ...]
    outputs: tuple[tuple[Var, tuple[Entry, ...]], ...]
    data_seed: int
    may_raise: tuple[str, ...] = ()  # why a ShardingError is an acceptable answer
    expect_error: str | None = None  # why the call must raise ShardingError

    @property
    def check_vma(self) -> bool:
        return self.mode == "vma"

    @property
    def kinds(self) -> set[str]:
        """Every op kind in the program (subprograms included)."""
        out: set[str] = set()
        todo = list(self.ops)
        while todo:
            op = todo.pop()
            out.add(op.kind)
            if op.sub:
                todo.extend(op.sub.ops)
        return out

    def __repr__(self) -> str:
        return listing(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # how hypothesis prints a falsifying example
        p.text(listing(self))


def spec_src(entries: tuple[Entry, ...]) -> str:
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


def spec_axes(entries: tuple[Entry, ...]) -> list[tuple[str, ...]]:
    return [axes_tuple(e) for e in entries]


def global_shape(shape: tuple[int, ...], entries: tuple[Entry, ...], mesh: dict[str, int]) -> tuple[int, ...]:
    dims = spec_axes(entries) + [()] * (len(shape) - len(entries))
    return tuple(s * math.prod(mesh[a] for a in d) for s, d in zip(shape, dims, strict=True))


# --------------------------------------------------------------------------------------------------------
# Op kinds: each is a Python expression over its operands {0}, {1}, ... and its params. The funcshard run
# evaluates it with ``fs`` = funcshard; the reference evaluates the per-device ones with ``fs`` = a
# :class:`RefDevice`, and runs the collectives with the list functions below.
# --------------------------------------------------------------------------------------------------------

LOCAL = {
    "sin": "torch.sin({0})",
    "tanh": "torch.tanh({0})",
    "exp": "torch.exp(torch.tanh({0}))",
    "square": "{0} * {0}",
    "scale": "1.5 * {0}",
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / (1 + {1} * {1})",
    "custom_mul": "Mul.apply({0}, {1})",
    "mm": "{0} @ {1}",
    "mm_t": "{0} @ {1}.mT",
    "sum": "{0}.sum({dim}, keepdim={keepdim})",
    "mean": "{0}.mean({dim})",
    "sum_all": "{0}.sum()",
    "transpose": "{0}.transpose({dim0}, {dim1})",
    "flatten": "{0}.reshape(-1)",
    "unflatten": "{0}.unflatten({dim}, {sizes})",
    "unsqueeze": "{0}.unsqueeze(0)",
    "iadd_fresh": "{0}.clone().add_({1})",
    "imul_fresh": "{0}.clone().mul_({1})",
    "setitem_fresh": "setitem0({0}.clone(), {1})",
    "iadd_input": "{0}.add_({1})",
    "imul_input": "{0}.mul_({1})",
    "setitem_input": "setitem0({0}, {1})",
    "iadd1_input": "{0}.add_(1.0)",
    "index_mul": "{0} * (fs.axis_index({axes!r}) + 1)",
    "index_add": "{0} + fs.axis_index({axes!r})",
    "number": "{0} * fs.{coll}({c}, {axes!r})",
    "number_gather": "{0} * fs.all_gather({c}, {axes!r}).sum()",
    "number_ppermute": "{0} * fs.ppermute({c}, {axes!r}, {perm!r})",
    "number_bad": "{0} * fs.{coll}(2.0, {axes!r}, {dims})",
}

COLLECTIVE = {
    "psum": "fs.psum({0}, {axes!r})",
    "pmean": "fs.pmean({0}, {axes!r})",
    "pmax": "fs.pmax({0}, {axes!r})",
    "pmin": "fs.pmin({0}, {axes!r})",
    "pvary": "fs.pvary({0}, {axes!r})",
    "all_gather": "fs.all_gather({0}, {axes!r}, dim={dim}, tiled={tiled})",
    "all_gather_invariant": "fs.lax.all_gather_invariant({0}, {axes!r}, dim={dim}, tiled={tiled})",
    "psum_scatter": "fs.psum_scatter({0}, {axes!r}, dim={dim}, tiled={tiled})",
    "all_to_all": "fs.all_to_all({0}, {axes!r}, {split_dim}, {concat_dim}, tiled={tiled})",
    "ppermute": "fs.ppermute({0}, {axes!r}, {perm!r})",
}

TEMPLATES = {**LOCAL, **COLLECTIVE}


@functools.lru_cache(maxsize=4096)
def _compiled(src: str) -> Any:
    return compile(src, "<fuzz op>", "eval")


def evaluate(op: Op, values: list[Any], fs_ns: Any) -> Any:
    src = TEMPLATES[op.kind].format(*(f"_{i}" for i in range(len(values))), **op.params)
    ns = {"torch": torch, "fs": fs_ns, "Mul": Mul, "setitem0": setitem0}
    return eval(_compiled(src), ns, {f"_{i}": v for i, v in enumerate(values)})


# --------------------------------------------------------------------------------------------------------
# The listing (a Program's repr)
# --------------------------------------------------------------------------------------------------------


# a transform op as code: ``f`` is its function, ``w`` its argument
TRANSFORM_CALLS = {
    "grad": "{outs} = torch.func.grad(lambda w: {f}(w).sum())({w})",
    "grad_and_value": "{outs} = torch.func.grad_and_value(lambda w: {f}(w).sum())({w})",
    "vjp": "{o0}, pull = torch.func.vjp({f}, {w}); {o1} = pull(torch.cos({o0}))[0]",
    "jvp": "{outs} = torch.func.jvp({f}, ({w},), (torch.cos({w}),))",
    "vmap": "{outs} = torch.vmap({f})({w})",
}


def _vma_src(v: Var, names: tuple[str, ...]) -> str:
    return "{" + ", ".join(a for a in names if a in v.vma) + "}"


def _op_lines(ops: tuple[Op, ...], indent: str, names: tuple[str, ...]) -> list[str]:
    lines = []
    for op in ops:
        outs = ", ".join(v.name for v in op.outs)
        note = "  # " + "; ".join(f"{v.name}: {v.shape} varies over {_vma_src(v, names)}" for v in op.outs)
        if op.sub is None:
            code = f"{outs} = " + TEMPLATES[op.kind].format(*(a.name for a in op.args), **op.params)
            lines.append(f"{indent}{code:<56}{note}")
            continue
        sub, w, f = op.sub, op.args[0].name, f"f{op.outs[0].id}"
        lines.append(f"{indent}def {f}({sub.arg.name}):  # {sub.arg.shape} varies over {_vma_src(sub.arg, names)}")
        lines += _op_lines(sub.ops, indent + "    ", names)
        lines.append(f"{indent}    return {sub.out.name}")
        o = [v.name for v in op.outs] + [""]
        call = TRANSFORM_CALLS[op.kind].format(outs=outs, o0=o[0], o1=o[1], f=f, w=w)
        lines.append(f"{indent}{call:<56}{note}")
    return lines


def listing(prog: Program) -> str:
    names = tuple(prog.mesh)
    ins = ", ".join(i.var.name for i in prog.inputs)
    lines = [
        f"# mode={prog.mode!r}  data_seed={prog.data_seed}"
        + (f"  expect ShardingError: {prog.expect_error}" if prog.expect_error else "")
        + (f"  may raise ShardingError: {'; '.join(prog.may_raise)}" if prog.may_raise else ""),
        f"mesh = fs.make_mesh({prog.mesh!r}, backend='sim')",
        f"def body({ins}):  # "
        + "; ".join(f"{i.var.name}: {i.var.shape} varies over {_vma_src(i.var, names)}" for i in prog.inputs),
        *_op_lines(prog.ops, "    ", names),
        f"    return ({''.join(v.name + ', ' for v, _ in prog.outputs)})",
        f"f = fs.shard_map(body, mesh=mesh, in_specs=({''.join(spec_src(i.spec) + ', ' for i in prog.inputs)}), "
        f"out_specs=({''.join(spec_src(e) + ', ' for _, e in prog.outputs)}), check_vma={prog.check_vma})",
        "# called on float64 "
        + ", ".join(f"{i.var.name}: {i.shape}{' (grad)' if i.grad else ''}" for i in prog.inputs),
    ]
    return "\n".join(lines)
