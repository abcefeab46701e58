"""Stacked layer parameters (``[n_layers, ...]`` leaves) taken apart for the layers that use them.

``torch.unbind`` does this with a backward that stacks the per-layer gradients into a fresh ``[n_layers, ...]``
tensor every step: for the 13.2M-param Llama 52 MB of new memory per step, whose first touch (page faults)
costs several times the copy itself (~55 ms of a 1.35 s dp=2 step on CPU, against ~6 ms for the copy into
memory already mapped). :func:`unstack` is ``torch.unbind`` whose backward stacks into a buffer kept from one
step to the next (``BucketPool``, as DDP keeps its gradient buckets), taken only once
nothing holds it any more (the gradients handed out from it are gone). Where the rows' gradients already lie at
one stride in one buffer (under ``dist``, the data-parallel buckets of the same rows of every stacked leaf are
rows of one layer-major buffer: ``_prims.PvaryBucket``), the backward hands back that strided view and copies
nothing (the 52 MB stack copy of the 13.2M Llama: ~8 ms of a dp=2 step). The numbers are the same.

Example:
    >>> import torch
    >>> w = torch.randn(3, 4, requires_grad=True)
    >>> rows = unstack(w)
    >>> len(rows), rows[0].shape
    (3, torch.Size([4]))
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..extend import BucketPool, Prim, call, keep_tags, maybe_current, settle, tracing, transforms_active

__all__ = ["Unstack", "unstack"]

_local = threading.local()


def _pool() -> BucketPool:
    """This thread's pool of stacked-gradient buffers (one per thread: a pool is not shared between threads)."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = BucketPool()
    return pool


class Unstack(Prim):
    """``[n, *s] -> n x [*s]``, the rows of ``x`` (views), as ``torch.unbind(x, 0)``; applied with ``call(Unstack, x)``
    (the C ``apply``: no binding of the arguments to ``forward``'s signature per call).

    - forward: ``ys[i] = x[i]`` (views).
    - backward: the ``n`` cotangents (zeros where a row got none) stacked into ``[n, *s]``: into a kept buffer
      of this thread's pool when the backward is not differentiated again, else a fresh ``torch.stack``.
    - jvp: the rows of the tangent.
    """

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return x.unbind(0)  # [n, *s] -> n x [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x = inputs[0]
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        ctx.stacked_rows = True  # the rows' gradient buckets may share one layer-major buffer (_prims.PvaryBucket)

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        row = ctx.shape[1:]
        traced = tracing()  # recorded into a compiled graph: a plain stack (a kept buffer's writes would be copies)
        if not torch.is_grad_enabled() and not traced:
            pending = _pending_rows(gs, ctx.shape, ctx.dtype)
            if pending is not None:  # still travelling, at one stride in one buffer: one pending view, no wait
                return pending
            gs = tuple(settle(g) if g is not None else None for g in gs)  # pending sums waited for
            strided = _strided_rows(gs, ctx.shape, ctx.dtype)
            if strided is not None:  # already laid out at one stride (a layer-major bucket buffer): no copy
                return strided
        parts = [torch.zeros(row, dtype=ctx.dtype, device=ctx.device) if g is None else g for g in gs]
        if torch.is_grad_enabled() or traced or any(g.shape != row or g.dtype != ctx.dtype for g in parts):
            return torch.stack(parts)  # n x [*s] -> [n, *s] (differentiable; or torch's own checks raise)
        out = _pool().take(ctx.shape.numel(), ctx.dtype, ctx.device).view(ctx.shape)
        return torch.stack(parts, out=out)  # n x [*s] -> [n, *s], into memory already mapped

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return t.unbind(0)  # [n, *s] -> n x [*s]


def _pending_rows(gs: tuple[torch.Tensor | None, ...], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """The rows ``gs``, pending sums (torch's ``AsyncCollectiveTensor``: the dist backend's gradient buckets under
    overlap) whose buffers lie at one stride in one storage (the layers' layer-major bucket buffer), as ONE pending
    ``[n, *s]`` view of it, not waited for: its first use (``fs.value_and_grad`` settles the gradients once the
    backward is done) waits for every sum issued on that storage (torch's registry keeps each: the dist backend's
    ``pending_sums_share_storage``, without which the rows are not laid out so). The backward goes on meanwhile
    (the embedding's gradient, the last bucket's sum) instead of blocking here on the first layer's bucket, issued
    just before; the same numbers. None where any row is not such a pending view."""
    first = gs[0]
    kind = type(first)
    if first is None or kind.__name__ != "AsyncCollectiveTensor":
        return None
    elems = []
    for g in gs:
        if type(g) is not kind:
            return None
        elems.append(g.elem)  # type: ignore[union-attr]
    strided = _strided_rows(tuple(elems), shape, dtype)
    if strided is None:
        return None
    out = kind(strided)  # [n, *s], pending: waited for at its first use
    return keep_tags(out, first)  # its tags (the varying axes) go with it, as settle's


def _strided_rows(gs: tuple[torch.Tensor | None, ...], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """The rows ``gs`` as one ``[n, *s]`` view when they already lie in one storage at one stride, in order and
    without overlap (row ``i`` of the layer-major gradient buffer of each layer's bucket), else None."""
    row = shape[1:]
    first = gs[0]
    if first is None or type(first) is not torch.Tensor:
        return None
    size = first.numel()
    storage, base = first.untyped_storage().data_ptr(), first.storage_offset()
    step = gs[1].storage_offset() - base if len(gs) > 1 and gs[1] is not None else size
    if step < size:
        return None
    for i, g in enumerate(gs):
        if (
            g is None
            or type(g) is not torch.Tensor
            or g.shape != row
            or g.dtype != dtype
            or not g.is_contiguous()
            or g.untyped_storage().data_ptr() != storage
            or g.storage_offset() != base + i * step
        ):
            return None
    return first.as_strided(shape, (step, *first.stride()), base)  # n x [*s] -> [n, *s], a view


def unstack(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of a stacked ``[n, *s]`` leaf: ``torch.unbind(x, 0)``, whose gradient (under the ``dist``
    backend, where a process runs one device) is stacked into a buffer kept from step to step instead of fresh
    memory. Elsewhere (``sim``, outside ``shard_map``, under a ``torch.func`` transform, no gradient wanted)
    it is ``torch.unbind`` itself. The numbers are the same.

    Args:
        x: a ``[n, *s]`` tensor (e.g. ``params["layers"]["wq"]``).

    Returns:
        ``n`` views ``[*s]``.

    Example:
        >>> unstack(torch.arange(6).reshape(3, 2))[1]
        tensor([2, 3])
    """
    ctx = maybe_current()
    if (
        ctx is None
        or not ctx.mesh.is_multiprocess
        or not (x.requires_grad and torch.is_grad_enabled())
        or transforms_active()
    ):
        return torch.unbind(x, 0)  # [n, *s] -> n x [*s]
    return call(Unstack, x)  # [n, *s] -> n x [*s]
