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
from contextlib import nullcontext
from typing import Any

import optree
import torch

from ._backend.sim import SimWorld
from ._context import DeviceContext, enter, maybe_current
from ._errors import ShardingError
from ._mesh import Mesh
from ._shard_map_io import InputCache, assemble_outputs, device_args, is_array
from ._sim_grad import SimState, run_differentiable
from ._vma import VmaMode, clear_vma, set_vma

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

    Returns:
        A function of global values (``fs.Array``s, or plain tensors taken as the full value) returning
        ``fs.Array``s laid out by ``out_specs``. Usable as a decorator.

    Raises:
        ShardingError: specs that do not fit the arguments or outputs (path, shape, spec, mesh named).

    Example:
        >>> g = shard_map(lambda x: fs.psum(x, "dp"), mesh=mesh, in_specs=(P("dp"),), out_specs=P())  # doctest: +SKIP
    """
    if f is None:
        return lambda g: shard_map(g, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    if not callable(f):
        raise ShardingError(f"shard_map: expected a function as first argument, found {type(f).__name__}.")
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"shard_map: mesh must be an fs.Mesh from fs.make_mesh, found {type(mesh).__name__}.")

    cache = InputCache()

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        return _call(f, mesh, in_specs, out_specs, bool(check_vma), args, cache)

    return mapped


_lazy_clone = getattr(torch, "_lazy_clone", None)


def _own(t: Any) -> Any:
    """A tensor the running device may write in place without touching anyone else's: a copy-on-write clone
    where torch has it (free until the first write; differentiable), else a copy."""
    if not isinstance(t, torch.Tensor):
        return t
    if _lazy_clone is None or torch._C._are_functorch_transforms_active():
        return t.clone()
    return _lazy_clone(t)


class _Run:
    """One shard_map call: the per-device bodies, their outputs, and (sim) the threaded backward."""

    def __init__(
        self, f: Callable[..., Any], mesh: Mesh, check_vma: bool, treedefs: list[Any], specs: list[Any]
    ) -> None:
        self.f, self.mesh, self.check_vma = f, mesh, check_vma
        self.treedefs, self.specs = treedefs, specs
        self.tagged: list[torch.Tensor] = []

    def body(self, dev: Any, leaves: list[list[Any]]) -> tuple[list[Any], Any]:
        ctx = DeviceContext(self.mesh, dev, self.check_vma)
        # inputs are tagged with the axes their spec names in both modes (optimisers read the tags to
        # tell sharded leaves from replicated ones); only check_vma=True propagates tags through ops
        # each device owns what it may write: a copy-on-write clone of every input block (no copy is made
        # unless the function writes to it in place), so no write reaches another device or the caller
        leaves = [[_own(t) for t in arg_leaves] for arg_leaves in leaves]
        for arg_leaves, arg_specs in zip(leaves, self.specs, strict=True):
            for t, s in zip(arg_leaves, arg_specs, strict=True):
                if isinstance(t, torch.Tensor):
                    set_vma(t, frozenset(s.axes))
                    self.tagged.append(t)
        args = [optree.tree_unflatten(td, lv) for td, lv in zip(self.treedefs, leaves, strict=True)]
        with enter(ctx), VmaMode(dev) if self.check_vma else nullcontext():
            out = self.f(*args)
        out_leaves, out_def = optree.tree_flatten(out, is_leaf=is_array)
        return out_leaves, out_def


def _call(
    f: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool,
    args: tuple[Any, ...],
    cache: InputCache,
) -> Any:
    name = f"shard_map({getattr(f, '__name__', 'f')})"
    if maybe_current() is not None:
        raise ShardingError(
            f"{name}: called inside another shard_map; nesting is not supported. Call the inner function "
            f"directly on the local shards, using collectives for communication."
        )
    treedefs, specs, locals_all = cache.prepare(name, mesh, in_specs, args)
    run = _Run(f, mesh, check_vma, treedefs, specs)
    if mesh.backend == "sim":
        world = SimWorld(mesh)
        all_coords = [tuple(c.values()) for c in mesh.device_coords()]
        per_dev = [device_args(c, locals_all) for c in all_coords]
        state = SimState(run, world, per_dev, all_coords)
        diff = state.differentiable_inputs() if torch.is_grad_enabled() else []
        if diff:
            results = run_differentiable(state, diff)
        else:
            results = world.run(lambda dev: run.body(dev, per_dev[dev.rank]))
    else:
        from ._backend.dist import device_for

        dev = device_for(mesh)
        coords = tuple(dev.coords.values())
        all_coords = [coords]
        results = [run.body(dev, device_args(coords, locals_all))]
        diff = []
    try:
        out, out_specs_flat = assemble_outputs(name, mesh, out_specs, check_vma, all_coords, results, cache)
    finally:  # tags are only meaningful during this call: none may leak into a later one
        clear_vma(run.tagged)
        clear_vma(leaf for leaves, _ in results for leaf in leaves)
    if mesh.backend == "sim" and diff:
        state.set_out_specs(out_specs_flat)
    return out
