"""The collectives as autograd Functions over a device handle, each with its transpose as backward.

Each works on the leading-group-dim form of the backends (see ``_backend``). ``lax`` builds the public
collectives (dims, tiling, pytrees, varying-axes tags) on top of these. Backwards call the Functions again,
so higher derivatives work. All use the ``setup_context`` form, so ``torch.func.grad`` / ``vjp`` see them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead

from ._stats import record

__all__ = ["AllGather", "AllGatherInvariant", "AllReduce", "AllToAll", "Ppermute", "Pvary", "ReduceScatter", "call"]


def call(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` without its per-call ``inspect.signature`` when no torch.func transform is
    active (all our arguments are positional, so there are no defaults to bind): ~3 us instead of ~13 us."""
    if torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*_unwrap_dead(args))  # type: ignore[misc]


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class AllReduce(torch.autograd.Function):
    """All-reduce (sum / max / min) forward; identity backward for sum, the arg-extreme mask for max / min."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], op: str, name: str) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, name, axes, _nbytes(x))
        return dev.all_reduce(x, axes, op)  # [*s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, dev, axes, op, _ = inputs
        ctx.dev, ctx.axes, ctx.op = dev, axes, op
        if op != "sum":
            ctx.save_for_backward(x, output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.op == "sum":
            return g, None, None, None, None
        x, y = ctx.saved_tensors
        mask = (x == y).to(g.dtype)
        count = call(AllReduce, mask, ctx.dev, ctx.axes, "sum", "psum")  # [*s] -> [*s]: devices at the extreme
        return g * mask / count, None, None, None, None


class Pvary(torch.autograd.Function):
    """Identity forward (the value becomes varying over ``axes``); all-reduce sum backward."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllReduce, g, ctx.dev, ctx.axes, "sum", "psum"), None, None  # [*s] -> [*s]


class PvaryBucket(torch.autograd.Function):
    """:class:`Pvary` of several tensors of one dtype: identity forward; backward flattens their gradients
    into one buffer, all-reduces it once and splits it again (one collective instead of one per tensor)."""

    @staticmethod
    def forward(dev: Any, axes: tuple[str, ...], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dev, ctx.axes = inputs[0], inputs[1]
        ctx.shapes = [x.shape for x in inputs[2:]]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        flat = torch.cat([g.reshape(-1) for g in gs])  # n x [*s_i] -> [sum |s_i|]
        total = call(AllReduce, flat, ctx.dev, ctx.axes, "sum", "psum")  # [sum |s_i|] -> [sum |s_i|]
        parts = total.split([s.numel() for s in ctx.shapes])
        return (None, None, *(p.view(s) for p, s in zip(parts, ctx.shapes, strict=True)))


class AllGather(torch.autograd.Function):
    """All-gather ``[*s] -> [n, *s]`` forward; reduce-scatter backward."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "all_gather", axes, _nbytes(x))
        return dev.all_gather(x, axes)  # [*s] -> [n, *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(ReduceScatter, g, ctx.dev, ctx.axes), None, None  # [n, *s] -> [*s]


class ReduceScatter(torch.autograd.Function):
    """Reduce-scatter ``[n, *s] -> [*s]`` forward; all-gather backward."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "psum_scatter", axes, _nbytes(x))
        return dev.reduce_scatter(x, axes)  # [n, *s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllGather, g, ctx.dev, ctx.axes), None, None  # [*s] -> [n, *s]


class AllToAll(torch.autograd.Function):
    """All-to-all ``[n, *s] -> [n, *s]`` (row j to member j) forward; the same all-to-all backward."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "all_to_all", axes, _nbytes(x))
        return dev.all_to_all(x, axes)  # [n, *s] -> [n, *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllToAll, g, ctx.dev, ctx.axes), None, None  # [n, *s] -> [n, *s]


class Ppermute(torch.autograd.Function):
    """Send along ``perm`` pairs forward; send along the inverse pairs backward."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "ppermute", axes, _nbytes(x))
        return dev.ppermute(x, axes, perm)  # [*s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes, ctx.perm = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        inverse = tuple((dst, src) for src, dst in ctx.perm)
        return call(Ppermute, g, ctx.dev, ctx.axes, inverse), None, None, None  # [*s] -> [*s]


class AllGatherInvariant(torch.autograd.Function):
    """All-gather ``[*s] -> [n, *s]`` whose result is the same on every member (invariant) forward; this
    member's row of the cotangent backward (no communication: the cotangent of an invariant value is
    invariant)."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], index: int) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "all_gather", axes, _nbytes(x))
        return dev.all_gather(x, axes)  # [*s] -> [n, *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.index = inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return g[ctx.index], None, None, None  # [n, *s] -> [*s]


class SplitInvariant(torch.autograd.Function):
    """Take this member's row of an invariant ``[n, *s]`` value (forward, no communication); all-gather the
    cotangent rows (backward): the transpose of :class:`AllGatherInvariant`."""

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], index: int) -> torch.Tensor:  # type: ignore[override]
        return x[index].clone()  # [n, *s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes, ctx.index = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllGatherInvariant, g, ctx.dev, ctx.axes, ctx.index), None, None, None  # [*s] -> [n, *s]
