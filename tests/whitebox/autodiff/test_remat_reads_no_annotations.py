"""``fs.remat`` wraps its function without reading the function's annotations.

Every sim device thread calls ``fs.remat(block)`` on the same ``block`` at once. CPython 3.11 builds a function's
``__annotations__`` dict on its first read from a tuple it holds no reference to, so a thread that reads it while
another does can find the tuple freed (CI's segfault in ``functools.update_wrapper``, in
``test_remat_keeps_tags``). ``functools.wraps`` reads them; the wrapper gets the name, docstring and
``__wrapped__`` only.
"""

from __future__ import annotations

import inspect

import torch

import funcshard as fs
from funcshard import P


class _Block:
    """A callable whose annotation reads are counted."""

    reads = 0
    __name__ = "block"
    __qualname__ = "block"

    @property
    def __annotations__(self) -> dict:  # type: ignore[override]
        type(self).reads += 1
        return {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2  # [b/dp, d] -> [b/dp, d]


def test_remat_on_every_device_reads_no_annotations() -> None:
    block = _Block()
    mesh = fs.make_mesh({"dp": 4}, backend="sim")

    def f(x: torch.Tensor) -> torch.Tensor:
        y = fs.remat(block)(x.requires_grad_())  # [b/dp, d] -> [b/dp, d], on the four device threads at once
        (g,) = torch.autograd.grad(y.sum(), x)  # the recomputation runs the wrapped collectives' path too
        return fs.psum(g.sum(), "dp")  # [] -> []

    out = fs.shard_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P())(torch.randn(8, 3))
    assert torch.isfinite(fs.device_get(out))
    assert _Block.reads == 0
    wrapped = fs.remat(block)
    assert wrapped.__name__ == "block" and wrapped.__wrapped__ is block


def test_remat_keeps_the_signature_of_a_plain_function() -> None:
    def block(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        """Scales."""
        return x * scale

    wrapped = fs.remat(block)
    assert (wrapped.__name__, wrapped.__doc__, wrapped.__module__) == ("block", "Scales.", __name__)
    assert inspect.signature(wrapped) == inspect.signature(block)  # through __wrapped__
