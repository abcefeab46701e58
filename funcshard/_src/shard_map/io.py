"""What ``shard_map`` does at its edges: check the arguments against ``in_specs`` (once per call signature)
and hand each device its blocks, with the resharding steps for an Array laid out otherwise (run on the
devices, below the transform); then check the devices' outputs and assemble them into ``fs.Array``s."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..arrays.array import Array, Coords, is_array, local_coords, local_shards
from ..arrays.reshard import Step, comparable, reshard_plan
from ..collectives.vma import EMPTY, get_vma, take_vmas
from ..errors import ShardingError
from ..runtime.mesh import Mesh
from ..tree import pytree
from ..tree.spec import P, block_index, check_spec, format_mesh, is_even, is_spec, split_sizes

__all__ = ["InputCache", "Inputs", "OutPlan", "assemble_one", "assemble_outputs", "device_args", "donated_blocks"]


class OutPlan(list):  # type: ignore[type-arg]
    """Per output leaf: its path, its spec and its global shape (None for a non-tensor leaf); and, found with
    it once per output signature, the axes each spec names (``allowed``, a frozenset per leaf)."""

    __slots__ = ("allowed",)

    def __init__(self, items: list[tuple[str, P, tuple[int, ...] | None]]) -> None:
        super().__init__(items)
        self.allowed: list[frozenset[str]] = [
            frozenset(spec.axes) if isinstance(spec, P) else EMPTY for _, spec, _ in items
        ]


@dataclass
class Inputs:
    """The arguments of one call, cut for the devices.

    Attributes:
        treedefs: per argument, its tree structure.
        specs: per argument and leaf, the in_spec: the layout the function sees.
        layouts: per argument and leaf, the layout of the blocks handed over (an Array's own spec, which
            differs from the in_spec where the devices reshard it first).
        steps: per argument and leaf, the resharding steps from ``layouts`` to ``specs`` (mostly empty).
        blocks: per argument and leaf, a dict device coords -> block for a tensor, else the value itself.
        donated: per argument and leaf, whether its blocks are handed over to be written (None: no donation).
        resharded: whether any leaf is resharded on the devices before the function runs.
        tags: per argument and leaf, the axes its in_spec names (the vma tag each block gets), found once per
            call signature.
        bare: per argument, whether it is one leaf (no tree to rebuild around its block); None: not known.
    """

    treedefs: list[Any]
    specs: list[list[P]]
    layouts: list[list[P]]
    steps: list[list[list[Step]]]
    blocks: list[list[Any]]
    donated: list[list[bool]] | None = None
    resharded: bool = False
    tags: list[list[frozenset[str]]] | None = None
    bare: list[bool] | None = None
    uneven: bool = False


@dataclass
class _InSig:
    """What a call signature (tree structures, leaf kinds, shapes, layouts) fixes, found once: everything of
    :class:`Inputs` but the blocks, and per leaf how its blocks are found (``kinds``)."""

    treedefs: list[Any]
    specs: list[list[P]]
    layouts: list[list[P]]
    steps: list[list[list[Step]]]
    resharded: bool
    kinds: list[int]  # per leaf (all arguments in order): ARRAY, WHOLE, CUT or VALUE
    tags: list[list[frozenset[str]]]
    bare: list[bool]  # per argument: one leaf, its own tree
    flat_specs: list[P]  # per leaf (all arguments in order): its in_spec
    flat_tags: list[frozenset[str]]  # per leaf: the axes its in_spec names
    all_bare: bool  # every argument is one leaf: the leaves are the arguments
    pins: tuple[Any, ...]  # the Arrays' spec objects, whose ids the signature's key holds (kept alive with it)
    uneven: bool = False  # a leaf is split unevenly (by its layout or its in_spec): the devices' blocks differ


ARRAY, WHOLE, CUT, VALUE = 0, 1, 2, 3


#: types optree takes as leaves (no pytree node of its own; an Array neither), by exact type
_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, Array, int, float, bool})
#: the tree structure of each flat shape :func:`flatten` met (see there), kept for the life of the process
_TREEDEFS: dict[Any, Any] = {}
#: ``id`` of each of those structures -> its flat shape (they are never freed, so the ids stay theirs)
_SHAPE_OF: dict[int, Any] = {}


def flatten(tree: Any) -> tuple[list[Any], Any, Any]:
    """``optree.tree_flatten(tree)``, and a hashable key of its structure: equal keys, equal structures.

    The common trees of a call (a tuple of arguments, a ``(loss, grads)`` output: a leaf, or a tuple of leaves
    and tuples of leaves) are flattened here without optree, which costs ~2.5 us even for a tuple of three
    tensors; their key is their flat shape (per element: -1 for a leaf, else its length), and their structure
    is optree's own, made once per shape. Any other tree goes to optree and its structure is its key (a key
    never equal to a flat shape, so such a tree is at worst planned once more than needed).

    Example:
        >>> leaves, treedef, key = flatten((1, (2.0, 3)))
        >>> leaves, treedef == optree.tree_structure((1, (2.0, 3))), key
        ([1, 2.0, 3], True, (-1, 2))
    """
    kind = type(tree)
    if kind in _LEAVES:
        return [tree], _treedef_of(-1), -1
    if kind is tuple:
        if _LEAVES.issuperset(map(type, tree)):  # a tuple of leaves (the arguments, most often)
            key = (-1,) * len(tree)
            treedef = _TREEDEFS.get(key)
            if treedef is None:
                treedef = _treedef_of(key)
            if treedef is not None:
                return list(tree), treedef, key
        leaves: list[Any] = []
        shape: list[int] = []
        for e in tree:
            k = type(e)
            if k in _LEAVES:
                leaves.append(e)
                shape.append(-1)
            elif k is tuple and _LEAVES.issuperset(map(type, e)):
                leaves.extend(e)
                shape.append(len(e))
            else:
                break
        else:
            key = tuple(shape)
            treedef = _TREEDEFS.get(key)
            if treedef is None:
                treedef = _treedef_of(key)
            if treedef is not None:
                return leaves, treedef, key
    leaves, treedef = optree.tree_flatten(tree)
    return leaves, treedef, treedef


def _treedef_of(shape: Any) -> Any:
    """The optree structure of a flat shape (see :func:`flatten`), made and kept once (None past 4096 shapes)."""
    treedef = _TREEDEFS.get(shape)
    if treedef is None:
        if len(_TREEDEFS) >= 4096:  # (never dropped, so that no id in _SHAPE_OF is reused: past this, optree's)
            return None
        template = 0 if shape == -1 else tuple(0 if n == -1 else (0,) * n for n in shape)
        treedef = _TREEDEFS[shape] = optree.tree_structure(template)
        _SHAPE_OF[id(treedef)] = shape
    return treedef


def _leaf_sig(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, Array):
        return ("A", leaf.shape, leaf.spec, leaf.mesh)
    if isinstance(leaf, torch.Tensor):
        return ("T", leaf.shape)  # a torch.Size: equal to (and hashed as) the tuple
    return ("V",)


def _arg_sig(leaf: Any, mesh: Mesh) -> tuple[Any, ...]:
    """:func:`_leaf_sig` of an argument of a ``shard_map`` over ``mesh``: an Array on that very mesh object
    says so by a flag rather than by the mesh (whose hash costs a Python call per read), and its spec by the
    spec object's id (a ``P``'s hash is a Python call too; the signature keeps the object alive, so the id
    stays its own while the key is in the cache: an equal spec that is another object is planned once more)."""
    if type(leaf) is Array:
        return ("A", leaf.shape, id(leaf.spec), True if leaf.mesh is mesh else leaf.mesh)
    return _leaf_sig(leaf)


def _args_key(shape: Any, leaves: list[Any], mesh: Mesh) -> tuple[Any, ...]:
    """The cache key of a call's arguments: their flat shape and :func:`_arg_sig` of each leaf (written out
    here for the common leaves: one Python call for the whole key)."""
    key: list[Any] = [shape]
    push = key.append
    for leaf in leaves:
        kind = type(leaf)
        if kind is Array:
            m = leaf.mesh
            push(("A", leaf.shape, id(leaf.spec), True if m is mesh else m))
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            push(("T", leaf.shape))
        else:
            push(_arg_sig(leaf, mesh))
    return tuple(key)


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
        with_paths = pytree.leaves_with_path(arg, is_leaf=is_array)
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


class InputCache:
    """Validated specs per call signature (tree structures, leaf kinds, shapes, layouts), so a step that is
    called many times checks its specs once."""

    def __init__(self) -> None:
        self.specs: dict[Any, _InSig] = {}
        self.outputs: dict[Any, OutPlan] = {}
        self.dist_local: tuple[Coords, torch.device | None] | None = None  # this process's coords, its device
        self.executor: Any = None  # the mesh's executor (``_executor.executor_for``), kept for the next call
        self.context: Any = None  # the device context of the last ``run_local`` call (``_executor._context_of``)
        # under "dist": the output plans whose blocks' shapes were exchanged once (id -> plan), and whether an
        # exchange found blocks that differ (from then on every call exchanges them; see ``exchange_due``)
        self.shapes_seen: dict[int, OutPlan] = {}
        self.uneven_outputs = False

    def prepare(self, name: str, mesh: Mesh, in_specs: Any, args: tuple[Any, ...]) -> Inputs:
        """Validate ``args`` against ``in_specs`` (cached per call signature) and cut them for the devices.

        A repeat call flattens the arguments once, looks its signature up and gathers the blocks: the specs,
        layouts, resharding steps and tree structures are the signature's, found at its first call."""
        sig, leaves = self.signature(name, mesh, in_specs, args)
        return self.inputs(mesh, sig, leaves)

    def signature(self, name: str, mesh: Mesh, in_specs: Any, args: tuple[Any, ...]) -> tuple[_InSig, list[Any]]:
        """The call signature of ``args`` (validated against ``in_specs`` at its first call) and their leaves."""
        leaves, treedef, shape = flatten(args)  # (an Array is a leaf: no pytree node of optree's)
        key = _args_key(shape, leaves, mesh)
        sig = self.specs.get(key)
        if sig is None:
            sig = self._signature(name, mesh, in_specs, args, treedef, leaves)
            if len(self.specs) > 64:
                self.specs.clear()
            self.specs[key] = sig
        return sig, leaves

    def inputs(self, mesh: Mesh, sig: _InSig, leaves: list[Any]) -> Inputs:
        """The arguments' leaves of signature ``sig`` cut for the devices."""
        blocks: list[list[Any]] = []
        k = 0
        kinds = sig.kinds
        for specs in sig.specs:
            blk: list[Any] = []
            for s in specs:
                leaf, kind = leaves[k], kinds[k]
                k += 1
                if kind == ARRAY:
                    blk.append(leaf.shards)
                elif kind == VALUE:
                    blk.append(leaf)
                else:
                    whole = self.whole_blocks(mesh, leaf) if kind == WHOLE else None
                    blk.append(local_shards(leaf, mesh, s) if whole is None else whole)
            blocks.append(blk)
        return Inputs(
            sig.treedefs, sig.specs, sig.layouts, sig.steps, blocks, None, sig.resharded, sig.tags, sig.bare, sig.uneven
        )

    @staticmethod
    def _signature(
        name: str, mesh: Mesh, in_specs: Any, args: tuple[Any, ...], treedef: Any, leaves: list[Any]
    ) -> _InSig:
        """The first call of a signature: the arguments checked against ``in_specs``, and what they fix."""
        specs_all = _check_inputs(name, mesh, in_specs, args)
        treedefs = treedef.children()
        layouts: list[list[P]] = []
        steps: list[list[list[Step]]] = []
        kinds: list[int] = []
        uneven = False
        it = iter(leaves)
        for specs in specs_all:
            lay: list[P] = []
            st: list[list[Step]] = []
            for s in specs:
                leaf = next(it)
                if isinstance(leaf, (Array, torch.Tensor)):
                    uneven = uneven or not is_even(leaf.shape, s, mesh.shape)
                if isinstance(leaf, Array):
                    uneven = uneven or not is_even(leaf.shape, leaf.spec, mesh.shape)
                    lay.append(leaf.spec)
                    st.append([] if leaf.spec == s else reshard_plan(leaf.spec, s, leaf.ndim, leaf.shape, mesh.shape))
                    kinds.append(ARRAY)
                else:
                    lay.append(s)
                    st.append([])
                    tensor = isinstance(leaf, torch.Tensor)
                    kinds.append((CUT if s.axes else WHOLE) if tensor else VALUE)
            layouts.append(lay)
            steps.append(st)
        resharded = any(x for arg in steps for x in arg)
        tags = [[frozenset(sp.axes) for sp in specs] for specs in specs_all]
        bare = [td.num_nodes == 1 and td.num_leaves == 1 for td in treedefs]
        flat_specs = [sp for specs in specs_all for sp in specs]
        flat_tags = [t for arg in tags for t in arg]
        pins = tuple(leaf.spec for leaf in leaves if type(leaf) is Array)
        return _InSig(
            treedefs,
            specs_all,
            layouts,
            steps,
            resharded,
            kinds,
            tags,
            bare,
            flat_specs,
            flat_tags,
            all(bare),
            pins,
            uneven,
        )

    def local_device(self, mesh: Mesh) -> tuple[Coords, torch.device | None]:
        """Under ``"dist"``: this process's coords in ``mesh`` and the device its tensors live on (found once)."""
        if self.dist_local is None:
            self.dist_local = (local_coords(mesh)[0], mesh.local_device())
        return self.dist_local

    def whole_blocks(self, mesh: Mesh, x: torch.Tensor) -> dict[Coords, torch.Tensor] | None:
        """The blocks of a replicated full tensor ``x`` under ``"dist"``: ``x`` itself, where it already lives on
        this process's device (what ``local_shards`` would cut, without its per-call slicing); else None."""
        if not mesh.is_multiprocess:
            return None
        coords, dev = self.local_device(mesh)
        if dev is not None and x.device != dev:
            return None
        return {coords: x}

    def exchange_due(self, mesh: Mesh, plan: OutPlan) -> bool:
        """Under ``"dist"``: whether this call's processes exchange their output blocks' shapes although no
        input was split unevenly. A body may still return blocks that differ between devices (it slices by
        ``axis_index``), which no process sees alone: the first call of each output signature exchanges them,
        and once one found blocks that differ, every later call does (:meth:`saw_shapes`). Every process makes
        the same decision: the same calls, and a new output signature on each at its first call."""
        if not mesh.is_multiprocess:
            return False
        if self.uneven_outputs:
            return True
        if self.shapes_seen.get(id(plan)) is plan:
            return False
        if len(self.shapes_seen) > 64:
            self.shapes_seen.clear()
        self.shapes_seen[id(plan)] = plan
        return any(g is not None and any(mesh.shape[a] > 1 for a in s.axes) for _, s, g in plan)

    def saw_shapes(self, plan: OutPlan, out: Any) -> None:
        """Note, after an exchange, whether an output's global shape (``out``: the outputs, a tree of Arrays)
        differs from the even split's."""
        if not self.uneven_outputs:
            found = [tuple(a.shape) for a in optree.tree_leaves(out, is_leaf=is_array) if is_array(a)]
            self.uneven_outputs = found != [tuple(g) for _, _, g in plan if g is not None]

    def out_plan(self, name: str, mesh: Mesh, out_specs: Any, out_def: Any, leaves: list[Any]) -> OutPlan:
        """Path, spec and global shape of each output leaf (validated once per output signature)."""
        key: Any = [_SHAPE_OF.get(id(out_def), out_def)]
        push = key.append
        for leaf in leaves:  # _leaf_sig of each, written out for a plain tensor (the common output)
            push(("T", leaf.shape) if type(leaf) is torch.Tensor else _leaf_sig(leaf))
        key = tuple(key)
        plan = self.outputs.get(key)
        if plan is None:
            plan = _out_plan(name, mesh, out_specs, out_def, leaves)
            if len(self.outputs) > 64:
                self.outputs.clear()
            self.outputs[key] = plan
        return plan


def donated_blocks(name: str, args: tuple[Any, ...], donate: tuple[int, ...]) -> list[list[bool]]:
    """Per argument and leaf, whether its blocks are handed to the devices to be written in place: the
    ``owned`` Arrays of the donated arguments (the others are copied on write, as without donation).

    Raises:
        ShardingError: a position past the arguments, or a donated Array that requires grad.
    """
    for i in donate:
        if i >= len(args):
            raise ShardingError(
                f"{name}: donate names argument {i} but the function was called with {len(args)} positional "
                f"arguments; donate positions count from 0."
            )
    out = []
    for i, arg in enumerate(args):
        leaves = optree.tree_leaves(arg)  # (an Array is a leaf: no pytree node of optree's)
        if i not in donate:
            out.append([False] * len(leaves))
            continue
        flags = []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, Array):
                if leaf.requires_grad:
                    path = pytree.leaves_with_path(arg, is_leaf=is_array)[k][0]  # (for the message only)
                    raise ShardingError(
                        f"{name} at 'args[{i}]/{path}': a donated Array requires grad, so autograd may still need "
                        f"its buffers; donate only values no gradient flows into (params and optimiser state of a "
                        f"step that takes its own gradients), or drop {i} from donate."
                    )
                flags.append(leaf.owned)
            else:
                flags.append(False)
        out.append(flags)
    return out


_is_cow = torch._C._is_cow_tensor


def _owned(leaves: Sequence[Any]) -> bool:
    """Whether a shard_map output's device blocks are fresh: no views, no copy-on-write clones of an input."""
    return all(isinstance(v, torch.Tensor) and v._base is None and not torch._C._is_cow_tensor(v) for v in leaves)


def device_args(coords: Coords, blocks: list[list[Any]]) -> list[list[Any]]:
    """One device's local leaves, per argument: its block of each tensor leaf, other leaves as they are."""
    return [[leaf[coords] if isinstance(leaf, dict) else leaf for leaf in arg] for arg in blocks]


def _out_plan(name: str, mesh: Mesh, out_specs: Any, out_def: Any, leaves: list[Any]) -> OutPlan:
    """Path, spec and global shape of each output leaf, validated."""
    template = optree.tree_unflatten(out_def, leaves)
    paths = ["out" + (f"/{p}" if p else "") for p, _ in pytree.leaves_with_path(template, is_leaf=is_array)]
    specs = pytree.broadcast_prefix(out_specs, template, prefix_is_leaf=is_spec, where=f"{name}: out_specs: ")
    plan: list[tuple[str, P, tuple[int, ...] | None]] = []
    for path, spec, v0 in zip(paths, specs, leaves, strict=True):
        if not isinstance(v0, torch.Tensor):
            if spec != P():
                raise ShardingError(
                    f"{name} at '{path}': the function returned a {type(v0).__name__}, which cannot be laid "
                    f"out by {spec!r}; return a tensor or give P()."
                )
            plan.append((path, spec, None))
            continue
        if not isinstance(spec, P) or len(spec) > v0.dim():
            check_spec(spec, v0.shape, mesh, path=path, fn=name)
        dims = spec.dim_axes(v0.dim())
        shape = mesh.shape
        gshape = tuple(s * math.prod(shape.get(a, 1) for a in axes) for s, axes in zip(v0.shape, dims, strict=True))
        check_spec(spec, gshape, mesh, path=path, fn=name)
        plan.append((path, spec, gshape))
    return OutPlan(plan)


def check_structures(name: str, all_coords: list[Coords], results: list[Any]) -> Any:
    """The output tree structure every device returned (they must agree)."""
    out_def = results[0][1]
    for c, (_, d) in zip(all_coords, results, strict=True):
        if d != out_def:
            raise ShardingError(
                f"{name}: devices returned different output structures: {out_def} on device {all_coords[0]} and "
                f"{d} on device {c}; every device must return the same tree."
            )
    return out_def


def assemble_outputs(
    name: str,
    mesh: Mesh,
    plan: OutPlan,
    check_vma: bool,
    all_coords: list[Coords],
    results: list[Any],
    shards: Any = None,
    uneven: bool = False,
) -> Any:
    """The devices' outputs (``(leaves, treedef)`` per device, in ``all_coords`` order) checked against
    ``plan`` and assembled into ``fs.Array``s; ``shards`` makes an Array's dict of blocks from the devices' (the
    executor's ``shards``; None: a plain dict). Blocks may differ in shape along the dims their spec shards, as
    ``torch.tensor_split``'s blocks do: the global shape is their sum. ``uneven``: an input was split unevenly,
    so under ``"dist"`` the processes exchange their blocks' shapes (see :func:`assemble_one`)."""
    out_def = results[0][1]
    if len(results) == 1:
        leaves = assemble_one(name, mesh, plan, check_vma, all_coords[0], results[0][0], False, shards, uneven)
        return optree.tree_unflatten(out_def, leaves)
    out = []
    seen: set[int] = set()  # storages of the blocks assembled so far
    for k, (path, spec, gshape) in enumerate(plan):
        vals = [r[0][k] for r in results]
        v0 = vals[0]
        for c, v in zip(all_coords, vals, strict=True):
            if isinstance(v, torch.Tensor) != isinstance(v0, torch.Tensor):
                raise ShardingError(
                    f"{name} at '{path}': device {c} returned a {type(v).__name__} but device {all_coords[0]} "
                    f"returned a {type(v0).__name__}; every device must return the same kind of value."
                )
        if gshape is None:  # a non-tensor leaf (its spec checked P() with the plan)
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
        allowed = plan.allowed[k]
        shape0 = v0.shape
        if any(v.shape != shape0 for v in vals):  # uneven blocks (tensor_split's): the global shape is their sum
            by = dict(zip(all_coords, vals, strict=True))
            found = by if shards is None else shards(by)
            gshape = blocks_shape(name, path, spec, mesh, lambda c, f=found: tuple(f[c].shape), all_coords)
        for c, v in zip(all_coords, vals, strict=True):
            if v.dtype != v0.dtype:
                raise ShardingError(
                    f"{name} at '{path}': device {c} returned dtype {v.dtype} but device {all_coords[0]} returned "
                    f"{v0.dtype}; every device must return blocks of the same dtype."
                )
            if check_vma:
                extra = sorted(get_vma(v) - allowed)
                if extra:
                    _vma_error(name, path, spec, extra)
        if not check_vma and len(vals) > 1 and mesh.backend_impl.holds_data:
            _check_replicated(name, path, spec, mesh, all_coords, vals)
        owned = _owned(vals)
        if owned:  # no storage shared with another device's block or another output (returned twice)
            try:
                ptrs = [v.untyped_storage().data_ptr() for v in vals if v.numel()]
                owned = len(set(ptrs)) == len(ptrs) and not seen.intersection(ptrs)
            except RuntimeError:  # a ZeroTensor block (a zero tangent / cotangent): no memory of its own to hand on
                ptrs = [v.untyped_storage().data_ptr() for v in vals if v.numel() and not v._is_zerotensor()]
                owned = False
            seen.update(ptrs)
        blocks = dict(zip(all_coords, vals, strict=True))
        out.append(Array(mesh, spec, gshape, v0.dtype, blocks if shards is None else shards(blocks), owned))
    return optree.tree_unflatten(out_def, out)


def assemble_one(
    name: str,
    mesh: Mesh,
    plan: OutPlan,
    check_vma: bool,
    coords: Coords,
    leaves: list[Any],
    clear: bool = True,
    shards: Any = None,
    uneven: bool = False,
) -> list[Any]:
    """:func:`assemble_outputs` of one device (``"dist"``, or a mesh of one): nothing to compare between devices;
    the leaf kinds and shapes are the plan's (its key), so only the vma tags and storages are read. ``clear``: it
    also clears each block's own vma tag as it reads it (``clear_vma`` of the outputs, in the same pass; where it
    raises, the caller clears the rest); ``shards`` as in :func:`assemble_outputs`.

    ``uneven`` (an input was split unevenly, which every process knows from the call's signature, or the body
    noted uneven blocks, or :meth:`InputCache.exchange_due` asks for it): under ``"dist"`` the processes exchange
    their blocks' shapes (one small exchange), and the global shape of an output whose blocks differ is their
    sum. Otherwise a block is taken to be an even split of its output (its shape times its axes' sizes), as no
    process sees the others' blocks."""
    out: list[Any] = []
    seen: set[int] = set()  # storages of the blocks assembled so far
    tags = take_vmas(leaves) if clear else [None] * len(leaves)
    gshapes = _exchanged_shapes(name, mesh, plan, leaves) if uneven and mesh.is_multiprocess else None
    for k, (v, (path, spec, gshape), allowed, tag) in enumerate(zip(leaves, plan, plan.allowed, tags, strict=True)):
        if gshape is None:  # a non-tensor leaf (its spec checked P() with the plan): as it is
            out.append(v)
            continue
        if gshapes is not None:
            gshape = gshapes[k]
        if check_vma:
            vma = get_vma(v) if tag is None else tag  # (its own tag, else a view's base's or a wrapper's)
            if not vma <= allowed:
                _vma_error(name, path, spec, sorted(vma - allowed))
        if v._base is None and not _is_cow(v):  # _owned((v,))
            # no storage shared with another output (returned twice); a storage with no memory (no elements) is
            # none's (its address is 0)
            try:
                ptr = v.untyped_storage().data_ptr()
            except RuntimeError:  # a ZeroTensor (a zero tangent / cotangent): no memory of its own to hand on
                owned = False
            else:
                owned = not ptr or ptr not in seen
                seen.add(ptr)
        else:
            owned = False
        out.append(Array(mesh, spec, gshape, v.dtype, {coords: v} if shards is None else shards({coords: v}), owned))
    return out


def _exchanged_shapes(name: str, mesh: Mesh, plan: OutPlan, leaves: list[Any]) -> list[Any]:
    """Under ``"dist"``: the global shape of each output leaf from every process's block shape (exchanged)."""
    mine = [tuple(v.shape) if g is not None else None for v, (_, _, g) in zip(leaves, plan, strict=True)]
    every = mesh.all_gather_object(mine)  # per process (= device rank): its blocks' shapes
    coords = [tuple(c.values()) for c in mesh.device_coords()]
    by = dict(zip(coords, every, strict=True))
    out: list[Any] = []
    for k, (path, spec, gshape) in enumerate(plan):
        if gshape is None or all(s[k] == mine[k] for s in every):
            out.append(gshape)
        else:
            out.append(blocks_shape(name, path, spec, mesh, lambda c, k=k: by[c][k], coords))
    return out


def _coords_at(mesh: Mesh, axes: tuple[str, ...], index: int) -> Coords:
    """The device whose block index over ``axes`` is ``index`` (major first), at 0 on every other axis."""
    at = dict.fromkeys(mesh.axis_names, 0)
    for a in reversed(axes):
        index, at[a] = divmod(index, mesh.shape[a])
    return tuple(at.values())


def blocks_shape(
    name: str, path: str, spec: P, mesh: Mesh, shape_of: Callable[[Coords], tuple[int, ...]], coords: list[Coords]
) -> tuple[int, ...]:
    """The global shape of an output whose devices' blocks differ in shape: along each dim its spec shards, the
    sum of its blocks, which must be ``torch.tensor_split``'s blocks of that sum; along any other dim, the
    blocks' common size. ``shape_of(c)``: the shape of the block of the device at ``c`` (any device);
    ``coords``: the devices whose blocks are checked.

    Raises:
        ShardingError: blocks that differ along a dim the spec does not shard, or that are not tensor_split's.

    Example:
        >>> # blocks of 3, 3, 2, 2 rows on dp=4 with spec P("dp"): a global dim of 10
    """
    names = mesh.axis_names
    first = shape_of(coords[0])
    out: list[int] = []
    for d, axes in enumerate(spec.dim_axes(len(first))):
        n = math.prod(mesh.shape[a] for a in axes)
        sizes = [shape_of(_coords_at(mesh, axes, i))[d] for i in range(n)] if axes else [first[d]]
        size = sum(sizes) if axes else first[d]
        if axes and tuple(sizes) != split_sizes(size, n):
            c = next(c for c in coords if shape_of(c) != first)
            raise ShardingError(
                f"{name} at '{path}': device {c} returned shape {shape_of(c)} but device {coords[0]} returned "
                f"{first}, and out_specs gives {spec!r}: the devices' blocks along dim {d} have sizes {sizes} over "
                f"{axes}, which are not torch.tensor_split's blocks of a dim of {size} "
                f"({list(split_sizes(size, n))}); return blocks of one shape, or tensor_split's (the first ones "
                f"one row longer)."
            )
        for c in coords:
            want = sizes[block_index(axes, dict(zip(names, c, strict=True)), mesh.shape)[0]] if axes else size
            got = shape_of(c)
            if len(got) != len(first) or got[d] != want:
                raise ShardingError(
                    f"{name} at '{path}': device {c} returned shape {got} but device {coords[0]} returned "
                    f"{first}; blocks may differ only along the dims out_specs {spec!r} shards, as "
                    f"torch.tensor_split's blocks of the global dim do."
                )
        out.append(size)
    return tuple(out)


def _vma_error(name: str, path: str, spec: P, extra: list[str]) -> None:
    raise ShardingError(
        f"{name} at '{path}': the output varies over axis '{extra[0]}' but out_specs gives "
        f"{spec!r}, which does not name it (so it promises the value is the same on every "
        f"device of '{extra[0]}'). Reduce it first (fs.psum / fs.pmean over '{extra[0]}'), or name "
        f"'{extra[0]}' in the out spec."
    )


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
                a, b = comparable(v.detach()), comparable(by[c2].detach())
                if not torch.equal(a, b):
                    wide = torch.complex128 if a.is_complex() else torch.float64
                    diff = (a.to(wide) - b.to(wide)).abs().max().item()
                    raise ShardingError(
                        f"{name} at '{path}': out_specs gives {spec!r}, which says the output is the same on "
                        f"every device of axis '{axis}', but device {dict(zip(names, c, strict=True))} and device "
                        f"{dict(zip(names, c2, strict=True))} differ by up to {diff:.3g}. Reduce it over '{axis}' "
                        f"(fs.psum / fs.pmean), or name '{axis}' in the out spec."
                    )
