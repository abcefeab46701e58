"""Optimisers as pure transforms of pytrees (optax's design), usable inside ``shard_map``.

An :class:`Optimizer` is three pure functions: ``init(params) -> state``, ``transform(grads, state, params)
-> (updates, state)`` and ``state_specs(param_specs) -> spec tree of the state``, plus ``update(grads, state,
params) -> (params, state)``. Nothing is changed in place; every call returns new trees. Inside ``shard_map``
each device transforms its local shards, and the state is laid out like the params (its leaves take the
params' specs; scalars such as the step count take ``P()``). The arithmetic mirrors ``torch.optim`` and
``torch.nn.utils.clip_grad_norm_`` operation by operation, so an unsharded run matches them bit for bit.

``clip_by_global_norm`` needs the norm over every shard: each leaf's sum of squares is summed with the others
that are sharded over the same mesh axes (read from the vma tags ``shard_map`` puts on its inputs, or from
``specs=``), then ``psum``-ed over those axes only: one collective per distinct axis set, none over axes a
leaf is replicated on.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P, optim
    >>> mesh = fs.make_mesh({"tp": 2}, backend="sim")
    >>> specs = {"w": P("tp", None), "b": P()}
    >>> params = {"w": torch.ones(4, 2), "b": torch.zeros(2)}
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
    >>> step = fs.shard_map(opt.update, mesh=mesh, in_specs=(specs, opt.state_specs(specs), specs),
    ...                     out_specs=(specs, opt.state_specs(specs)))
    >>> params, state = step(params, opt.init(params), params)  # the params as their own gradient
    >>> fs.device_get(params["w"]).shape
    torch.Size([4, 2])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

from . import lax, pytree
from ._array import Array
from ._context import maybe_current
from ._errors import ShardingError
from ._spec import P, is_spec
from ._vma import _ATTR, _is_wrapped, _unwrap, get_vma

__all__ = [
    "AdamWState",
    "ClipByGlobalNormState",
    "Optimizer",
    "Schedule",
    "SgdState",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "global_norm",
    "linear_warmup",
    "sgd",
    "warmup_cosine",
]

PyTree = Any
Schedule = Callable[[Any], float | torch.Tensor]
"""A learning rate as a function of the step count (an int or a 0-dim tensor: updates done so far)."""
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
            >>> opt = adamw(1e-3)
            >>> p = {"w": torch.zeros(3)}
            >>> p, state = opt.update({"w": torch.ones(3)}, opt.init(p), p)
        """
        if params is None:
            raise ValueError(f"{self.name}.update: params are required (new params = params + updates).")
        if self.apply is not None:
            return self.apply(grads, state, params)
        updates, state = self.transform(grads, state, params)
        return apply_updates(params, updates), state


class AdamWState(NamedTuple):
    """State of :func:`adamw`: the step count (``P()``), first and second moments (the params' specs)."""

    count: Any
    mu: PyTree
    nu: PyTree


class SgdState(NamedTuple):
    """State of :func:`sgd`: the step count (``P()``) and the momentum buffers (``None`` without momentum)."""

    count: Any
    momentum: PyTree


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: the global norm of the last gradients seen (``P()``), for logs."""

    norm: Any


# ---------------------------------------------------------------------------------------------------- helpers


def _is_array(x: Any) -> bool:
    return isinstance(x, Array)


def _zeros_like(x: Any, name: str) -> Any:
    if isinstance(x, Array):
        return Array(x.mesh, x.spec, x.shape, x.dtype, {c: torch.zeros_like(s) for c, s in x.shards.items()})
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    raise ShardingError(f"{name}.init: params leaves must be torch.Tensors or fs.Arrays, found {type(x).__name__}.")


def _scalar_like(params: PyTree, value: float, dtype: torch.dtype) -> Any:
    """A 0-dim ``value``: an ``fs.Array`` with spec ``P()`` when the params are Arrays, else a tensor."""
    leaves = optree.tree_leaves(params, is_leaf=_is_array)
    for x in leaves:
        if isinstance(x, Array):
            shards = {c: torch.tensor(value, dtype=dtype, device=s.device) for c, s in x.shards.items()}
            return Array(x.mesh, P(), (), dtype, shards)
    device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
    return torch.tensor(value, dtype=dtype, device=device)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _leaves(fn: str, what: str, tree: PyTree) -> tuple[list[str], list[torch.Tensor], Any]:
    """Paths, tensor leaves and treespec of ``tree``; clear errors for Arrays and non-tensors."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, is_leaf=_is_array)
    names = [pytree.tree_path(p) or "<root>" for p in paths]
    for n, x in zip(names, leaves, strict=True):
        if isinstance(x, Array):
            _array_error(fn, f"{what} leaf '{n}'")
        if not isinstance(x, torch.Tensor):
            raise ShardingError(f"{fn}: {what} leaf '{n}' must be a torch.Tensor, found {type(x).__name__}.")
    return names, leaves, treedef


def _array_error(fn: str, what: str) -> None:
    raise ShardingError(
        f"{fn}: {what} is an fs.Array (a global value); optimisers work on local shards. Call it inside "
        f"fs.shard_map, giving the state the in_spec opt.state_specs(param_specs)."
    )


def _check_like(fn: str, what: str, tree: PyTree, like: PyTree, like_what: str) -> list[torch.Tensor]:
    """The leaves of ``tree``, checked to have the structure and shapes of ``like``."""
    names, leaves, treedef = _leaves(fn, what, tree)
    l_names, l_leaves, l_def = _leaves(fn, like_what, like)
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


def _check_state(fn: str, state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        raise ShardingError(
            f"{fn}: state must be the {cls.__name__} that init(params) returns, found {type(state).__name__}."
        )


def _check_count(fn: str, count: Any) -> int:
    if isinstance(count, Array):
        _array_error(fn, "state.count")
    if not isinstance(count, torch.Tensor) or count.dim() != 0:
        raise ShardingError(f"{fn}: state.count must be a 0-dim tensor (spec P()), found {count!r}.")
    return int(count)


def _check_nonneg(fn: str, **values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{fn}: {k} must be a finite number >= 0, found {v!r}.")


def _check_lr(fn: str, lr: Any) -> None:
    if not callable(lr):
        _check_nonneg(fn, lr=lr)


def _lr_at(fn: str, lr: float | Schedule, count: torch.Tensor) -> float:
    if not callable(lr):
        return float(lr)
    value = float(lr(count))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{fn}: the lr schedule gave {value} at step {int(count)}; it must be finite and >= 0.")
    return value


def _explicit_vma(t: torch.Tensor) -> frozenset[str] | None:
    """The vma tag of ``t`` (looking through torch.func wrappers), or None when it carries none."""
    while True:
        v = t.__dict__.get(_ATTR)
        if v is not None:
            return v
        if not _is_wrapped(t):
            return None
        t = _unwrap(t)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates``, leaf by leaf, in the params' dtypes.

    Example:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    leaves = _check_like("apply_updates", "updates", updates, params, "params")
    _, p_leaves, treedef = _leaves("apply_updates", "params", params)
    return optree.tree_unflatten(treedef, [(p + u).to(p.dtype) for p, u in zip(p_leaves, leaves, strict=True)])


# ------------------------------------------------------------------------------------------------ global norm


def global_norm(tree: PyTree, *, specs: PyTree = None, params: PyTree = None) -> torch.Tensor:
    """The 2-norm of all leaves of ``tree`` taken together, over every shard of the global value.

    Inside ``shard_map``, each leaf's sum of squares is psum-ed over the mesh axes the leaf is sharded on:
    those ``specs`` names (a spec tree prefix of ``tree``) when given, else those of the matching ``params``
    leaf's vma tag, else those of the leaf's own tag. Leaves sharded over the same axes are summed first, so
    there is one psum per distinct axis set (axes of size 1 are skipped). Outside ``shard_map``: no psum.

    Args:
        tree: a pytree of tensors (local shards inside shard_map).
        specs: optional spec tree (prefix) naming each leaf's sharded axes; wins over the tags.
        params: optional tree of the same structure whose tags name the sharded axes (e.g. the params whose
            gradients ``tree`` holds).

    Returns:
        A 0-dim tensor (float32, or float64 for float64 leaves), invariant over every mesh axis.

    Raises:
        ShardingError: ``specs`` or ``params`` do not fit ``tree``, or ``specs`` names an axis the mesh lacks.

    Example:
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
        tensor(5.)
    """
    names, leaves, _ = _leaves("global_norm", "tree", tree)
    if not leaves:
        return torch.zeros(())
    ctx = maybe_current()
    axis_sets: list[tuple[str, ...]] = [()] * len(leaves)
    if ctx is not None:
        mesh = ctx.mesh
        if specs is not None:
            spec_list = pytree.broadcast_prefix(specs, tree, prefix_is_leaf=is_spec, where="global_norm: specs: ")
            raw = []
            for n, s in zip(names, spec_list, strict=True):
                if not isinstance(s, P):
                    raise ShardingError(f"global_norm: specs leaf for '{n}' must be a P(...), found {s!r}.")
                bad = [a for a in s.axes if a not in mesh.shape]
                if bad:
                    raise ShardingError(
                        f"global_norm: specs for '{n}' is {s!r}, which names axis '{bad[0]}' that the mesh "
                        f"{dict(mesh.shape)} lacks; use the param specs of this mesh."
                    )
                raw.append(frozenset(s.axes))
        else:
            p_leaves = _check_like("global_norm", "params", params, tree, "tree") if params is not None else None
            raw = []
            for k, g in enumerate(leaves):
                tag = _explicit_vma(p_leaves[k]) if p_leaves is not None else None
                raw.append(tag if tag is not None else get_vma(g))
        axis_sets = [tuple(a for a in mesh.axis_names if a in r and mesh.shape[a] > 1) for r in raw]
    groups: dict[tuple[str, ...], torch.Tensor] = {}
    for g, axes in zip(leaves, axis_sets, strict=True):
        sq = torch.sum(torch.square(g.to(_acc_dtype(g.dtype))))  # [*s] -> [], this shard's sum of squares
        groups[axes] = sq if axes not in groups else groups[axes] + sq
    order = {a: i for i, a in enumerate(ctx.mesh.axis_names)} if ctx is not None else {}
    total: torch.Tensor | None = None
    for axes in sorted(groups, key=lambda k: (len(k), [order[a] for a in k])):  # the same order on every device
        s = groups[axes]
        if axes:
            s = lax.psum(s, axes)  # [] -> [], summed over the shards of these leaves
        total = s if total is None else total + s
    return torch.sqrt(total) if total is not None else torch.zeros(())


def clip_by_global_norm(max_norm: float, *, specs: PyTree = None) -> Optimizer:
    """Scale the updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the global 2-norm of all of them.

    As ``torch.nn.utils.clip_grad_norm_``, with the norm over every shard (see :func:`global_norm`): the
    axes a leaf is sharded on come from ``specs`` when given, else from the vma tags of the params (or, with
    no params, of the updates) that ``shard_map`` puts on its inputs. The state keeps the last norm.

    Args:
        max_norm: the largest global norm let through, > 0.
        specs: optional spec tree (prefix) of the updates, for values without tags.

    Returns:
        An :class:`Optimizer`; chain it before the optimiser proper.

    Raises:
        ValueError: ``max_norm`` not a finite number > 0.

    Example:
        >>> clip = clip_by_global_norm(1.0)
        >>> u, state = clip.transform({"a": torch.tensor([3.0, 4.0])}, clip.init(None), None)
        >>> state.norm, u["a"]
        (tensor(5.), tensor([0.6000, 0.8000]))
    """
    fn = "clip_by_global_norm"
    _check_nonneg(fn, max_norm=max_norm)
    if max_norm <= 0:
        raise ValueError(f"{fn}: max_norm must be > 0, found {max_norm!r}.")
    max_norm = float(max_norm)

    def init(params: PyTree) -> ClipByGlobalNormState:
        leaves = [x for x in optree.tree_leaves(params, is_leaf=_is_array) if isinstance(x, (torch.Tensor, Array))]
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
        return ClipByGlobalNormState(_scalar_like(params, 0.0, dtype))

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, ClipByGlobalNormState]:
        _check_state(fn, state, ClipByGlobalNormState)
        norm = global_norm(grads, specs=specs, params=params)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # [] as torch: max_norm / (norm + 1e-6) <= 1
        return optree.tree_map(lambda g: g * scale, grads), ClipByGlobalNormState(norm)

    return Optimizer(init, transform, lambda param_specs: ClipByGlobalNormState(P()), name=fn)


# ------------------------------------------------------------------------------------------------- optimisers


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Optimizer:
    """AdamW with decoupled weight decay, the arithmetic of ``torch.optim.AdamW`` (single-tensor path).

    Per leaf, with ``t`` the step (from 1): ``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - b1)``;
    ``v = b2 * v + (1 - b2) * g * g``; ``p -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``.
    Elementwise, so each device updates its own shards with no communication.

    Args:
        lr: learning rate, or a schedule of the step count (see :func:`warmup_cosine`).
        b1: first-moment decay, in [0, 1).
        b2: second-moment decay, in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay coefficient, >= 0.

    Returns:
        An :class:`Optimizer` whose state is an :class:`AdamWState`.

    Raises:
        ValueError: a hyperparameter out of range.

    Example:
        >>> opt = adamw(1e-2, weight_decay=0.1)
        >>> p = {"w": torch.ones(2)}
        >>> p, state = opt.update({"w": torch.ones(2)}, opt.init(p), p)
        >>> p["w"]
        tensor([0.9890, 0.9890])
    """
    fn = "adamw"
    _check_lr(fn, lr)
    _check_nonneg(fn, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    for k, v in (("b1", b1), ("b2", b2)):
        if not v < 1:
            raise ValueError(f"{fn}: {k} must be in [0, 1), found {v!r}.")

    def init(params: PyTree) -> AdamWState:
        mu = optree.tree_map(lambda x: _zeros_like(x, fn), params, is_leaf=_is_array)
        nu = optree.tree_map(lambda x: _zeros_like(x, fn), params, is_leaf=_is_array)
        return AdamWState(_scalar_like(params, 0, torch.int64), mu, nu)

    def common(grads: PyTree, state: Any, params: PyTree, where: str) -> tuple[Any, ...]:
        _check_state(where, state, AdamWState)
        step = _check_count(where, state.count) + 1
        _, g_leaves, _ = _leaves(where, "grads", grads)
        m_leaves = _check_like(where, "state.mu", state.mu, grads, "grads")
        v_leaves = _check_like(where, "state.nu", state.nu, grads, "grads")
        p_leaves = _check_like(where, "params", params, grads, "grads") if params is not None else None
        if p_leaves is None and weight_decay != 0:
            raise ValueError(f"{where}: weight_decay={weight_decay} needs the params; pass them as third argument.")
        lr_t = _lr_at(where, lr, state.count)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        step_size, bc2_sqrt = lr_t / bc1, bc2**0.5
        ms, vs, dens = [], [], []
        for g, m, v in zip(g_leaves, m_leaves, v_leaves, strict=True):
            m = torch.lerp(m, g, 1 - b1)  # first moment
            v = v.mul(b2).addcmul(g, g, value=1 - b2)  # second moment
            ms.append(m)
            vs.append(v)
            dens.append(v.sqrt() / bc2_sqrt + eps)
        treedef = optree.tree_structure(grads)
        new_state = AdamWState(state.count + 1, optree.tree_unflatten(treedef, ms), optree.tree_unflatten(treedef, vs))
        return treedef, p_leaves, lr_t, step_size, ms, dens, new_state

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, AdamWState]:
        treedef, p_leaves, lr_t, step_size, ms, dens, new_state = common(grads, state, params, fn)
        ups = []
        for k, (m, d) in enumerate(zip(ms, dens, strict=True)):
            if weight_decay != 0:
                ups.append(torch.addcdiv(p_leaves[k] * -(lr_t * weight_decay), m, d, value=-step_size))
            else:
                ups.append(torch.div(m, d).mul(-step_size))
        return optree.tree_unflatten(treedef, ups), new_state

    def apply(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, AdamWState]:
        treedef, p_leaves, lr_t, step_size, ms, dens, new_state = common(grads, state, params, f"{fn}.update")
        new = []
        for p, m, d in zip(p_leaves, ms, dens, strict=True):
            if weight_decay != 0:
                p = p * (1 - lr_t * weight_decay)  # decoupled weight decay
            new.append(torch.addcdiv(p, m, d, value=-step_size))
        return optree.tree_unflatten(treedef, new), new_state

    def state_specs(param_specs: PyTree) -> AdamWState:
        return AdamWState(P(), param_specs, param_specs)

    return Optimizer(init, transform, state_specs, name=fn, apply=apply)


def sgd(lr: float | Schedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, the arithmetic of ``torch.optim.SGD``.

    Per leaf: ``d = g + wd * p``; with momentum ``buf = momentum * buf + d`` and ``d = buf`` (Nesterov:
    ``d = d + momentum * buf``); ``p -= lr * d``.

    Args:
        lr: learning rate, or a schedule of the step count.
        momentum: momentum factor, >= 0 (0: no buffers in the state).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 penalty added to the gradient, >= 0.

    Returns:
        An :class:`Optimizer` whose state is an :class:`SgdState`.

    Raises:
        ValueError: a hyperparameter out of range.

    Example:
        >>> opt = sgd(0.5, momentum=0.9)
        >>> p = {"w": torch.ones(2)}
        >>> p, state = opt.update({"w": torch.ones(2)}, opt.init(p), p)
        >>> p["w"]
        tensor([0.5000, 0.5000])
    """
    fn = "sgd"
    _check_lr(fn, lr)
    _check_nonneg(fn, momentum=momentum, weight_decay=weight_decay)
    if nesterov and momentum <= 0:
        raise ValueError(f"{fn}: nesterov=True needs momentum > 0, found momentum={momentum!r}.")

    def init(params: PyTree) -> SgdState:
        bufs = optree.tree_map(lambda x: _zeros_like(x, fn), params, is_leaf=_is_array) if momentum else None
        return SgdState(_scalar_like(params, 0, torch.int64), bufs)

    def common(grads: PyTree, state: Any, params: PyTree, where: str) -> tuple[Any, ...]:
        _check_state(where, state, SgdState)
        _check_count(where, state.count)
        _, g_leaves, _ = _leaves(where, "grads", grads)
        p_leaves = _check_like(where, "params", params, grads, "grads") if params is not None else None
        if p_leaves is None and weight_decay != 0:
            raise ValueError(f"{where}: weight_decay={weight_decay} needs the params; pass them as third argument.")
        lr_t = _lr_at(where, lr, state.count)
        ds = [g.add(p_leaves[k], alpha=weight_decay) if weight_decay else g for k, g in enumerate(g_leaves)]
        treedef = optree.tree_structure(grads)
        bufs = None
        if momentum:
            if state.momentum is None:
                raise ShardingError(f"{where}: state.momentum is None but momentum={momentum}; rebuild with init.")
            b_leaves = _check_like(where, "state.momentum", state.momentum, grads, "grads")
            new_b = [b.mul(momentum).add(d) for b, d in zip(b_leaves, ds, strict=True)]
            ds = [d.add(b, alpha=momentum) for d, b in zip(ds, new_b, strict=True)] if nesterov else new_b
            bufs = optree.tree_unflatten(treedef, new_b)
        return treedef, p_leaves, lr_t, ds, SgdState(state.count + 1, bufs)

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, SgdState]:
        treedef, _, lr_t, ds, new_state = common(grads, state, params, fn)
        return optree.tree_unflatten(treedef, [d.mul(-lr_t) for d in ds]), new_state

    def apply(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, SgdState]:
        treedef, p_leaves, lr_t, ds, new_state = common(grads, state, params, f"{fn}.update")
        new = [p.add(d, alpha=-lr_t) for p, d in zip(p_leaves, ds, strict=True)]  # p - lr * d, as torch
        return optree.tree_unflatten(treedef, new), new_state

    def state_specs(param_specs: PyTree) -> SgdState:
        return SgdState(P(), param_specs if momentum else None)

    return Optimizer(init, transform, state_specs, name=fn, apply=apply)


def chain(*transforms: Optimizer) -> Optimizer:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.1))
        >>> p = {"w": torch.zeros(2)}
        >>> p, state = opt.update({"w": torch.tensor([30.0, 40.0])}, opt.init(p), p)
        >>> p["w"], state[0].norm
        (tensor([-0.0600, -0.0800]), tensor(50.))
    """
    fn = "chain"
    if not transforms:
        raise ValueError(f"{fn}: give at least one transform, e.g. chain(clip_by_global_norm(1.0), adamw(3e-4)).")
    for i, t in enumerate(transforms):
        if not isinstance(t, Optimizer):
            raise ValueError(f"{fn}: argument {i} is a {type(t).__name__}, not an Optimizer (e.g. optim.sgd(0.1)).")
    names = ", ".join(t.name for t in transforms)

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ShardingError(
                f"{fn}({names}): state must be the tuple of {len(transforms)} states that init(params) returns, "
                f"found {type(state).__name__}" + (f" of length {len(state)}." if isinstance(state, tuple) else ".")
            )

    def init(params: PyTree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, tuple[Any, ...]]:
        check(state)
        new = []
        for t, s in zip(transforms, state, strict=True):
            grads, s = t.transform(grads, s, params)
            new.append(s)
        return grads, tuple(new)

    def apply(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, tuple[Any, ...]]:
        check(state)
        new = []
        for t, s in zip(transforms[:-1], state[:-1], strict=True):
            grads, s = t.transform(grads, s, params)
            new.append(s)
        params, s = transforms[-1].update(grads, state[-1], params)
        return params, (*new, s)

    def state_specs(param_specs: PyTree) -> tuple[Any, ...]:
        return tuple(t.state_specs(param_specs) for t in transforms)

    return Optimizer(init, transform, state_specs, name=f"{fn}({names})", apply=apply)


# -------------------------------------------------------------------------------------------------- schedules


def _step_of(step: Any) -> int:
    return int(step)


def constant(lr: float) -> Schedule:
    """The schedule that is ``lr`` at every step.

    Example:
        >>> constant(0.1)(torch.tensor(7))
        0.1
    """
    _check_nonneg("constant", lr=lr)
    value = float(lr)
    return lambda step: value


def linear_warmup(peak_lr: float, warmup_steps: int, *, init_lr: float = 0.0) -> Schedule:
    """Linear from ``init_lr`` at step 0 to ``peak_lr`` at ``warmup_steps``, then constant.

    Example:
        >>> s = linear_warmup(1.0, 4)
        >>> [s(i) for i in (0, 2, 4, 9)]
        [0.0, 0.5, 1.0, 1.0]
    """
    _check_nonneg("linear_warmup", peak_lr=peak_lr, warmup_steps=warmup_steps, init_lr=init_lr)

    def schedule(step: Any) -> float:
        s = _step_of(step)
        if s >= warmup_steps:
            return float(peak_lr)
        return init_lr + (peak_lr - init_lr) * s / warmup_steps

    return schedule


def warmup_cosine(
    peak_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 0.0, *, init_lr: float = 0.0
) -> Schedule:
    """Linear warmup from ``init_lr`` to ``peak_lr`` over ``warmup_steps``, then cosine decay to ``final_lr``
    at ``total_steps`` (and ``final_lr`` after), as optax's ``warmup_cosine_decay_schedule``.

    Args:
        peak_lr: the rate at the end of the warmup.
        warmup_steps: steps of linear warmup, >= 0.
        total_steps: the step at which the decay ends (warmup included), > ``warmup_steps``.
        final_lr: the rate at and after ``total_steps``.
        init_lr: the rate at step 0.

    Returns:
        A function of the step count (int or 0-dim tensor) returning a float.

    Raises:
        ValueError: negative rates or steps, or ``total_steps <= warmup_steps``.

    Example:
        >>> s = warmup_cosine(1.0, 10, 110)
        >>> [round(s(i), 4) for i in (0, 5, 10, 60, 110, 200)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    fn = "warmup_cosine"
    _check_nonneg(fn, peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps)
    _check_nonneg(fn, final_lr=final_lr, init_lr=init_lr)
    if total_steps <= warmup_steps:
        raise ValueError(
            f"{fn}: total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps}); for a warmup alone use "
            f"linear_warmup."
        )

    def schedule(step: Any) -> float:
        s = _step_of(step)
        if s < warmup_steps:
            return init_lr + (peak_lr - init_lr) * s / warmup_steps
        if s >= total_steps:
            return float(final_lr)
        progress = (s - warmup_steps) / (total_steps - warmup_steps)
        return final_lr + (peak_lr - final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule
