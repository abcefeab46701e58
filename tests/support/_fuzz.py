"""Running the fuzzer's programs (``tests/shard_map/test_fuzz_vs_reference.py``): under funcshard, against the
reference.

- :func:`run_funcshard` is a program's shard_map body: one device, local shards, funcshard's collectives.
- :func:`reference_result` / :func:`funcshard_result`: a program's outputs and the gradients of
  ``sum(out * ct)`` with respect to its inputs, from its data seed; :func:`differences` compares two.
- :class:`Isolated`: a worker process that runs programs under ``"sim"``, so that a crash or a hang inside
  funcshard fails that one program instead of the whole test session.
- :func:`dist_body`: a program on a gloo worker, rebuilt from its seed (only ints cross the process boundary).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import random
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from _fuzz_gen import generate
from _fuzz_program import Op, Program, evaluate, global_shape
from _fuzz_ref import RefMesh, block, run_reference

import funcshard as fs

# --------------------------------------------------------------------------------------------------------
# The funcshard run: the shard_map body
# --------------------------------------------------------------------------------------------------------


def run_funcshard(prog: Program, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The body of the program's shard_map: local shards in, local outputs out."""
    env = {inp.var.id: x for inp, x in zip(prog.inputs, xs, strict=True)}
    _run_fs_ops(prog.ops, env)
    return tuple(env[v.id] for v, _ in prog.outputs)


def _run_fs_ops(ops: tuple[Op, ...], env: dict[int, Any]) -> None:
    for op in ops:
        outs = _fs_transform(op, env) if op.sub else (evaluate(op, [env[a.id] for a in op.args], fs),)
        for v, val in zip(op.outs, outs, strict=True):
            env[v.id] = val


def _fs_transform(op: Op, env: dict[int, Any]) -> tuple[torch.Tensor, ...]:
    sub = op.sub
    assert sub is not None

    def f(w: torch.Tensor) -> torch.Tensor:
        inner = {**env, sub.arg.id: w}
        _run_fs_ops(sub.ops, inner)
        return inner[sub.out.id]

    w = env[op.args[0].id]
    if op.kind == "grad":
        return (torch.func.grad(lambda w: f(w).sum())(w),)
    if op.kind == "grad_and_value":
        return torch.func.grad_and_value(lambda w: f(w).sum())(w)
    if op.kind == "vjp":
        out, pull = torch.func.vjp(f, w)
        return out, pull(torch.cos(out))[0]
    if op.kind == "jvp":
        return torch.func.jvp(f, (w,), (torch.cos(w),))
    return (torch.vmap(f)(w),)


# --------------------------------------------------------------------------------------------------------
# Running a program both ways
# --------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    outs: list[torch.Tensor]
    grads: list[torch.Tensor | None]  # one per input (None: the input does not require grad)
    mutated: list[str] = field(default_factory=list)  # inputs the call changed


def make_data(prog: Program) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The inputs' full values and the output cotangents, from the program's data seed."""
    gen = torch.Generator().manual_seed(prog.data_seed)
    xs = [torch.randn(i.shape, generator=gen, dtype=torch.float64) for i in prog.inputs]
    cts = [
        torch.randn(global_shape(v.shape, e, prog.mesh), generator=gen, dtype=torch.float64) for v, e in prog.outputs
    ]
    return xs, cts


def _leaves(prog: Program, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone().requires_grad_(i.grad) for i, x in zip(prog.inputs, xs, strict=True)]


def _grads(prog: Program, outs: list[torch.Tensor], cts: list[torch.Tensor], ins: list[torch.Tensor]) -> list[Any]:
    """The gradient of ``sum(out * ct)`` with respect to each input that requires grad."""
    loss = sum(((o * c).sum() for o, c in zip(outs, cts, strict=True)), torch.zeros((), dtype=torch.float64))
    wrt = [x for x in ins if x.requires_grad]
    gs = list(torch.autograd.grad(loss, wrt, allow_unused=True)) if wrt and loss.requires_grad else [None] * len(wrt)
    by_id = {id(x): torch.zeros_like(x) if g is None else g for x, g in zip(wrt, gs, strict=True)}
    return [by_id.get(id(x)) for x in ins]


def reference_result(prog: Program) -> Result:
    xs, cts = make_data(prog)
    ins = _leaves(prog, xs)
    outs = run_reference(prog, ins)
    return Result([o.detach() for o in outs], _grads(prog, outs, cts, ins))


def funcshard_result(prog: Program, mesh: fs.Mesh) -> Result:
    """The program under fs.shard_map on ``mesh`` (outputs gathered with device_get; under "dist" the gradients
    are this process's)."""
    xs, cts = make_data(prog)
    ins = _leaves(prog, xs)
    f = fs.shard_map(
        functools.partial(run_funcshard, prog),
        mesh=mesh,
        in_specs=tuple(fs.P(*i.spec) for i in prog.inputs),
        out_specs=tuple(fs.P(*e) for _, e in prog.outputs),
        check_vma=prog.check_vma,
    )
    outs = [fs.device_get(a) for a in f(*ins)]
    grads = _grads(prog, outs, cts, ins)
    mutated = [i.var.name for i, x, x0 in zip(prog.inputs, ins, xs, strict=True) if not torch.equal(x.detach(), x0)]
    return Result([o.detach() for o in outs], [g if g is None else g.detach() for g in grads], mutated)


def finite(res: Result, bound: float = 1e9) -> bool:
    """True when every output and gradient is finite and below ``bound`` (else the comparison says little)."""
    ts = [*res.outs, *(g for g in res.grads if g is not None)]
    return all(bool(torch.isfinite(t).all()) and (t.numel() == 0 or t.abs().max() < bound) for t in ts)


def differences(prog: Program, want: Result, got: Result, rtol: float = 1e-7) -> list[str]:
    """What differs between two results of ``prog``, one line each (empty: they agree)."""
    problems = [f"the call changed its argument {name}" for name in got.mutated]

    def close(what: str, w: torch.Tensor, g: torch.Tensor) -> None:
        if tuple(w.shape) != tuple(g.shape):
            problems.append(f"{what}: shape {tuple(g.shape)}, expected {tuple(w.shape)}")
            return
        scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
        err = float((w - g).abs().max()) if w.numel() else 0.0
        if not err <= rtol * scale:
            problems.append(f"{what}: max abs error {err:.3g} (scale {scale:.3g})\n  expected {w}\n  got      {g}")

    for (v, _), w, g in zip(prog.outputs, want.outs, got.outs, strict=True):
        close(f"output {v.name}", w, g)
    for i, w, g in zip(prog.inputs, want.grads, got.grads, strict=True):
        if w is not None:
            close(f"gradient of {i.var.name}", w, g)
    return problems


# --------------------------------------------------------------------------------------------------------
# The dist sample: bodies that only receive ints
# --------------------------------------------------------------------------------------------------------


def dist_program(seed: int, mode: str, total: int) -> Program:
    return generate(random.Random(seed), mode, total=total)


def dist_body(mesh: fs.Mesh, seed: int, mode: str) -> dict[str, Any]:
    """Run on every gloo worker: rebuild the program from its seed and run it on this process's device."""
    prog = dist_program(seed, mode, mesh.size)
    try:
        res = funcshard_result(prog, mesh)
    except fs.ShardingError as e:
        return {"listing": repr(prog), "error": str(e)}
    return {"listing": repr(prog), "outs": res.outs, "grads": res.grads, "mutated": res.mutated}


def assemble_dist_grads(prog: Program, per_rank: list[list[torch.Tensor | None]]) -> tuple[list[Any], list[str]]:
    """The global gradient of each input from the processes' own blocks (and where replicas disagree)."""
    rm = RefMesh(prog.mesh)
    out: list[Any] = []
    problems = []
    for k, inp in enumerate(prog.inputs):
        if not inp.grad:
            out.append(None)
            continue
        full = torch.zeros(inp.shape, dtype=torch.float64)
        seen: dict[tuple, torch.Tensor] = {}
        for r, grads in enumerate(per_rank):
            sl = block(inp.shape, inp.spec, rm, r)
            key = tuple((s.start, s.stop) for s in sl)
            g = grads[k][sl]
            if key in seen and not torch.allclose(seen[key], g, rtol=1e-9, atol=1e-12):
                problems.append(f"gradient of {inp.var.name}: replicas of block {key} differ between processes")
            seen.setdefault(key, g)
            full[sl] = seen[key]
        out.append(full)
    return out, problems


# --------------------------------------------------------------------------------------------------------
# Isolation: programs under sim in a worker process
# --------------------------------------------------------------------------------------------------------


class Isolated:
    """A worker process that runs programs under ``"sim"``: a crash (torch aborts on some races between the
    device threads) or a hang there fails only the program it was running. Started on first use, and again
    after a crash, a hang, or a program that left torch's process-wide forward-AD state behind."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self.proc: Any = None
        self.conn: Any = None

    def run(self, prog: Program) -> Result:
        """``funcshard_result(prog)`` under sim, computed in the worker.

        Raises:
            fs.ShardingError: as the program raised it there.
            AssertionError: any other error there (with its traceback), a crash, or no answer in time.
        """
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(prog)
        if not self.conn.poll(self.timeout):
            self.stop()
            raise AssertionError(f"funcshard did not finish the program within {self.timeout:.0f} s (a hang?)")
        try:
            kind, value, clean = self.conn.recv()
        except EOFError:
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            self.stop()
            raise AssertionError(f"the process running the program died (exit code {code}): a crash") from None
        if not clean:
            self.stop()
        if kind == "ok":
            return value
        if kind == "sharding_error":
            raise fs.ShardingError(value)
        raise AssertionError(f"funcshard raised, in the worker process:\n{value}")

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, list(sys.path), torch.get_num_threads()), daemon=True)
        self.proc.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(timeout=5)
        self.proc = self.conn = None


def _serve(conn: Any, sys_path: list[str], threads: int) -> None:
    sys.path[:] = sys_path
    torch.set_num_threads(threads)
    from torch._functorch import eager_transforms
    from torch.autograd import forward_ad

    while True:
        prog = conn.recv()
        try:
            answer: tuple[str, Any] = ("ok", funcshard_result(prog, fs.make_mesh(prog.mesh, backend="sim")))
        except fs.ShardingError as e:
            answer = ("sharding_error", str(e))
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the program with it
            answer = ("error", traceback.format_exc())
        clean = forward_ad._current_level == -1 and eager_transforms.JVP_NESTING == 0
        conn.send((*answer, clean))
