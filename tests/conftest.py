"""Shared test setup: the two backends every communicating test body runs under, and the suite's markers.

Markers (registered in pyproject.toml, ``--strict-markers``): ``dist`` runs bodies on processes joined by gloo
(given here to every test run with ``backend="dist"``; by hand, ``@pytest.mark.dist``, to a test that starts dist
bodies or gloo processes itself, and a test that runs a dist body without it fails); ``oracle`` compares against
an outside peer (JAX, optax, transformers, torch's own optimisers, pipelining or DTensor); ``slow`` takes more
than about 10 s on two CPU cores; ``counters`` counts calls, bytes or events of the machinery. The fast subset:
``python -m pytest -m "not slow and not dist"``.
"""

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test parametrized with ``backend="dist"`` (the ``backend`` / ``run`` fixtures) is a ``dist`` test."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "dist":
            item.add_marker(pytest.mark.dist)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test that ran a body on the gloo pool must carry the ``dist`` marker (so ``-m "not dist"`` leaves it out)."""
    import _dist_pool

    before = _dist_pool.DIST_BODIES
    result = yield
    if _dist_pool.DIST_BODIES != before and item.get_closest_marker("dist") is None:
        raise AssertionError(f"{item.nodeid} runs bodies under 'dist': mark it @pytest.mark.dist")
    return result
