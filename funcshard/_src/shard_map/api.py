"""``shard_map``: run a function once per device on local shards, with named-axis collectives inside.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")
    >>> @fs.shard_map(mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P("dp", "tp"))
    ... def f(w, x):
    ...     return x @ w  # [b/dp, d] @ [d, h/tp] -> [b/dp, h/tp]
    >>> w, x = torch.randn(3, 4), torch.randn(2, 3)
    >>> torch.allclose(fs.device_get(f(w, x)), x @ w)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree

from ..arrays.array import Array, is_array
from ..collectives.vma import clear_vma
from ..errors import ShardingError
from ..runtime.context import maybe_current, settle_module, take_uneven, transforms_active
from ..runtime.mesh import Mesh
from ..tree.shapes import to_meta
from .compile import CompiledBody, compile_options, eager_body, opaque_to_dynamo, warn_sim
from .executor import DeviceBody, audit_env, executor_for, run_local
from .io import InputCache, Inputs, assemble_one, assemble_outputs, check_structures, donated_blocks
from .lower import Lowered, lower, roles_of
from .replicas import maybe_check_replicas

__all__ = ["shard_map"]

PyTree = Any


def shard_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    donate: int | tuple[int, ...] = (),
    compile: bool | dict[str, Any] = False,
) -> Callable[..., Any]:
    """Map ``f`` over the devices of ``mesh``: each device runs ``f`` on its local shards.

    Args:
        f: a function of local shards (plain torch.Tensors); collectives inside name mesh axes.
        mesh: the mesh.
        in_specs: a tuple with one spec (or spec-tree prefix) per positional argument.
        out_specs: a spec tree (prefix) for the output.
        check_vma: track which axes each value varies over, insert ``pvary`` where an invariant value meets
            a varying one (so gradients are those of the global function), and check that outputs are
            invariant over the axes their spec omits. ``False``: no tracking, write ``fs.pvary`` yourself.
        donate: positions of arguments whose ``fs.Array``s the call may consume, as JAX's ``donate_argnums``:
            their blocks are handed to ``f`` without a copy, so ``f`` may write results into them in place
            (``fs.optim``'s updates do: a step then holds one copy of the params and moments), and the Arrays
            are deleted after the call (using one again raises). Blocks that are views or shared (the first
            ``device_put`` of a tensor) are copied on write instead; plain tensors are never written.
        compile: under ``"dist"``, record each device's body once per input signature into one graph of torch ops
            (the vma tracking, pytrees and checks run then, once; the collectives are ops of the graph) and run it
            through ``torch.compile`` with no graph break; ``True``, or a dict of ``torch.compile`` options
            (``backend``, ``mode``, ``options``, ``fullgraph``, ``dynamic``). As ``jax.jit``, Python state is frozen
            at the recording, except the numbers, strings and flags the body reads from closures and module globals:
            a changed one records it again (one warning); reading a tensor's value in Python (``int(x)``) raises.
            Not differentiable from outside (take the gradients inside, as a train step does). Under ``"sim"``
            ignored with a warning: simulated devices are threads that meet in Python, which a compiled graph cannot
            hold. (``torch.compile`` around the returned function runs it eagerly, a graph break; a
            ``torch.compile``'d ``f`` under ``check_vma`` runs eagerly with a warning: dynamo cannot trace the
            tracking.)

    Returns:
        A function of global values (``fs.Array``s, or plain tensors taken as the full value) returning
        ``fs.Array``s laid out by ``out_specs``. Usable as a decorator.

    Raises:
        ShardingError: specs that do not fit the arguments or outputs (path, shape, spec, mesh named), or a
            ``compile`` value that is not a bool or a dict of ``torch.compile`` options.

    Example:
        >>> g = shard_map(lambda x: fs.psum(x, "dp"), mesh=mesh, in_specs=(P("dp"),), out_specs=P())  # doctest: +SKIP
    """
    if f is None:
        return lambda g: shard_map(
            g, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, donate=donate, compile=compile
        )
    if not callable(f):
        raise ShardingError(f"shard_map: expected a function as first argument, found {type(f).__name__}.")
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"shard_map: mesh must be an fs.Mesh from fs.make_mesh, found {type(mesh).__name__}.")

    donated, cache, options = _donate_argnums(donate), InputCache(), compile_options(compile)
    name = f"shard_map({getattr(f, '__name__', 'f')})"
    settle_module(f)  # (no first read of its module's annotations on sim's device threads: CPython 3.11)
    f = eager_body(f, name, bool(check_vma))
    compiled = CompiledBody(name, options) if options is not None and mesh.is_multiprocess else None  # (dist's)
    check = bool(check_vma)
    local = options is None and not donated and mesh.is_multiprocess  # one device, no compile, no donation

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        if local and maybe_current() is None and not transforms_active():  # _call's common step, one frame less
            sig, leaves = cache.signature(name, mesh, in_specs, args)
            if not sig.resharded and not audit_env():
                return _run_local(name, f, mesh, out_specs, check, sig, leaves, cache)
            return _run(name, f, mesh, out_specs, check, cache.inputs(mesh, sig, leaves), cache, None)
        if options is not None and compiled is None:
            warn_sim(name, id(mapped))
        return _call(f, mesh, in_specs, out_specs, check, args, cache, donated, compiled, name)

    out = opaque_to_dynamo(mapped, name, tell=options is None and mesh.is_multiprocess)
    out.lower = _lowering(f, mesh, in_specs, out_specs, check, donate, name)  # type: ignore[attr-defined]
    return out


def _lowering(
    f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any, check: bool, donate: Any, name: str
) -> Callable[..., Lowered]:
    """The ``lower`` of a shard_map'd function: its ahead-of-time analysis for given arguments (real or abstract),
    run on the same function over the abstract twin of ``mesh`` (see ``Lowered``)."""

    def twin(on: Mesh) -> Callable[..., Any]:  # the same function on another mesh
        return shard_map(f, mesh=on, in_specs=in_specs, out_specs=out_specs, check_vma=check, donate=donate)

    def lower_(*args: Any) -> Lowered:
        """This function's ahead-of-time analysis for ``args``: ``.cost_analysis()``, ``.memory_analysis()``."""
        return lower(twin, mesh, name, args, roles_of(args))

    return lower_


def _call(
    f: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool,
    args: tuple[Any, ...],
    cache: InputCache,
    donate: tuple[int, ...] = (),
    compiled: CompiledBody | None = None,
    name: str | None = None,
) -> Any:
    """prepare (check and cut the arguments) -> run (on the backend's executor) -> assemble (the outputs)."""
    if name is None:
        name = f"shard_map({getattr(f, '__name__', 'f')})"
    if maybe_current() is not None:
        raise ShardingError(
            f"{name}: called inside another shard_map; nesting is not supported. Call the inner function "
            f"directly on the local shards, using collectives for communication."
        )
    if transforms_active():  # (sim: the devices' threads are outside the transform, jvp gave a zero tangent)
        raise ShardingError(
            f"{name}: called inside a torch.func transform (grad / vjp / jvp / vmap) from outside shard_map, "
            f"which does not reach the devices' computation. Differentiate from outside with torch.autograd "
            f"(loss.backward(), torch.autograd.grad) or torch.autograd.forward_ad, or fs.value_and_grad; or "
            f"apply the torch.func transform inside f, on the local shards."
        )
    if not mesh.backend_impl.holds_data:  # an abstract mesh: fs.ShapeDtype leaves (and tensors) as meta tensors
        args = optree.tree_map(to_meta, args, is_leaf=is_array)
    if not donate and compiled is None and mesh.is_multiprocess:  # the common step: one device, no donation
        sig, leaves = cache.signature(name, mesh, in_specs, args)
        if not sig.resharded and not audit_env():
            return _run_local(name, f, mesh, out_specs, check_vma, sig, leaves, cache)
        return _run(name, f, mesh, out_specs, check_vma, cache.inputs(mesh, sig, leaves), cache, compiled)
    inputs = cache.prepare(name, mesh, in_specs, args)
    if donate:
        inputs.donated = donated_blocks(name, args, donate)
        try:
            return _run(name, f, mesh, out_specs, check_vma, inputs, cache, compiled)
        finally:  # consumed, whether or not the call got through (its blocks may be half written)
            why = f"donated to {name} (donate={donate})"
            for i in donate:
                for leaf in optree.tree_leaves(args[i]):  # (an Array is a leaf: no pytree node of optree's)
                    if isinstance(leaf, Array):
                        leaf.delete(why)
    return _run(name, f, mesh, out_specs, check_vma, inputs, cache, compiled)


def _run_local(
    name: str,
    f: Callable[..., Any],
    mesh: Mesh,
    out_specs: Any,
    check_vma: bool,
    sig: Any,
    leaves: list[Any],
    cache: InputCache,
) -> Any:
    """:func:`_run` of a ``"dist"`` call that reshards nothing and donates nothing, from the arguments' leaves
    and signature (``run_local``): the same steps, without the per-argument lists of blocks in between."""
    executor = cache.executor
    if executor is None or executor.stale():
        executor = cache.executor = executor_for(mesh)

    def device_plan(out_def: Any, out_leaves: list[Any]) -> Any:  # the outputs' specs
        return cache.out_plan(name, mesh, out_specs, out_def, out_leaves)

    body = DeviceBody(f, mesh, check_vma, None, device_plan, audit=False)  # type: ignore[arg-type]
    try:
        take_uneven()  # (a note a call that raised left behind is not this call's)
        out_leaves, out_def = run_local(body, executor, sig, leaves, cache)
        try:
            found = body.out_plan  # (the plan the outputs' pvarys were made by, where they were)
            if found is not None and found[0] is out_def:
                plan = found[1]
            else:
                plan = cache.out_plan(name, mesh, out_specs, out_def, out_leaves)
            if not check_vma:  # the outputs called replicated are: once per output signature (see _replicas)
                maybe_check_replicas(name, mesh, check_vma, plan, out_leaves, executor.device)
            noted = take_uneven() or sig.uneven
            due = not noted and cache.exchange_due(mesh, plan)  # (blocks that differ although no input did)
            out = assemble_one(  # (tags cleared)
                name, mesh, plan, check_vma, executor.coords[0], out_leaves, uneven=noted or due
            )
            if due:
                cache.saw_shapes(plan, out)
            return out_def.unflatten(out)  # (optree.tree_unflatten's own call)
        except BaseException:
            clear_vma(out_leaves)
            raise
    finally:  # tags are only meaningful during this call: none may leak into a later one
        clear_vma(body.tagged)


def _donate_argnums(donate: int | tuple[int, ...]) -> tuple[int, ...]:
    items = (donate,) if isinstance(donate, int) else donate
    if not isinstance(items, (tuple, list)) or not all(isinstance(i, int) and i >= 0 for i in items):
        raise ShardingError(
            f"shard_map: donate must be an argument position or a tuple of them (JAX's donate_argnums), "
            f"found {donate!r}; e.g. donate=(0, 1) to donate the params and the optimiser state."
        )
    return tuple(sorted(set(items)))


def _run(
    name: str,
    f: Callable[..., Any],
    mesh: Mesh,
    out_specs: Any,
    check_vma: bool,
    inputs: Inputs,
    cache: InputCache,
    compiled: CompiledBody | None = None,
) -> Any:
    executor = cache.executor  # (a cache serves one shard_map'd function: one mesh)
    if executor is None or (mesh.is_multiprocess and executor.stale()):
        executor = cache.executor = executor_for(mesh)

    def plan(results: list[Any]) -> Any:
        out_def = results[0][1] if len(results) == 1 else check_structures(name, executor.coords, results)
        return cache.out_plan(name, mesh, out_specs, out_def, results[0][0])

    def device_plan(out_def: Any, leaves: list[Any]) -> Any:  # one device's outputs: their specs
        return cache.out_plan(name, mesh, out_specs, out_def, leaves)

    body = DeviceBody(f, mesh, check_vma, inputs, device_plan)
    body.compiled = compiled

    take_uneven()  # (a note a call that raised left behind is not this call's)
    results = executor.run(body, plan)
    try:
        out_plan = plan(results)
        if not check_vma and mesh.is_multiprocess:  # the outputs called replicated are (see _replicas)
            maybe_check_replicas(name, mesh, check_vma, out_plan, results[0][0], executor.device)
        noted = take_uneven() or inputs.uneven
        due = not noted and cache.exchange_due(mesh, out_plan)
        out = assemble_outputs(name, mesh, out_plan, check_vma, executor.coords, results, executor.shards, noted or due)
        if due:
            cache.saw_shapes(out_plan, out)
        return out
    finally:  # tags are only meaningful during this call: none may leak into a later one
        clear_vma(body.tagged)
        for leaves, _ in results:  # (per device: no generator resumed once a leaf)
            clear_vma(leaves)
