"""Learning-rate schedules: functions of the step count (an int or the 0-dim tensor the optimiser state holds).

In a step recorded into a compiled graph (``shard_map(..., compile=...)``) the count is a tensor of the graph,
whose value cannot be read: there a schedule returns a 0-dim float64 tensor computed from it by torch ops (the
same float64 arithmetic as the Python floats of an eager step), as an optax schedule does under ``jax.jit``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..extend import ConfigError, tracing
from ._base import check_nonneg

LrSchedule = Callable[[Any], float | torch.Tensor]
"""A learning rate as a function of the step count (an int or a 0-dim tensor: updates done so far)."""


def check_lr(fn: str, lr: Any) -> None:
    if not callable(lr):
        check_nonneg(fn, lr=lr)


def lr_at(fn: str, lr: float | LrSchedule, count: torch.Tensor) -> float | torch.Tensor:
    """The learning rate at ``count``: a float, or (a compiled step, where ``count``'s value cannot be read) the
    schedule's 0-dim tensor, unchecked."""
    if not callable(lr):
        return float(lr)
    if _traced(count):
        value = lr(count)
        return value if isinstance(value, torch.Tensor) else float(value)
    value = float(lr(count))
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{fn}: the lr schedule gave {value} at step {int(count)}; it must be finite and >= 0.")
    return value


def _step_of(step: Any) -> int:
    return int(step)


def _traced(step: Any) -> bool:
    """Whether ``step`` is a count whose value cannot be read: in a step being recorded into a graph, or in an
    abstract run (a meta tensor)."""
    return isinstance(step, torch.Tensor) and (tracing() or step.is_meta)


def _warmup(s: torch.Tensor, init_lr: float, peak_lr: float, warmup_steps: int) -> torch.Tensor:
    """``init_lr + (peak_lr - init_lr) * s / warmup_steps`` on a float64 count, as the Python floats compute it."""
    return (peak_lr - init_lr) * s / max(warmup_steps, 1) + init_lr


def constant(lr: float) -> LrSchedule:
    """The schedule that is ``lr`` at every step.

    Example:
        >>> constant(0.1)(torch.tensor(7))
        0.1
    """
    check_nonneg("constant", lr=lr)
    value = float(lr)
    return lambda step: value


def linear_warmup(peak_lr: float, warmup_steps: int, *, init_lr: float = 0.0) -> LrSchedule:
    """Linear from ``init_lr`` at step 0 to ``peak_lr`` at ``warmup_steps``, then constant.

    Example:
        >>> s = linear_warmup(1.0, 4)
        >>> [s(i) for i in (0, 2, 4, 9)]
        [0.0, 0.5, 1.0, 1.0]
    """
    check_nonneg("linear_warmup", peak_lr=peak_lr, warmup_steps=warmup_steps, init_lr=init_lr)

    def schedule(step: Any) -> float | torch.Tensor:
        if _traced(step):  # [] float64
            s = step.to(torch.float64)
            return torch.where(s >= warmup_steps, float(peak_lr), _warmup(s, init_lr, peak_lr, warmup_steps))
        s = _step_of(step)
        if s >= warmup_steps:
            return float(peak_lr)
        return init_lr + (peak_lr - init_lr) * s / warmup_steps

    return schedule


def warmup_cosine(
    peak_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 0.0, *, init_lr: float = 0.0
) -> LrSchedule:
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
    check_nonneg(fn, peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps)
    check_nonneg(fn, final_lr=final_lr, init_lr=init_lr)
    if total_steps <= warmup_steps:
        raise ConfigError(
            f"{fn}: total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps}); for a warmup alone use "
            f"linear_warmup."
        )

    def schedule(step: Any) -> float | torch.Tensor:
        if _traced(step):  # [] float64
            t = step.to(torch.float64)
            progress = ((t - warmup_steps) / (total_steps - warmup_steps)).clamp(0.0, 1.0)
            decay = (peak_lr - final_lr) * (0.5 * (1.0 + torch.cos(math.pi * progress))) + final_lr
            decay = torch.where(t >= total_steps, float(final_lr), decay)
            return torch.where(t < warmup_steps, _warmup(t, init_lr, peak_lr, warmup_steps), decay)
        s = _step_of(step)
        if s < warmup_steps:
            return init_lr + (peak_lr - init_lr) * s / warmup_steps
        if s >= total_steps:
            return float(final_lr)
        progress = (s - warmup_steps) / (total_steps - warmup_steps)
        return final_lr + (peak_lr - final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule
