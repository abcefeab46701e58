"""Differentiating a ``"sim"`` shard_map from outside: every device's graph is replayed in its own thread
during the backward pass, so the collectives of the backward meet their peers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..collectives.vma import get_vma, set_vma
from ..errors import ShardingError
from ..runtime.context import DeviceContext, enter
from ..runtime.mesh import Mesh
from ..tree.spec import P, block_index

__all__ = ["SimBody", "SimState", "run_differentiable"]

Result = tuple[list[Any], Any]


class SimBody(Protocol):
    """What a differentiable ``"sim"`` call runs on each device (``executor.DeviceBody`` is one; stated here so
    this module imports nothing of the executor, which calls it)."""

    mesh: Mesh

    def __call__(self, dev: Any, leaves: list[list[Any]]) -> Result: ...


class _SimGrad(torch.autograd.Function):
    """Makes a ``"sim"`` shard_map differentiable from outside: backward runs each device's graph in its own
    thread, so collectives in the backward pass meet their peers."""

    @staticmethod
    def forward(ctx: Any, state: SimState, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        outs = state.forward()
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the devices' backward graphs would not reach the inputs
            raise ShardingError(
                "shard_map (sim): a second derivative through a sim shard_map called from outside "
                "(torch.autograd.grad(..., create_graph=True), then a backward of that gradient) is not supported: "
                "each device's backward runs in its own thread on its own copies of the inputs. Take the "
                "derivatives inside the shard_map'd function (fs.value_and_grad or torch.autograd.grad there), "
                'or use backend="dist", where the same code gives the second derivative.'
            )
        return (None, *ctx.state.backward(grads))


def _block_key(spec: P, ndim: int, mesh: Mesh, coords: tuple[int, ...]) -> tuple[int, ...]:
    c = dict(zip(mesh.axis_names, coords, strict=True))
    return tuple(block_index(axes, c, mesh.shape)[0] for axes in spec.dim_axes(ndim))


class SimState:
    """The devices' graphs of one differentiable ``"sim"`` call.

    Replicas: a block held by several devices (its spec omits some axes) is one logical value. Its
    cotangents are summed over the replicas that received one and given to each (the cotangent of an
    invariant value is invariant); an input block's gradient is taken once, from its first replica (each
    replica holds the whole gradient, made invariant by the backward psums of ``pvary``).
    """

    def __init__(
        self,
        body: SimBody,
        world: Any,  # the sim backend's world of the call (``backend_impl.world(mesh)``)
        per_dev: list[list[list[Any]]],
        coords: list[tuple[int, ...]],
        layouts: list[list[P]],
    ) -> None:
        self.body, self.world = body, world
        self.per_dev, self.coords, self.layouts = per_dev, coords, layouts
        self.mesh: Mesh = body.mesh
        self.grad_inputs: list[list[torch.Tensor]] = []
        self.in_keys: list[list[Any]] = []
        self.results: list[Result] = []
        self.out_pos: list[list[int]] = []
        self.out_keys: list[list[Any]] = []
        self.plan: Callable[[list[Result]], list[tuple[str, P, Any]]] | None = None

    def differentiable_inputs(self) -> list[torch.Tensor]:
        """Every device's input blocks that require grad, flat; each remembered by (arg, leaf, block)."""
        flat: list[torch.Tensor] = []
        for c, leaves in zip(self.coords, self.per_dev, strict=True):
            keys = []
            for i, (arg, specs) in enumerate(zip(leaves, self.layouts, strict=True)):
                for k, (t, spec) in enumerate(zip(arg, specs, strict=True)):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        flat.append(t)
                        keys.append((i, k, _block_key(spec, t.dim(), self.mesh, c)))
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
        self.results = self.world.run(lambda dev: self.body(dev, detached[dev.rank]), grad=True)
        flat: list[torch.Tensor] = []
        for out_leaves, _ in self.results:
            pos = []
            for k, o in enumerate(out_leaves):
                if isinstance(o, torch.Tensor):
                    pos.append(k)
                    flat.append(o.detach())
            self.out_pos.append(pos)
        if self.plan is not None:  # which devices hold the same block of each output (replicas)
            specs = [spec for _, spec, _ in self.plan(self.results)]
            self.out_keys = [
                [(k, _block_key(specs[k], out_leaves[k].dim(), self.mesh, c)) for k in pos]
                for c, (out_leaves, _), pos in zip(self.coords, self.results, self.out_pos, strict=True)
            ]
        return flat

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        per_dev: list[list[torch.Tensor | None]] = []
        i = 0
        for pos in self.out_pos:
            per_dev.append(list(grads[i : i + len(pos)]))
            i += len(pos)
        if self.out_keys:  # sum the cotangents of replicas of one block
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
            with enter(DeviceContext(self.mesh, dev, self.body.check_vma, uneven=self.body.inputs.uneven)):
                return list(torch.autograd.grad(outs, ins, gs, allow_unused=True, retain_graph=True))

        res = self.world.run(back, grad=False)
        out: list[torch.Tensor | None] = []
        first: dict[Any, torch.Tensor | None] = {}
        for keys, dev_res in zip(self.in_keys, res, strict=True):
            for key, g in zip(keys, dev_res, strict=True):
                if key in first:
                    if not self.body.check_vma and not _same(first[key], g):
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


def run_differentiable(
    state: SimState, diff: list[torch.Tensor], plan: Callable[[list[Result]], list[tuple[str, P, Any]]]
) -> list[Result]:
    """Run the devices through :class:`_SimGrad`; the per-device ``(output leaves, treedef)`` whose tensors
    are connected to ``diff`` for autograd (vma tags carried over for the output check). ``plan`` gives the
    outputs' specs from the devices' results, so the backward knows which devices hold one block."""
    state.plan = plan
    flat = _SimGrad.apply(state, *diff)
    results = []
    k = 0
    for (out_leaves, out_def), pos in zip(state.results, state.out_pos, strict=True):
        leaves = list(out_leaves)
        for p in pos:
            leaves[p] = flat[k]
            k += 1
        results.append((leaves, out_def))
    for (inner, _), (outer, _) in zip(state.results, results, strict=True):
        for a, b in zip(inner, outer, strict=True):
            if isinstance(a, torch.Tensor) and b is not a:
                set_vma(b, get_vma(a))
    return results
