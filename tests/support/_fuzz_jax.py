"""A third interpreter of the fuzzer's programs, in JAX's shard_map: an outside check of the reference.

Used by ``tests/shard_map/test_fuzz_vs_reference.py`` only where jax is installed (``pip install "jax[cpu]"``). JAX is
the model the
reference follows (vma, pvary's transpose, gradients inside the body), so on the programs JAX can run the two
must agree. Left out (:class:`Unsupported`): what JAX does not differentiate (pmax / pmin of a tensor), what
it lacks (all_gather_invariant) or does differently (all_to_all with tiled=False; ppermute over an axis
tuple out of mesh order, whose ``perm`` JAX indexes in mesh order while its axis_index and all_gather follow
the tuple's order).
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _fuzz_program import Op, Program, axes_tuple, global_shape
from jax.sharding import PartitionSpec


class Unsupported(Exception):
    """The program uses something JAX cannot run the same way."""


def _index(axes: Any) -> Any:
    return jax.lax.axis_index(axes_tuple(axes))


def _take0(b: Any) -> Any:
    return b[0] if b.ndim else b


LOCAL = {
    "sin": lambda a: jnp.sin(a),
    "tanh": lambda a: jnp.tanh(a),
    "exp": lambda a: jnp.exp(jnp.tanh(a)),
    "square": lambda a: a * a,
    "scale": lambda a: 1.5 * a,
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (1 + b * b),
    "custom_mul": lambda a, b: a * b,
    "mm": lambda a, b: a @ b,
    "mm_t": lambda a, b: a @ b.T,
    "sum": lambda a, dim, keepdim: a.sum(dim, keepdims=keepdim),
    "mean": lambda a, dim: a.mean(dim),
    "sum_all": lambda a: a.sum(),
    "transpose": lambda a, dim0, dim1: jnp.swapaxes(a, dim0, dim1),
    "flatten": lambda a: a.reshape(-1),
    "unflatten": lambda a, dim, sizes: a.reshape((*a.shape[:dim], *sizes, *a.shape[dim + 1 :])),
    "unsqueeze": lambda a: a[None],
    "iadd_fresh": lambda a, b: a + b,
    "imul_fresh": lambda a, b: a * b,
    "setitem_fresh": lambda a, b: a.at[0].set(_take0(b)),
    "iadd_input": lambda a, b: a + b,
    "imul_input": lambda a, b: a * b,
    "setitem_input": lambda a, b: a.at[0].set(_take0(b)),
    "iadd1_input": lambda a: a + 1.0,
    "index_mul": lambda a, axes: a * (_index(axes) + 1),
    "index_add": lambda a, axes: a + _index(axes),
    "number": lambda a, coll, c, axes: a * getattr(jax.lax, coll)(c, axes_tuple(axes)),
    "number_gather": lambda a, c, axes: a * jax.lax.all_gather(c, axes_tuple(axes)).sum(),
    "number_ppermute": lambda a, c, axes, perm: a * jax.lax.ppermute(jnp.asarray(c), axes_tuple(axes), perm),
}


def _collective(kind: str, x: Any, axes: Any, p: dict[str, Any], mesh_names: tuple[str, ...]) -> Any:
    ax = axes_tuple(axes)
    if kind in ("psum", "pmean"):
        return getattr(jax.lax, kind)(x, ax)
    if kind == "pvary":
        return jax.lax.pcast(x, ax, to="varying")
    if kind == "all_gather":
        dim = p["dim"] % (x.ndim + (0 if p["tiled"] else 1))
        return jax.lax.all_gather(x, ax, axis=dim, tiled=p["tiled"])
    if kind == "psum_scatter":
        return jax.lax.psum_scatter(x, ax, scatter_dimension=p["dim"], tiled=p["tiled"])
    if kind == "all_to_all" and p["tiled"]:
        return jax.lax.all_to_all(x, ax, p["split_dim"], p["concat_dim"], tiled=True)
    if kind == "ppermute" and list(ax) == [a for a in mesh_names if a in ax]:
        return jax.lax.ppermute(x, ax, list(p["perm"]))
    raise Unsupported(f"{kind} {p}")


def _run_ops(ops: tuple[Op, ...], env: dict[int, Any], names: tuple[str, ...]) -> None:
    for op in ops:
        xs = [env[a.id] for a in op.args]
        if op.sub:
            outs = _transform(op, env, names)
        elif op.kind in LOCAL:
            outs = (LOCAL[op.kind](*xs, **op.params),)
        else:  # JAX wants the pvary that funcshard inserts before a collective over an invariant axis
            params = {k: v for k, v in op.params.items() if k != "axes"}
            missing = tuple(a for a in axes_tuple(op.params["axes"]) if a not in op.args[0].vma)
            x = jax.lax.pcast(xs[0], missing, to="varying") if missing and op.kind != "pvary" else xs[0]
            outs = (_collective(op.kind, x, op.params["axes"], params, names),)
        for v, val in zip(op.outs, outs, strict=True):
            env[v.id] = val


def _transform(op: Op, env: dict[int, Any], names: tuple[str, ...]) -> tuple[Any, ...]:
    sub = op.sub
    assert sub is not None

    def f(w: Any) -> Any:
        inner = {**env, sub.arg.id: w}
        _run_ops(sub.ops, inner, names)
        return inner[sub.out.id]

    w = env[op.args[0].id]
    if op.kind == "grad":
        return (jax.grad(lambda w: f(w).sum())(w),)
    if op.kind == "grad_and_value":
        v, g = jax.value_and_grad(lambda w: f(w).sum())(w)
        return g, v
    if op.kind == "vjp":
        out, pull = jax.vjp(f, w)
        return out, pull(jnp.cos(out))[0]
    if op.kind == "jvp":
        return jax.jvp(f, (w,), (jnp.cos(w),))
    return (jax.vmap(f)(w),)


def jax_result(prog: Program, xs: list[torch.Tensor], cts: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """The program's outputs and the gradients of ``sum(out * ct)`` (None where an input needs none), by JAX.

    Raises:
        Unsupported: the program uses something JAX runs differently (see the module docstring).
    """
    names = tuple(prog.mesh)
    if len(jax.devices()) < max(8, len(prog.mesh)):
        raise Unsupported("jax was imported before XLA_FLAGS asked for 8 host devices")
    mesh = jax.make_mesh(tuple(prog.mesh.values()), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))

    def body(*args: Any) -> tuple[Any, ...]:
        env = {i.var.id: x for i, x in zip(prog.inputs, args, strict=True)}
        _run_ops(prog.ops, env, names)
        return tuple(env[v.id] for v, _ in prog.outputs)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(PartitionSpec(*i.spec) for i in prog.inputs),
        out_specs=tuple(PartitionSpec(*e) for _, e in prog.outputs),
    )
    wrt = [k for k, i in enumerate(prog.inputs) if i.grad]
    for (v, e), t in zip(prog.outputs, cts, strict=True):
        assert tuple(t.shape) == global_shape(v.shape, e, prog.mesh)
    with jax.enable_x64(True), jax.set_mesh(mesh):  # float64 here only: other users of jax keep their config
        args = [jnp.asarray(x.numpy()) for x in xs]
        c = [jnp.asarray(t.numpy()) for t in cts]
        outs = f(*args)

        def loss(*a: Any) -> Any:
            return sum(((o * t).sum() for o, t in zip(f(*a), c, strict=True)), jnp.zeros(()))

        gs = jax.grad(loss, argnums=tuple(wrt))(*args) if wrt else ()
    grads: list[Any] = [None] * len(prog.inputs)
    for k, g in zip(wrt, gs, strict=True):
        grads[k] = torch.from_numpy(np.array(g))
    return [torch.from_numpy(np.array(o)) for o in outs], grads
