"""Shared test setup: the two backends every communicating test body runs under."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("FUNCSHARD_TIMEOUT", "60")
# before any test module imports jax (optax, transformers and the docs do): the fuzzer's JAX oracle runs on
# 8 host devices, which XLA reads once, at jax's first import
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# before anything imports triton (torch._dynamo does, e.g. in the doctests): Triton's interpreter, which runs
# funcshard.ops.triton's kernels on CPU, must be asked for before triton's first import; the kernels run only
# where tests call them, and the fallback test unsets it for its call
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(2)

BACKENDS = ["sim", "dist"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each test that takes ``backend`` runs once in-process (sim) and once on gloo workers (dist)."""
    return request.param


@pytest.fixture
def run(backend: str):
    """``run(body, mesh_shape, *args)``: run ``body(mesh, *args)`` under the test's backend."""
    from _dist_pool import run_body

    def go(body, shape, *args):
        return run_body(backend, body, shape, *args)

    return go
