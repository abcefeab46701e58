"""How one ``shard_map`` call runs on the devices: the per-device body, and one executor per backend.

Every executor has the same small protocol: ``run(body, plan)`` runs ``body`` on each device this process
holds and returns, per device in ``coords`` order, ``(output leaves, treedef)``; ``plan`` gives the outputs'
specs from those results.

- :class:`SimExecutor`: every device of the mesh in this process, one thread each. When an argument
  requires grad, the call is recorded as one autograd node whose backward replays every device's graph in
  its own thread (``_sim_grad``), so the backward's collectives meet their peers.
- :class:`DistExecutor`: this process's one device; autograd spans the processes through the collectives'
  own backward passes.
- :class:`ClassExecutor`: a mesh that holds no data (``"abstract"``): one run per class of devices whose
  programs cannot differ, on meta tensors.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> mesh = fs.make_mesh({"dp": 2}, backend="sim")
    >>> executor_for(mesh).coords
    [(0,), (1,)]
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import optree
import torch

from ..arrays.array import ClassShards, Coords, local_shards
from ..arrays.reshard import apply_reshard
from ..collectives.vma import VmaMode, find_vma, settle, tag_tensors, vary_output
from ..runtime.context import DeviceContext, enter, observer, swap_context, transforms_active
from ..runtime.mesh import Mesh
from .io import ARRAY, VALUE, WHOLE, Inputs, OutPlan, device_args, flatten
from .sim_grad import SimState, run_differentiable

__all__ = ["ClassExecutor", "DeviceBody", "DistExecutor", "Executor", "SimExecutor", "executor_for"]

#: one device's result: its output leaves and their tree structure
Result = tuple[list[Any], Any]
#: the output plan of a call, from the devices' results (validated once per output signature)
PlanFn = Callable[[list[Result]], OutPlan]

_lazy_clone = getattr(torch, "_lazy_clone", None)
_clone_lock = threading.Lock()  # a lazy clone turns its source's storage copy-on-write: one at a time


def _own(t: Any) -> Any:
    """A tensor the running device may write in place without touching anyone else's: a copy-on-write clone
    where torch has it (free until the first write; differentiable), else a copy (also for a storage torch cannot
    make copy-on-write: memory it does not own, as ``torch.from_numpy``'s or one that gloo handed back)."""
    if not isinstance(t, torch.Tensor):
        return t
    if _lazy_clone is None or transforms_active():
        return t.clone()
    with _clone_lock:
        return _cow(t)


def _cow(t: torch.Tensor) -> torch.Tensor:
    """:func:`_own` of a tensor, with ``_clone_lock`` held and no torch.func transform active."""
    try:
        return _lazy_clone(t)
    except RuntimeError:  # "Expected storage != nullptr": not a plain allocation of torch's
        return t.clone()


def _own_all(leaves: list[list[Any]], donated: list[list[bool]] | None) -> list[list[Any]]:
    """:func:`_own` of every leaf (per argument) but the donated ones, under one hold of the lock."""
    if _lazy_clone is None or transforms_active():
        if donated is None:
            return [[_own(t) for t in arg] for arg in leaves]
        return [[t if d else _own(t) for t, d in zip(arg, ds, strict=True)] for arg, ds in zip(leaves, donated)]
    T = torch.Tensor
    with _clone_lock:
        if donated is None:
            return [[_cow(t) if isinstance(t, T) else t for t in arg] for arg in leaves]
        return [
            [_cow(t) if not d and isinstance(t, T) else t for t, d in zip(arg, ds, strict=True)]
            for arg, ds in zip(leaves, donated)
        ]


def _tag_args(leaves: list[list[Any]], tags: list[list[frozenset[str]]], tagged: list[torch.Tensor]) -> None:
    """Tag each tensor argument with the axes its spec names (``tags``: per argument and leaf; both vma modes:
    the optimisers and the collectives under ``check_vma=False`` read them)."""
    for arg_leaves, arg_tags in zip(leaves, tags, strict=True):
        tag_tensors(arg_leaves, arg_tags, tagged)


def _spec_tags(specs: list[list[Any]]) -> list[list[frozenset[str]]]:
    """Per argument and leaf, the axes its spec names."""
    return [[frozenset(s.axes) for s in arg] for arg in specs]


_ENV = getattr(os.environ, "_data", None)  # os.environ's own mapping (encoded keys and values), where it has one
_AUDIT_KEY = os.environ.encodekey("FUNCSHARD_AUDIT") if _ENV is not None and hasattr(os.environ, "encodekey") else None


def audit_env() -> bool:
    """Whether ``FUNCSHARD_AUDIT=1``, read on every call as ``os.environ.get`` would (which costs ~1 us where the
    variable is unset, the usual case: a KeyError raised and caught inside it): its mapping read directly."""
    if _AUDIT_KEY is None:
        return os.environ.get("FUNCSHARD_AUDIT") == "1"
    value = _ENV.get(_AUDIT_KEY)  # type: ignore[union-attr]
    return value is not None and os.environ.decodevalue(value) == "1"  # type: ignore[attr-defined]


def _differentiable(leaves: list[Any]) -> bool:
    """Whether a cotangent can flow back into any of ``leaves`` (else an output's pvary would do nothing)."""
    if transforms_active():
        return True
    T = torch.Tensor
    for t in leaves:  # (a loop: a generator's frame per leaf costs more than the reads)
        if isinstance(t, T) and t.requires_grad:
            return True
    return False


class DeviceBody:
    """What one device runs for one call: own its blocks, reshard those laid out otherwise, tag them, and
    call ``f`` under the device's context (and the vma mode with ``check_vma``)."""

    def __init__(
        self,
        f: Callable[..., Any],
        mesh: Mesh,
        check_vma: bool,
        inputs: Inputs,
        plan: Callable[[Any, list[Any]], OutPlan],
        audit: bool | None = None,
    ) -> None:
        self.f, self.mesh, self.check_vma, self.inputs, self.plan = f, mesh, check_vma, inputs, plan
        # check_vma=False under sim: the vma mode audits the program (see _vma.Audited); dist with
        # FUNCSHARD_AUDIT=1 too (``audit``: found by the caller)
        self.audit = (not check_vma and (mesh.backend_impl.audit or audit_env())) if audit is None else audit
        self.tagged: list[torch.Tensor] = []  # every tensor tagged during the call (cleared after it)
        self.compiled: Any = None  # under dist with shard_map(compile=...): its _compile.CompiledBody
        # the outputs' plan :meth:`_vary_outputs` found, and the tree structure it is for (the caller assembles the
        # outputs by it: the plan's key, structure and leaf shapes, is the same after the pvarys)
        self.out_plan: tuple[Any, OutPlan] | None = None

    def __call__(self, dev: Any, leaves: list[list[Any]]) -> Result:
        return self.run(dev, self.own(leaves))

    def own(self, leaves: list[list[Any]]) -> list[list[Any]]:
        """Each device owns what it may write: a copy-on-write clone of every input block (no copy is made
        unless the function writes to it in place), so no write reaches another device or the caller."""
        # donated blocks are handed over as they are: the call may write into them (then they are deleted)
        return _own_all(leaves, self.inputs.donated)

    def run(self, dev: Any, leaves: list[list[Any]]) -> Result:
        """Reshard, tag and call ``f`` on blocks this device owns (see :meth:`own`)."""
        inputs = self.inputs
        donated = inputs.donated
        if inputs.resharded:  # below the transform: move blocks to their in_spec, untracked
            _tag_args(leaves, _spec_tags(inputs.layouts), self.tagged)
            with enter(DeviceContext(self.mesh, dev, False)):
                for arg, steps in zip(leaves, inputs.steps, strict=True):
                    for k, st in enumerate(steps):
                        if st:
                            arg[k] = apply_reshard(arg[k], st)
        tags = _spec_tags(inputs.specs) if inputs.tags is None else inputs.tags  # None: an Inputs built by hand
        _tag_args(leaves, tags, self.tagged)
        bare = inputs.bare
        if bare is None:
            args = [optree.tree_unflatten(td, lv) for td, lv in zip(inputs.treedefs, leaves, strict=True)]
        else:  # an argument that is one leaf is its block (no tree to rebuild)
            args = [lv[0] if b else optree.tree_unflatten(td, lv) for td, lv, b in zip(inputs.treedefs, leaves, bare)]
        if donated is not None:
            mine = frozenset([id(t) for arg, ds in zip(leaves, donated) for t, d in zip(arg, ds) if d])
            ctx = DeviceContext(self.mesh, dev, self.check_vma, mine, inputs.uneven)
        else:
            ctx = _context_of(self.mesh, dev, self.check_vma, inputs.uneven)
        return self.call(dev, ctx, args)

    def call(self, dev: Any, ctx: DeviceContext, args: list[Any]) -> Result:
        """Call ``f`` on ``args`` (owned and tagged) under the device's context ``ctx``; its outputs' leaves
        (pending collectives waited for, each made varying over its out_spec's axes) and tree structure."""
        mode = VmaMode(dev, audit=not self.check_vma) if self.check_vma or self.audit else None
        prev = swap_context(ctx)  # (as ``with enter(ctx):``, without a context object and its three frames)
        try:
            if mode is None:
                return self._outputs(dev, self.f(*args), False)
            with mode:
                return self._outputs(dev, self.f(*args), True)
        finally:
            swap_context(prev)

    def _outputs(self, dev: Any, out: Any, moded: bool) -> Result:
        """The leaves and tree structure of ``f``'s output ``out`` (under the device's context and, where ``moded``,
        the vma mode): pending collectives waited for, each made varying over its out_spec's axes."""
        out_leaves, out_def, _ = flatten(out)  # (an Array is a leaf: no pytree node of optree's)
        T = torch.Tensor
        for t in out_leaves:  # no pending collective leaves the call (the common output: plain tensors, no copy)
            if type(t) is not T:
                out_leaves = [t if type(t) is T else settle(t) for t in out_leaves]
                break
        if not moded:  # (no mode on the stack: nothing to disable, ~2k instructions)
            differentiable = _differentiable(out_leaves)
        else:
            with torch._C.DisableTorchFunction():  # a read the vma mode need not see
                differentiable = _differentiable(out_leaves)
        if differentiable:
            out_leaves = self._vary_outputs(dev, out_leaves, out_def)
        return out_leaves, out_def

    def _vary_outputs(self, dev: Any, leaves: list[Any], out_def: Any) -> list[Any]:
        """Each output made varying over the axes its spec names (``vary_output``)."""
        plan = self.plan(out_def, leaves)
        self.out_plan = (out_def, plan)
        out = []
        for t, (path, _, _), axes in zip(leaves, plan, plan.allowed, strict=True):
            if axes and isinstance(t, torch.Tensor):
                have = find_vma(t)  # (vary_output's first read, which it returns on)
                if have is None or not axes <= have:
                    t = vary_output(t, axes, dev, self.check_vma, path)
            out.append(t)
        return out


def run_local(body: DeviceBody, executor: DistExecutor, sig: Any, leaves: list[Any], cache: Any) -> Result:
    """:meth:`DistExecutor.run` of a call whose arguments need no resharding and none is donated (the common
    step), straight from the arguments' flat ``leaves`` and their signature ``sig`` (``_shard_map_io._InSig``):
    this process's block of each leaf, owned (:meth:`DeviceBody.own`) and tagged with its in_spec's axes
    (:func:`_tag_args`) in one pass, no per-argument lists of blocks in between; ``f`` is then called as
    :meth:`DeviceBody.run` calls it."""
    mesh = body.mesh
    local = cache.dist_local  # (cache.local_device's own read)
    coords, device = local if local is not None else cache.local_device(mesh)
    blocks = []
    for leaf, kind, spec in zip(leaves, sig.kinds, sig.flat_specs, strict=True):
        if kind == ARRAY:
            blocks.append(leaf.shards[coords])
        elif kind == VALUE or (kind == WHOLE and (device is None or leaf.device == device)):
            blocks.append(leaf)  # (a replicated full tensor on this process's device is its own block)
        else:
            blocks.append(local_shards(leaf, mesh, spec)[coords])
    T = torch.Tensor
    if _lazy_clone is None or transforms_active():
        owned = [_own(t) for t in blocks]
    else:
        with _clone_lock:
            owned = []
            try:  # (_cow of each, its call written out: one frame less a leaf; a loop: no comprehension's frame)
                for t in blocks:
                    owned.append(_lazy_clone(t) if isinstance(t, T) else t)
            except RuntimeError:  # a storage torch cannot make copy-on-write: each leaf on its own
                owned = [_cow(t) if isinstance(t, T) else t for t in blocks]
    tag_tensors(owned, sig.flat_tags, body.tagged)
    if sig.all_bare:  # (every argument one leaf: the blocks are the arguments)
        args = owned
    else:
        args, k = [], 0
        for td, bare in zip(sig.treedefs, sig.bare, strict=True):
            n = td.num_leaves
            args.append(owned[k] if bare else optree.tree_unflatten(td, owned[k : k + n]))
            k += n
    dev = executor.device
    ctx = cache.context  # (the context of the last call, kept while its device is the executor's)
    if ctx is None or ctx.device is not dev or ctx.check_vma is not body.check_vma or ctx.uneven is not sig.uneven:
        ctx = cache.context = _context_of(mesh, dev, body.check_vma, sig.uneven)
    return body.call(dev, ctx, args)


def _context_of(mesh: Mesh, dev: Any, check_vma: bool, uneven: bool = False) -> DeviceContext:
    """The context of a call without donation on ``dev``: made once per device and mode where the device lives
    on (``"dist"``: the process's one device; a sim device lives for one call only). ``uneven``: an argument is
    split unevenly (``DeviceContext.uneven``)."""
    if not mesh.is_multiprocess:
        return DeviceContext(mesh, dev, check_vma, uneven=uneven)
    key = (id(dev), id(mesh), check_vma, uneven)
    ctx = _CONTEXTS.get(key)
    if ctx is None:  # (the context holds its device and mesh: their ids are not reused while it is here)
        if len(_CONTEXTS) > 64:
            _CONTEXTS.clear()
        ctx = _CONTEXTS[key] = DeviceContext(mesh, dev, check_vma, uneven=uneven)
    return ctx


_CONTEXTS: dict[tuple[int, int, bool, bool], DeviceContext] = {}
atexit.register(_CONTEXTS.clear)  # no device (and its process groups) held into the interpreter's teardown


class Executor(Protocol):
    """Runs a :class:`DeviceBody` on the devices this process holds."""

    coords: list[Coords]

    def run(self, body: DeviceBody, plan: PlanFn) -> list[Result]:
        """Per device in ``coords`` order, ``(output leaves, treedef)``."""
        ...

    def shards(self, blocks: dict[Coords, Any]) -> dict[Coords, Any]:
        """An output Array's dict of blocks, from the blocks of the devices in ``coords``."""
        ...


def _plain(blocks: dict[Coords, Any]) -> dict[Coords, Any]:
    """:meth:`Executor.shards` of an executor that runs every device it holds: the blocks themselves."""
    return blocks


class SimExecutor:
    """Every device of a ``"sim"`` mesh, one thread each (see the module docstring)."""

    shards = staticmethod(_plain)

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.coords: list[Coords] = [tuple(c.values()) for c in mesh.device_coords()]

    def run(self, body: DeviceBody, plan: PlanFn) -> list[Result]:
        world = self.mesh.backend_impl.world(self.mesh)
        per_dev = [device_args(c, body.inputs.blocks) for c in self.coords]
        if torch.is_grad_enabled():
            state = SimState(body, world, per_dev, self.coords, body.inputs.layouts)
            diff = state.differentiable_inputs()
            if diff:
                return run_differentiable(state, diff, plan)
        return world.run(lambda dev: body(dev, per_dev[dev.rank]))


class DistExecutor:
    """This process's device of a ``"dist"`` mesh."""

    shards = staticmethod(_plain)

    def __init__(self, mesh: Mesh) -> None:
        impl = mesh.backend_impl
        self.mesh = mesh
        self.device = impl.device(mesh)
        self.coords: list[Coords] = [tuple(self.device.coords.values())]
        self._devices = impl.live_devices()  # the backend's devices (emptied when torch.distributed restarts)

    def stale(self) -> bool:
        """Whether the process's device for this mesh is no longer the one held (torch.distributed restarted)."""
        # (the device is registered under its mesh only: looked for among the values, no Mesh hash, a Python call)
        return self.device not in self._devices

    def run(self, body: DeviceBody, plan: PlanFn) -> list[Result]:
        leaves = device_args(self.coords[0], body.inputs.blocks)
        if body.compiled is not None:  # shard_map(..., compile=...): the body's recorded graph, compiled
            return [body.compiled.run(body, self.device, leaves)]
        return [body(self.device, leaves)]


class ClassExecutor:
    """The devices of a mesh that holds no data (``"abstract"``), run once per class: devices whose programs
    cannot differ share one run.

    A body's program differs between devices only through indices it reads as Python numbers (the device
    notes them: ``DeviceHandle.index``). The first run is device 0's; each axis it read splits the devices by
    their coordinate on it, and one representative of each class not yet run (its coordinates on the read axes,
    0 elsewhere) runs next, until every class has run. A pipeline's body runs once per stage; a data-parallel
    body once. ``coords`` are the representatives' after :meth:`run`, and the outputs' blocks serve every device
    of a class (``arrays.array.ClassShards``).
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.coords: list[Coords] = [tuple(0 for _ in mesh.axis_names)]
        self.positions: tuple[int, ...] = ()  # the class axes of the last run, as positions in axis order

    def run(self, body: DeviceBody, plan: PlanFn) -> list[Result]:
        mesh = self.mesh
        names, sizes = mesh.axis_names, tuple(mesh.shape.values())
        world = mesh.backend_impl.world(mesh)
        done: dict[Coords, Result] = {}
        # the axes along which an argument's blocks differ (an uneven split): its devices' programs may differ too
        read = {names[p] for arg in body.inputs.blocks for b in arg if _uneven_classes(b) for p in b.positions}
        while True:
            todo = [c for c in _representatives(names, sizes, read) if c not in done]
            if not todo:
                break
            for c in todo:
                dev = world.device(mesh.rank_of(dict(zip(names, c, strict=True))))
                done[c] = _run_observed(body, dev, device_args(c, body.inputs.blocks))
                if not dev.read_axes <= read:  # a finer split: more classes to run
                    read |= dev.read_axes
                    break
        self.positions = tuple(i for i, n in enumerate(names) if n in read)
        self.coords = _representatives(names, sizes, read)
        return [done[c] for c in self.coords]

    def shards(self, blocks: dict[Coords, Any]) -> ClassShards:
        """An output's blocks, one per class (the representatives'), serving every device."""
        return ClassShards(self.positions, blocks)


def _uneven_classes(blocks: Any) -> bool:
    """Whether ``blocks`` (an argument's) are the classes of an uneven split: meta blocks of different shapes."""
    return isinstance(blocks, ClassShards) and len({tuple(t.shape) for t in blocks.values()}) > 1


def _run_observed(body: DeviceBody, dev: Any, leaves: list[list[Any]]) -> Result:
    """``body(dev, leaves)``, watched by the ahead-of-time analysis observing this thread, where one does."""
    obs = observer()
    if obs is None:
        return body(dev, leaves)
    owned = body.own(leaves)
    with obs.device(dev, owned):
        return body.run(dev, owned)


def _representatives(names: tuple[str, ...], sizes: tuple[int, ...], read: set[str]) -> list[Coords]:
    """One device per class: every combination of coordinates on the ``read`` axes, 0 on the others."""
    ranges = [range(s) if n in read else range(1) for n, s in zip(names, sizes, strict=True)]
    return list(itertools.product(*ranges))


_EXECUTION = {"threads": SimExecutor, "process": DistExecutor, "classes": ClassExecutor}


def executor_for(mesh: Mesh) -> Executor:
    """The executor of ``mesh``'s backend (made once per mesh), as the backend declares how it runs devices
    (``BackendImpl.execution``)."""
    ex = _EXECUTORS.get(mesh)
    if ex is None or (isinstance(ex, DistExecutor) and ex.stale()):
        if len(_EXECUTORS) > 64:
            _EXECUTORS.clear()
        ex = _EXECUTORS[mesh] = _EXECUTION[mesh.backend_impl.execution](mesh)
    return ex


_EXECUTORS: dict[Mesh, Executor] = {}
