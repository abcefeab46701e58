"""SGD with optional (Nesterov) momentum and L2 weight decay, the arithmetic of ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..extend import ConfigError, P, ShardingError, tracing
from ._base import (
    Optimizer,
    PyTree,
    SgdState,
    check_count,
    check_like,
    check_nonneg,
    check_state,
    is_array,
    scalar_like,
    tensor_leaves,
    zeros_like,
)
from .schedules import LrSchedule, check_lr, lr_at


def sgd(
    lr: float | LrSchedule, momentum: float | None = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, the arithmetic of ``torch.optim.SGD``.

    Per leaf: ``d = g + wd * p``; with momentum ``buf = momentum * buf + d`` and ``d = buf`` (Nesterov:
    ``d = d + momentum * buf``); ``p -= lr * d``.

    Args:
        lr: learning rate, or a schedule of the step count.
        momentum: momentum factor, >= 0 (0 or None, optax's default: no buffers in the state).
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
    momentum = 0.0 if momentum is None else momentum
    check_lr(fn, lr)
    check_nonneg(fn, momentum=momentum, weight_decay=weight_decay)
    if nesterov and momentum <= 0:
        raise ConfigError(f"{fn}: nesterov=True needs momentum > 0, found momentum={momentum!r}.")

    def init(params: PyTree) -> SgdState:
        bufs = optree.tree_map(lambda x: zeros_like(x, fn), params, is_leaf=is_array) if momentum else None
        return SgdState(scalar_like(params, 0, torch.int64), bufs)

    def common(grads: PyTree, state: Any, params: PyTree, where: str) -> tuple[Any, ...]:
        check_state(where, state, SgdState)
        check_count(where, state.count, read=not tracing())  # compiled: it stays a tensor
        g_leaves, _ = tensor_leaves(where, "grads", grads)
        p_leaves = check_like(where, "params", params, grads, "grads") if params is not None else None
        if p_leaves is None and weight_decay != 0:
            raise ConfigError(f"{where}: weight_decay={weight_decay} needs the params; pass them as third argument.")
        lr_t = lr_at(where, lr, state.count)
        if p_leaves is not None:  # a low-precision gradient is applied in the parameters' dtype
            g_leaves = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(g_leaves, p_leaves, strict=True)]
        ds = [g.add(p_leaves[k], alpha=weight_decay) if weight_decay else g for k, g in enumerate(g_leaves)]
        treedef = optree.tree_structure(grads)
        bufs = None
        if momentum:
            if state.momentum is None:
                raise ShardingError(f"{where}: state.momentum is None but momentum={momentum}; rebuild with init.")
            b_leaves = check_like(where, "state.momentum", state.momentum, grads, "grads")
            new_b = [b.mul(momentum).add(d) for b, d in zip(b_leaves, ds, strict=True)]
            ds = [d.add(b, alpha=momentum) for d, b in zip(ds, new_b, strict=True)] if nesterov else new_b
            bufs = optree.tree_unflatten(treedef, new_b)
        return treedef, p_leaves, lr_t, ds, SgdState(state.count + 1, bufs)

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, SgdState]:
        treedef, _, lr_t, ds, new_state = common(grads, state, params, fn)
        return optree.tree_unflatten(treedef, [d.mul(-lr_t) for d in ds]), new_state

    def apply(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, SgdState]:
        treedef, p_leaves, lr_t, ds, new_state = common(grads, state, params, f"{fn}.update")
        if isinstance(lr_t, torch.Tensor):  # a schedule's value in a compiled step: no alpha= for a tensor
            # p + d * (-lr): addcmul with -lr in p's dtype rounds as add(alpha=-lr) does (bit for bit, eager)
            new = [torch.addcmul(p, d, (-lr_t).to(p.dtype)) for p, d in zip(p_leaves, ds, strict=True)]
        else:
            new = [p.add(d, alpha=-lr_t) for p, d in zip(p_leaves, ds, strict=True)]  # p - lr * d, as torch
        return optree.tree_unflatten(treedef, new), new_state

    def state_specs(param_specs: PyTree) -> SgdState:
        return SgdState(P(), param_specs if momentum else None)

    return Optimizer(init, transform, state_specs, name=fn, apply=apply)
