"""The built-in learning-rate schedules inside a recorded step (internal ``trace_scope``, as ``compile=`` records
one): the count is an unreadable tensor and the schedules compute their float64 numbers from it by torch ops."""

from __future__ import annotations

import torch

from funcshard import optim
from funcshard._src.runtime.context import trace_scope


def test_schedules_in_a_recorded_step_equal_their_python_values() -> None:
    """In a step recorded into a graph the count is an unreadable tensor: the built-in schedules compute the same
    float64 numbers from it by torch ops (they used to read it with int() and the compiled step was refused)."""

    scheds = [
        optim.warmup_cosine(0.1, 3, 17, 0.003, init_lr=0.01),
        optim.warmup_cosine(1e-3, 0, 10),
        optim.linear_warmup(0.3, 7, init_lr=0.05),
        optim.linear_warmup(0.3, 0),
    ]
    for sched in scheds:
        for step in [*range(20), 99]:
            with trace_scope():
                got = sched(torch.tensor(step))
            assert isinstance(got, torch.Tensor) and float(got) == sched(step), step
