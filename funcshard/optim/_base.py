"""The :class:`Optimizer` type, the optimiser states, :func:`apply_updates` and the checks every transform shares.

An optimiser is pure data plus pure functions: nothing is changed in place, every call returns new trees, and
inside ``shard_map`` each device works on its local shards (see the package docstring, ``funcshard.optim``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

from .. import pytree
from ..extend import Array, ConfigError, P, ShardingError, maybe_current

PyTree = Any
_Fn = Callable[..., tuple[PyTree, PyTree]]


@dataclass(frozen=True)
class Optimizer:
    """A gradient transformation: pure ``init`` / ``transform`` / ``state_specs`` functions.

    Attributes:
        init: ``params -> state``. Works on local tensors (inside shard_map), full tensors, or ``fs.Array``s
            (the state then has the same layouts).
        transform: ``(grads, state, params=None) -> (updates, state)``; the new params are
            ``params + updates`` (see :func:`apply_updates`).
        state_specs: ``param_specs -> state spec tree``, to pass the state through ``shard_map``.
        name: used in error messages.
        apply: optional ``(grads, state, params) -> (params, state)`` doing the last step in one fused
            expression, as torch does (bit-exact); :meth:`update` uses it when present.

    Example:
        >>> from funcshard.optim import sgd
        >>> opt = sgd(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> p, state = opt.update({"w": torch.ones(2)}, opt.init(p), p)
        >>> p["w"]
        tensor([0.9000, 0.9000])
    """

    init: Callable[[PyTree], PyTree]
    transform: _Fn
    state_specs: Callable[[PyTree], PyTree]
    name: str = "optimizer"
    apply: _Fn | None = None

    def update(self, grads: PyTree, state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        """One step: ``(new_params, new_state)`` from ``grads``, ``state`` and ``params``.

        Example:
            >>> from funcshard.optim import adamw
            >>> opt = adamw(1e-3)
            >>> p = {"w": torch.zeros(3)}
            >>> p, state = opt.update({"w": torch.ones(3)}, opt.init(p), p)
        """
        if params is None:
            raise ConfigError(f"{self.name}.update: params are required (new params = params + updates).")
        if maybe_current() is None and has_array(grads, state, params):  # global values: each device its shards
            return on_mesh(self, grads, state, params)
        if self.apply is not None:
            return self.apply(grads, state, params)
        updates, state = self.transform(grads, state, params)
        return apply_updates(params, updates), state


class AdamWState(NamedTuple):
    """State of :func:`adamw`: the step count (``P()``), first and second moments (the params' specs).

    Example:
        >>> from funcshard.optim import adamw
        >>> adamw(1e-3).init({"w": torch.zeros(2)})
        AdamWState(count=tensor(0), mu={'w': tensor([0., 0.])}, nu={'w': tensor([0., 0.])})
    """

    count: Any
    mu: PyTree
    nu: PyTree


class SgdState(NamedTuple):
    """State of :func:`sgd`: the step count (``P()``) and the momentum buffers (``None`` without momentum).

    Example:
        >>> from funcshard.optim import sgd
        >>> sgd(0.1).init({"w": torch.zeros(2)})
        SgdState(count=tensor(0), momentum=None)
        >>> sgd(0.1, momentum=0.9).init({"w": torch.zeros(2)}).momentum
        {'w': tensor([0., 0.])}
    """

    count: Any
    momentum: PyTree


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: the global norm of the last gradients seen (``P()``), for logs.

    Example:
        >>> from funcshard.optim import clip_by_global_norm
        >>> clip = clip_by_global_norm(1.0)
        >>> p = {"w": torch.zeros(2)}
        >>> updates, state = clip.transform({"w": torch.tensor([3.0, 4.0])}, clip.init(p), p)
        >>> state
        ClipByGlobalNormState(norm=tensor(5.))
    """

    norm: Any


# ---------------------------------------------------------------------------------------------------- helpers


def is_array(x: Any) -> bool:
    return isinstance(x, Array)


def has_array(*trees: PyTree) -> bool:
    """Whether a leaf of ``trees`` is an ``fs.Array``."""
    return any(isinstance(x, Array) for t in trees for x in optree.tree_leaves(t, is_leaf=is_array))


def on_mesh(opt: Optimizer, grads: PyTree, state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
    """``opt.update`` of global values (``fs.Array``s, as optax updates sharded ``jax.Array``s) outside
    ``shard_map``: run inside one over their mesh, each device on its shards, with the params' specs (a plain
    tensor leaf is a replicated full value, ``P()``) and the state laid out by ``opt.state_specs``; grads and
    state in other layouts are resharded on the way in.

    Raises:
        ShardingError: Arrays on different meshes.
    """
    from ..extend import shard_map

    meshes = {x.mesh for t in (grads, state, params) for x in optree.tree_leaves(t, is_leaf=is_array) if is_array(x)}
    if len(meshes) > 1:
        raise ShardingError(
            f"{opt.name}.update: the grads, state and params are fs.Arrays on {len(meshes)} different meshes "
            f"({', '.join(sorted(str(dict(m.shape)) for m in meshes))}); put them on one with fs.reshard / device_put."
        )
    mesh = meshes.pop()
    leaves, treedef = optree.tree_flatten(params, is_leaf=is_array)
    key = (mesh, treedef, tuple(x.spec if is_array(x) else P() for x in leaves))
    steps = _ON_MESH.setdefault(opt, {})
    step = steps.get(key)
    if step is None:  # made once per optimiser, mesh and layout: shard_map keeps its plans on the step
        specs = optree.tree_unflatten(treedef, list(key[2]))
        state_specs = opt.state_specs(specs)
        ref = weakref.ref(opt)  # (the cache's value must not hold its key)
        step = steps[key] = shard_map(
            lambda g, s, p: ref().update(g, s, p),  # type: ignore[union-attr]
            mesh=mesh,
            in_specs=(specs, state_specs, specs),
            out_specs=(specs, state_specs),
        )
    return step(grads, state, params)


#: :func:`on_mesh`'s shard_map'd updates, by optimiser (dropped with it), then mesh and the params' layout
_ON_MESH: weakref.WeakKeyDictionary[Optimizer, dict[Any, Any]] = weakref.WeakKeyDictionary()


def zeros_like(x: Any, name: str) -> Any:
    if isinstance(x, Array):
        return Array(x.mesh, x.spec, x.shape, x.dtype, {c: torch.zeros_like(s) for c, s in x.shards.items()})
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    raise ShardingError(f"{name}.init: params leaves must be torch.Tensors or fs.Arrays, found {type(x).__name__}.")


def scalar_like(params: PyTree, value: float, dtype: torch.dtype) -> Any:
    """A 0-dim ``value``: an ``fs.Array`` with spec ``P()`` when the params are Arrays, else a tensor."""
    leaves = optree.tree_leaves(params, is_leaf=is_array)
    for x in leaves:
        if isinstance(x, Array):
            shards = {c: torch.tensor(value, dtype=dtype, device=s.device) for c, s in x.shards.items()}
            return Array(x.mesh, P(), (), dtype, shards)
    device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
    return torch.tensor(value, dtype=dtype, device=device)


def named_leaves(fn: str, what: str, tree: PyTree) -> tuple[list[str], list[torch.Tensor], Any]:
    """Paths, tensor leaves and treespec of ``tree``; clear errors for Arrays and non-tensors."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, is_leaf=is_array)
    names = [pytree.tree_path(p) or "<root>" for p in paths]
    for n, x in zip(names, leaves, strict=True):
        if isinstance(x, Array):
            array_error(fn, f"{what} leaf '{n}'")
        if not isinstance(x, torch.Tensor):
            raise ShardingError(f"{fn}: {what} leaf '{n}' must be a torch.Tensor, found {type(x).__name__}.")
    return names, leaves, treedef


def array_error(fn: str, what: str) -> None:
    raise ShardingError(
        f"{fn}: {what} is an fs.Array (a global value); optimisers work on local shards. Call it inside "
        f"fs.shard_map, giving the state the in_spec opt.state_specs(param_specs)."
    )


def tensor_leaves(fn: str, what: str, tree: PyTree) -> tuple[list[torch.Tensor], Any]:
    """:func:`named_leaves` without the paths (the leaves and treespec of ``tree``): they are only made for an
    error (a leaf that is an Array or no tensor), not at every step."""
    leaves, treedef = optree.tree_flatten(tree, is_leaf=is_array)
    for x in leaves:
        if type(x) is not torch.Tensor and (isinstance(x, Array) or not isinstance(x, torch.Tensor)):
            named_leaves(fn, what, tree)  # raises, naming the leaf
    return leaves, treedef


def check_like(fn: str, what: str, tree: PyTree, like: PyTree, like_what: str) -> list[torch.Tensor]:
    """The leaves of ``tree``, checked to have the structure and shapes of ``like`` (the leaves' paths made only
    for the error)."""
    leaves, treedef = tensor_leaves(fn, what, tree)
    l_leaves, l_def = tensor_leaves(fn, like_what, like)
    with torch._C.DisableTorchFunction():  # shape reads only (no tensor made): no mode to go through
        same = treedef == l_def and all(a.shape == b.shape for a, b in zip(leaves, l_leaves, strict=True))
    if same:
        return leaves
    names, l_names = named_leaves(fn, what, tree)[0], named_leaves(fn, like_what, like)[0]
    if treedef != l_def:
        missing = [n for n in l_names if n not in names]
        extra = [n for n in names if n not in l_names]
        detail = (f"; missing {missing[:3]}" if missing else "") + (f"; unexpected {extra[:3]}" if extra else "")
        raise ShardingError(
            f"{fn}: {what} does not have the tree structure of {like_what}{detail or f' ({treedef} vs {l_def})'}. "
            f"Build the state with opt.init(params) for these params."
        )
    for n, a, b in zip(names, leaves, l_leaves, strict=True):
        if a.shape != b.shape:
            raise ShardingError(
                f"{fn}: {what} leaf '{n}' has shape {tuple(a.shape)} but {like_what} has {tuple(b.shape)}. Inside "
                f"shard_map, pass the state with in_specs opt.state_specs(param_specs) so its shards match."
            )
    return leaves


def check_state(fn: str, state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        raise ShardingError(
            f"{fn}: state must be the {cls.__name__} that init(params) returns, found {type(state).__name__}."
        )


def check_count(fn: str, count: Any, *, read: bool = True) -> Any:
    """``count`` checked to be a 0-dim tensor: its value as an int, or (``read=False``: a compiled step, where a
    number read from a tensor would be frozen into the graph) the tensor itself."""
    if isinstance(count, Array):
        array_error(fn, "state.count")
    if not isinstance(count, torch.Tensor) or count.dim() != 0:
        raise ShardingError(f"{fn}: state.count must be a 0-dim tensor (spec P()), found {count!r}.")
    return int(count) if read and not count.is_meta else count  # (meta: an abstract run, no value to read)


def check_nonneg(fn: str, **values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{fn}: {k} must be a finite number >= 0, found {v!r}.")


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates``, leaf by leaf, in the params' dtypes.

    Example:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    leaves = check_like("apply_updates", "updates", updates, params, "params")
    _, p_leaves, treedef = named_leaves("apply_updates", "params", params)
    return optree.tree_unflatten(treedef, [(p + u).to(p.dtype) for p, u in zip(p_leaves, leaves, strict=True)])
