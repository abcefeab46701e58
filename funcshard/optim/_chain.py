"""``chain``: several transforms applied one after the other, as one :class:`Optimizer`."""

from __future__ import annotations

from typing import Any

from ..extend import ConfigError, ShardingError
from ._base import Optimizer, PyTree


def chain(*transforms: Optimizer) -> Optimizer:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    Example:
        >>> import torch
        >>> from funcshard.optim import clip_by_global_norm, sgd
        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.1))
        >>> p = {"w": torch.zeros(2)}
        >>> p, state = opt.update({"w": torch.tensor([30.0, 40.0])}, opt.init(p), p)
        >>> p["w"], state[0].norm
        (tensor([-0.0600, -0.0800]), tensor(50.))
    """
    fn = "chain"
    if not transforms:
        raise ConfigError(f"{fn}: give at least one transform, e.g. chain(clip_by_global_norm(1.0), adamw(3e-4)).")
    for i, t in enumerate(transforms):
        if not isinstance(t, Optimizer):
            raise ConfigError(f"{fn}: argument {i} is a {type(t).__name__}, not an Optimizer (e.g. optim.sgd(0.1)).")
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
