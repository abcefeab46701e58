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
import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import optree
import torch

from . import pytree
from ._array import Array, local_shards, reshard
from ._backend.sim import SimWorld
from ._context import DeviceContext, enter, maybe_current
from ._errors import ShardingError
from ._mesh import Mesh
from ._spec import P, block_index, check_spec, format_mesh, is_spec
from ._vma import VmaMode, clear_vma, get_vma, set_vma

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

    cache = _InputCache()

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        return _call(f, mesh, in_specs, out_specs, bool(check_vma), args, cache)

    return mapped


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Array)


def _leaf_sig(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, Array):
        return ("A", leaf.shape, leaf.spec, leaf.mesh)
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape))
    return ("V",)


def _check_inputs(name: str, mesh: Mesh, in_specs: Any, args: tuple[Any, ...]) -> list[list[P]]:
    """Validate the arguments against ``in_specs`` (once per call signature); the spec of every leaf."""
    if isinstance(in_specs, P) and len(args) == 1:
        in_specs = (in_specs,)
    if not isinstance(in_specs, (tuple, list)):
        raise ShardingError(
            f"{name}: in_specs must be a tuple with one spec per positional argument, found {in_specs!r}; "
            f"write in_specs=(P(...),) for one argument."
        )
    if len(in_specs) != len(args):
        raise ShardingError(
            f"{name}: in_specs has {len(in_specs)} entries but the function was called with {len(args)} "
            f"positional arguments; give one spec (or spec tree) per argument."
        )
    specs_all = []
    for i, (arg, spec_tree) in enumerate(zip(args, in_specs, strict=True)):
        where = f"{name}: in_specs[{i}]: "
        with_paths = pytree.leaves_with_path(arg, is_leaf=_is_leaf)
        specs = pytree.broadcast_prefix(spec_tree, arg, prefix_is_leaf=is_spec, where=where)
        for (p, leaf), s in zip(with_paths, specs, strict=True):
            path = f"args[{i}]" + (f"/{p}" if p else "")
            if isinstance(leaf, Array):
                if leaf.mesh != mesh:
                    raise ShardingError(
                        f"{name} at '{path}': the Array lives on mesh {format_mesh(leaf.mesh)} "
                        f"({leaf.mesh.backend}) but shard_map runs on {format_mesh(mesh)} ({mesh.backend}); "
                        f"move it with fs.device_put(fs.device_get(x), mesh, spec)."
                    )
                check_spec(s, leaf.shape, mesh, path=path, fn=name)
            elif isinstance(leaf, torch.Tensor):
                check_spec(s, leaf.shape, mesh, path=path, fn=name)
            elif s != P():
                raise ShardingError(
                    f"{name} at '{path}': a {type(leaf).__name__} leaf cannot be sharded by {s!r}; only "
                    f"tensors are split. Give it P() or pass a tensor."
                )
        specs_all.append(specs)
    return specs_all


class _InputCache:
    """Validated specs per call signature (tree structures, leaf kinds, shapes, layouts), so a step that is
    called many times checks its specs once."""

    def __init__(self) -> None:
        self.specs: dict[Any, list[list[P]]] = {}
        self.outputs: dict[Any, list[tuple[str, P, tuple[int, ...] | None]]] = {}

    def prepare(
        self, name: str, mesh: Mesh, in_specs: Any, args: tuple[Any, ...]
    ) -> tuple[list[Any], list[list[P]], list[Any]]:
        """Per argument: treedef, leaf specs, and per leaf a dict coords -> local block (or the value)."""
        flat = [optree.tree_flatten(a, is_leaf=_is_leaf) for a in args]
        key = tuple((td, tuple(_leaf_sig(x) for x in leaves)) for leaves, td in flat)
        specs_all = self.specs.get(key)
        if specs_all is None:
            specs_all = _check_inputs(name, mesh, in_specs, args)
            if len(self.specs) > 64:
                self.specs.clear()
            self.specs[key] = specs_all
        locals_all = []
        for (leaves, _), specs in zip(flat, specs_all, strict=True):
            local: list[Any] = []
            for leaf, s in zip(leaves, specs, strict=True):
                if isinstance(leaf, Array):
                    local.append(dict((leaf if leaf.spec == s else reshard(leaf, s)).shards))
                elif isinstance(leaf, torch.Tensor):
                    local.append(local_shards(leaf, mesh, s))
                else:
                    local.append(leaf)
            locals_all.append(local)
        return [td for _, td in flat], specs_all, locals_all


def _device_args(coords: tuple[int, ...], treedefs: list[Any], locals_all: list[Any]) -> list[list[Any]]:
    return [[leaf[coords] if isinstance(leaf, dict) else leaf for leaf in local] for local in locals_all]


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
        seen: dict[int, frozenset[str]] = {}
        for arg_leaves, arg_specs in zip(leaves, self.specs, strict=True):
            for k, (t, s) in enumerate(zip(arg_leaves, arg_specs, strict=True)):
                if isinstance(t, torch.Tensor):
                    vma = frozenset(s.axes)
                    if seen.get(id(t), vma) != vma:
                        t = arg_leaves[k] = t.view_as(t)
                    seen[id(t)] = vma
                    set_vma(t, vma)
                    self.tagged.append(t)
        args = [optree.tree_unflatten(td, lv) for td, lv in zip(self.treedefs, leaves, strict=True)]
        with enter(ctx), VmaMode(dev) if self.check_vma else nullcontext():
            out = self.f(*args)
        out_leaves, out_def = optree.tree_flatten(out, is_leaf=_is_leaf)
        return out_leaves, out_def


class _SimGrad(torch.autograd.Function):
    """Makes a ``"sim"`` shard_map differentiable from outside: backward runs each device's graph in its own
    thread, so collectives in the backward pass meet their peers."""

    @staticmethod
    def forward(ctx: Any, state: _SimState, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        outs = state.forward()
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, *ctx.state.backward(grads))


def _block_key(spec: P, ndim: int, mesh: Mesh, coords: tuple[int, ...]) -> tuple[int, ...]:
    c = dict(zip(mesh.axis_names, coords, strict=True))
    return tuple(block_index(axes, c, mesh.shape)[0] for axes in spec.dim_axes(ndim))


class _SimState:
    """The devices' graphs of one differentiable ``"sim"`` call.

    Replicas: a block held by several devices (its spec omits some axes) is one logical value. Its
    cotangents are summed over the replicas that received one and given to each (the cotangent of an
    invariant value is invariant); an input block's gradient is taken once, from its first replica (each
    replica holds the whole gradient, made invariant by the backward psums of ``pvary``).
    """

    def __init__(
        self, run: _Run, world: SimWorld, per_dev: list[list[list[Any]]], coords: list[tuple[int, ...]]
    ) -> None:
        self.run, self.world = run, world
        self.per_dev, self.coords = per_dev, coords
        self.grad_inputs: list[list[torch.Tensor]] = []
        self.in_keys: list[list[Any]] = []
        self.results: list[tuple[list[Any], Any]] = []
        self.out_pos: list[list[int]] = []
        self.out_keys: list[list[Any]] | None = None

    def differentiable_inputs(self) -> list[torch.Tensor]:
        flat: list[torch.Tensor] = []
        for c, leaves in zip(self.coords, self.per_dev, strict=True):
            keys = []
            for i, (arg, specs) in enumerate(zip(leaves, self.run.specs, strict=True)):
                for k, (t, spec) in enumerate(zip(arg, specs, strict=True)):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        flat.append(t)
                        keys.append((i, k, _block_key(spec, t.dim(), self.run.mesh, c)))
            self.in_keys.append(keys)
        return flat

    def forward(self) -> list[torch.Tensor]:
        detached: list[list[list[Any]]] = []
        for leaves in self.per_dev:
            dev_in = []
            d_args = []
            for arg in leaves:
                new = []
                for t in arg:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t = t.detach().requires_grad_(True)
                        dev_in.append(t)
                    new.append(t)
                d_args.append(new)
            detached.append(d_args)
            self.grad_inputs.append(dev_in)
        self.results = self.world.run(lambda dev: self.run.body(dev, detached[dev.rank]), grad=True)
        flat: list[torch.Tensor] = []
        for out_leaves, _ in self.results:
            pos = []
            for k, o in enumerate(out_leaves):
                if isinstance(o, torch.Tensor):
                    pos.append(k)
                    flat.append(o.detach())
            self.out_pos.append(pos)
        return flat

    def set_out_specs(self, specs: list[Any]) -> None:
        self.out_keys = [
            [(k, _block_key(specs[k], out_leaves[k].dim(), self.run.mesh, c)) for k in pos]
            for c, (out_leaves, _), pos in zip(self.coords, self.results, self.out_pos, strict=True)
        ]

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        per_dev: list[list[torch.Tensor | None]] = []
        i = 0
        for pos in self.out_pos:
            per_dev.append(list(grads[i : i + len(pos)]))
            i += len(pos)
        if self.out_keys is not None:  # sum the cotangents of replicas of one block
            total: dict[Any, torch.Tensor] = {}
            for keys, gs in zip(self.out_keys, per_dev, strict=True):
                for key, g in zip(keys, gs, strict=True):
                    if g is not None:
                        total[key] = g if key not in total else total[key] + g
            per_dev = [[total.get(key) for key in keys] for keys in self.out_keys]

        def back(dev: Any) -> list[torch.Tensor | None]:
            out_leaves, _ = self.results[dev.rank]
            outs, gs = [], []
            for k, g in zip(self.out_pos[dev.rank], per_dev[dev.rank], strict=True):
                o = out_leaves[k]
                if o.requires_grad and g is not None:
                    outs.append(o)
                    gs.append(g)
            ins = self.grad_inputs[dev.rank]
            if not outs or not ins:
                return [None] * len(ins)
            with enter(DeviceContext(self.run.mesh, dev, self.run.check_vma)):
                return list(torch.autograd.grad(outs, ins, gs, allow_unused=True, retain_graph=True))

        res = self.world.run(back, grad=False)
        out: list[torch.Tensor | None] = []
        first: dict[Any, torch.Tensor | None] = {}
        for keys, dev_res in zip(self.in_keys, res, strict=True):
            for key, g in zip(keys, dev_res, strict=True):
                if key in first:
                    if not self.run.check_vma and not _same(first[key], g):
                        raise ShardingError(
                            f"shard_map: the gradient of input args[{key[0]}] (leaf {key[1]}, block {key[2]}) differs "
                            f"between the devices that hold that block. Its spec says it is replicated over the "
                            f"axes it omits, so its gradient must be too: with check_vma=False, write "
                            f"fs.pvary(x, axis) where it meets values that vary over those axes."
                        )
                    out.append(None)
                else:
                    first[key] = g
                    out.append(g)
        return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return (a is None and b is None) or bool((a if a is not None else b).abs().max() == 0)
    return torch.equal(a, b)


def _call(
    f: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool,
    args: tuple[Any, ...],
    cache: _InputCache,
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
        per_dev = [_device_args(c, treedefs, locals_all) for c in all_coords]
        state = _SimState(run, world, per_dev, all_coords)
        diff = state.differentiable_inputs() if torch.is_grad_enabled() else []
        if diff:
            flat = _SimGrad.apply(state, *diff)
            results = []
            k = 0
            for (out_leaves, out_def), pos in zip(state.results, state.out_pos, strict=True):
                leaves = list(out_leaves)
                for p in pos:
                    leaves[p] = flat[k]
                    k += 1
                results.append((leaves, out_def))
            # vma tags live on the inner outputs; carry them over for the output check
            for (inner, _), (outer, _) in zip(state.results, results, strict=True):
                for a, b in zip(inner, outer, strict=True):
                    if isinstance(a, torch.Tensor) and b is not a:
                        set_vma(b, get_vma(a))
        else:
            results = world.run(lambda dev: run.body(dev, per_dev[dev.rank]))
    else:
        from ._backend.dist import device_for

        dev = device_for(mesh)
        coords = tuple(dev.coords.values())
        all_coords = [coords]
        results = [run.body(dev, _device_args(coords, treedefs, locals_all))]
        diff = []
    try:
        out, out_specs_flat = _assemble_outputs(name, mesh, out_specs, check_vma, all_coords, results, cache)
    finally:  # tags are only meaningful during this call: none may leak into a later one
        clear_vma(run.tagged)
        clear_vma(leaf for leaves, _ in results for leaf in leaves)
    if mesh.backend == "sim" and diff:
        state.set_out_specs(out_specs_flat)
    return out


def _out_plan(
    name: str, mesh: Mesh, out_specs: Any, out_def: Any, leaves: list[Any]
) -> list[tuple[str, P, tuple[int, ...] | None]]:
    """Path, spec and global shape of each output leaf, validated (once per output signature)."""
    template = optree.tree_unflatten(out_def, leaves)
    paths = ["out" + (f"/{p}" if p else "") for p, _ in pytree.leaves_with_path(template, is_leaf=_is_leaf)]
    specs = pytree.broadcast_prefix(out_specs, template, prefix_is_leaf=is_spec, where=f"{name}: out_specs: ")
    plan: list[tuple[str, P, tuple[int, ...] | None]] = []
    for path, spec, v0 in zip(paths, specs, leaves, strict=True):
        if not isinstance(v0, torch.Tensor):
            plan.append((path, spec, None))
            continue
        if not isinstance(spec, P) or len(spec) > v0.dim():
            check_spec(spec, v0.shape, mesh, path=path, fn=name)
        dims = spec.dim_axes(v0.dim())
        shape = mesh.shape
        gshape = tuple(s * math.prod(shape.get(a, 1) for a in axes) for s, axes in zip(v0.shape, dims, strict=True))
        check_spec(spec, gshape, mesh, path=path, fn=name)
        plan.append((path, spec, gshape))
    return plan


def _assemble_outputs(
    name: str,
    mesh: Mesh,
    out_specs: Any,
    check_vma: bool,
    all_coords: list[tuple[int, ...]],
    results: list[Any],
    cache: _InputCache,
) -> Any:
    out_def = results[0][1]
    for c, (_, d) in zip(all_coords, results, strict=True):
        if d != out_def:
            raise ShardingError(
                f"{name}: devices returned different output structures: {out_def} on device {all_coords[0]} and "
                f"{d} on device {c}; every device must return the same tree."
            )
    key = (out_def, tuple(_leaf_sig(v) for v in results[0][0]))
    plan = cache.outputs.get(key)
    if plan is None:
        plan = _out_plan(name, mesh, out_specs, out_def, results[0][0])
        if len(cache.outputs) > 64:
            cache.outputs.clear()
        cache.outputs[key] = plan
    out = []
    specs = [spec for _, spec, _ in plan]
    for k, (path, spec, gshape) in enumerate(plan):
        vals = [r[0][k] for r in results]
        v0 = vals[0]
        for c, v in zip(all_coords, vals, strict=True):
            if isinstance(v, torch.Tensor) != isinstance(v0, torch.Tensor):
                raise ShardingError(
                    f"{name} at '{path}': device {c} returned a {type(v).__name__} but device {all_coords[0]} "
                    f"returned a {type(v0).__name__}; every device must return the same kind of value."
                )
        if not isinstance(v0, torch.Tensor):
            if spec != P():
                raise ShardingError(
                    f"{name} at '{path}': the function returned a {type(v0).__name__}, which cannot be laid "
                    f"out by {spec!r}; return a tensor or give P()."
                )
            for c, v in zip(all_coords, vals, strict=True):
                if not _equal_values(v, v0):
                    axes = [a for a, i, j in zip(mesh.axis_names, c, all_coords[0], strict=True) if i != j]
                    raise ShardingError(
                        f"{name} at '{path}': out_specs gives {spec!r} (the same on every device), but device "
                        f"{c} returned {v!r} and device {all_coords[0]} returned {v0!r}: it varies over "
                        f"{', '.join(repr(a) for a in axes)}. Return a tensor with a spec that names those axes, "
                        f"or reduce it first."
                    )
            out.append(v0)
            continue
        allowed = frozenset(spec.axes)
        for c, v in zip(all_coords, vals, strict=True):
            if v.dtype != v0.dtype:
                raise ShardingError(
                    f"{name} at '{path}': device {c} returned dtype {v.dtype} but device {all_coords[0]} returned "
                    f"{v0.dtype}; every device must return blocks of the same dtype."
                )
            if tuple(v.shape) != tuple(v0.shape):
                raise ShardingError(
                    f"{name} at '{path}': device {c} returned shape {tuple(v.shape)} but device {all_coords[0]} "
                    f"returned {tuple(v0.shape)}; every device must return blocks of the same shape."
                )
            if check_vma:
                extra = sorted(get_vma(v) - allowed)
                if extra:
                    raise ShardingError(
                        f"{name} at '{path}': the output varies over axis '{extra[0]}' but out_specs gives "
                        f"{spec!r}, which does not name it (so it promises the value is the same on every "
                        f"device of '{extra[0]}'). Reduce it first (fs.psum / fs.pmean over '{extra[0]}'), or name "
                        f"'{extra[0]}' in the out spec."
                    )
        if not check_vma and len(vals) > 1:
            _check_replicated(name, path, spec, mesh, all_coords, vals)
        out.append(Array(mesh, spec, gshape, v0.dtype, dict(zip(all_coords, vals, strict=True))))
    return optree.tree_unflatten(out_def, out), specs


def _equal_values(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are taken as equal
        return True


def _check_replicated(
    name: str, path: str, spec: P, mesh: Mesh, all_coords: list[tuple[int, ...]], vals: list[torch.Tensor]
) -> None:
    """Under sim with check_vma=False: values must agree across every axis their spec omits."""
    by = dict(zip(all_coords, vals, strict=True))
    names = mesh.axis_names
    for ai, axis in enumerate(names):
        if axis in spec.axes or mesh.shape[axis] == 1:
            continue
        for c, v in by.items():
            if c[ai] != 0:
                continue
            for j in range(1, mesh.shape[axis]):
                c2 = (*c[:ai], j, *c[ai + 1 :])
                w = by[c2]
                if not torch.equal(v.detach(), w.detach()):
                    diff = (v.detach().double() - w.detach().double()).abs().max().item()
                    raise ShardingError(
                        f"{name} at '{path}': out_specs gives {spec!r}, which says the output is the same on "
                        f"every device of axis '{axis}', but device {dict(zip(names, c, strict=True))} and device "
                        f"{dict(zip(names, c2, strict=True))} differ by up to {diff:.3g}. Reduce it over '{axis}' "
                        f"(fs.psum / fs.pmean), or name '{axis}' in the out spec."
                    )
