"""``multi_steps``: gradient accumulation as an optimiser wrapper, optax's ``MultiSteps``."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..extend import ConfigError, P, ShardingError
from ._base import Optimizer, PyTree, check_count, check_like, is_array, named_leaves, scalar_like, zeros_like


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`: microbatches seen since the last update (``P()``), updates done (``P()``),
    the inner optimiser's state, and the running mean of the gradients (the params' specs).

    Example:
        >>> from funcshard.optim import multi_steps, sgd
        >>> multi_steps(sgd(0.1), 2).init({"w": torch.zeros(2)}).acc_grads
        {'w': tensor([0., 0.])}
    """

    mini_step: Any
    gradient_step: Any
    inner_state: Any
    acc_grads: PyTree


def _check_args(fn: str, opt: Any, k: Any) -> None:
    """:func:`multi_steps`'s arguments checked: ``opt`` an :class:`Optimizer`, ``k`` a positive int."""
    if not isinstance(opt, Optimizer):
        raise ConfigError(f"{fn}: opt must be an Optimizer (e.g. optim.adamw(3e-4)), found {type(opt).__name__}.")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"{fn}: k must be a positive int (microbatches per update), found {k!r}.")


def multi_steps(opt: Optimizer, k: int) -> Optimizer:
    """Accumulate ``k`` gradients and apply ``opt`` to their mean every ``k``-th call: optax's ``MultiSteps``.

    Each call adds its gradients to a running mean (``acc + (g - acc) / (n + 1)``, optax's Welford update);
    the ``k``-th call hands the mean to ``opt`` and resets it, the others leave the params (and ``opt``'s
    state) as they are. With a mean loss over equal microbatches, ``k`` calls on ``k`` microbatches are one
    step of ``opt`` on the ``k``-times larger batch; a loss averaged over the counted tokens of microbatches
    that count different numbers (labels ``-100`` spread unevenly) is not: scale each microbatch's loss by
    ``k * its counted tokens / all counted tokens`` for the big batch's mean. Inside ``shard_map`` the
    accumulator is laid out like the params (:meth:`Optimizer.state_specs`), so accumulating costs no
    communication.

    Args:
        opt: the optimiser to apply every ``k`` calls (e.g. ``chain(clip_by_global_norm(1.0), adamw(3e-4))``).
        k: microbatches per update, >= 1 (1: ``opt`` itself, with a little bookkeeping).

    Returns:
        An :class:`Optimizer` whose state is a :class:`MultiStepsState`.

    Raises:
        ConfigError: ``opt`` not an Optimizer, ``k`` not a positive int.

    Example:
        >>> from funcshard.optim import sgd
        >>> opt = multi_steps(sgd(1.0), 2)
        >>> p = {"w": torch.zeros(2)}
        >>> state = opt.init(p)
        >>> p, state = opt.update({"w": torch.tensor([1.0, 2.0])}, state, p)  # accumulated: p unchanged
        >>> p["w"]
        tensor([0., 0.])
        >>> p, state = opt.update({"w": torch.tensor([3.0, 4.0])}, state, p)  # the mean applied
        >>> p["w"], int(state.gradient_step)
        (tensor([-2., -3.]), 1)
    """
    fn = "multi_steps"
    _check_args(fn, opt, k)
    name = f"{fn}({opt.name}, {k})"

    def init(params: PyTree) -> MultiStepsState:
        acc = optree.tree_map(lambda x: zeros_like(x, fn), params, is_leaf=is_array)
        zero = scalar_like(params, 0, torch.int64)
        return MultiStepsState(zero, scalar_like(params, 0, torch.int64), opt.init(params), acc)

    def accumulate(grads: PyTree, state: Any, where: str) -> tuple[int, PyTree, bool]:
        if not isinstance(state, MultiStepsState):
            raise ShardingError(
                f"{where}: state must be the MultiStepsState that init(params) returns, found {type(state).__name__}."
            )
        n = check_count(where, state.mini_step)
        _, g_leaves, treedef = named_leaves(where, "grads", grads)
        a_leaves = check_like(where, "state.acc_grads", state.acc_grads, grads, "grads")
        acc = [a + (g - a) / (n + 1) for g, a in zip(g_leaves, a_leaves, strict=True)]  # running mean
        # (an abstract run has no count to read: it plans the microbatch that updates, the dearest)
        emit = True if isinstance(n, torch.Tensor) and n.is_meta else n == k - 1
        return n, optree.tree_unflatten(treedef, acc), emit

    def after(state: MultiStepsState, n: int, acc: PyTree, emit: bool, inner: Any) -> MultiStepsState:
        if emit:
            zeros = optree.tree_map(torch.zeros_like, acc)
            return MultiStepsState(state.mini_step * 0, state.gradient_step + 1, inner, zeros)
        return MultiStepsState(state.mini_step + 1, state.gradient_step, state.inner_state, acc)

    def transform(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, MultiStepsState]:
        n, acc, emit = accumulate(grads, state, name)
        if emit:
            updates, inner = opt.transform(acc, state.inner_state, params)
            return updates, after(state, n, acc, emit, inner)
        return optree.tree_map(torch.zeros_like, acc), after(state, n, acc, emit, None)

    def apply(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, MultiStepsState]:
        n, acc, emit = accumulate(grads, state, f"{name}.update")
        if emit:
            params, inner = opt.update(acc, state.inner_state, params)
            return params, after(state, n, acc, emit, inner)
        return params, after(state, n, acc, emit, None)

    def state_specs(param_specs: PyTree) -> MultiStepsState:
        return MultiStepsState(P(), P(), opt.state_specs(param_specs), param_specs)

    return Optimizer(init, transform, state_specs, name=name, apply=apply)
