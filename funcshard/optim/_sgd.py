"""SGD with optional (Nesterov) momentum and L2 weight decay, the arithmetic of ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any

import optree
import torch

from .._errors import ConfigError, ShardingError
from .._spec import P
from ._base import (
    Optimizer,
    PyTree,
    SgdState,
    _check_count,
    _check_like,
    _check_nonneg,
    _check_state,
    _is_array,
    _leaves,
    _scalar_like,
    _zeros_like,
)
from .schedules import Schedule, _check_lr, _lr_at


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
        raise ConfigError(f"{fn}: nesterov=True needs momentum > 0, found momentum={momentum!r}.")

    def init(params: PyTree) -> SgdState:
        bufs = optree.tree_map(lambda x: _zeros_like(x, fn), params, is_leaf=_is_array) if momentum else None
        return SgdState(_scalar_like(params, 0, torch.int64), bufs)

    def common(grads: PyTree, state: Any, params: PyTree, where: str) -> tuple[Any, ...]:
        _check_state(where, state, SgdState)
        _check_count(where, state.count)
        _, g_leaves, _ = _leaves(where, "grads", grads)
        p_leaves = _check_like(where, "params", params, grads, "grads") if params is not None else None
        if p_leaves is None and weight_decay != 0:
            raise ConfigError(f"{where}: weight_decay={weight_decay} needs the params; pass them as third argument.")
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
