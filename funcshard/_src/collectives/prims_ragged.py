"""The ragged all-to-all: rows sent to each peer in counts that differ per peer and per device (expert
parallelism's token dispatch and combine), as an autograd Function with the four rules of ``prims`` and its
varying-axes rule.

The backends' form is ``ragged_all_to_all(x, axes, send, recv)``: ``x`` is ``[N, *s]`` with its first
``sum(send)`` rows grouped by destination in the group's logical order (``send[j]`` rows to member j, rows after
them not sent), the result ``[sum(recv), *s]`` the rows received, concatenated in source order (``recv[j]`` rows
from member j). ``send`` / ``recv`` are tuples of Python ints (the row counts, read on the host by
``lax.ragged_all_to_all``), or both None on a backend that holds no data and was given unknown counts: routing is
then taken as balanced (``N`` rows out, ``N`` rows back, ``(n-1)/n`` of them to other members).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.stats import record
from .prims import Dims, Prim, call, group_size, move_batch

if TYPE_CHECKING:
    from torch._functorch.autograd_function import VmapInfo

__all__ = ["RaggedAllToAll", "sent_bytes"]

Sizes = tuple[int, ...] | None


def sent_bytes(x: torch.Tensor, n: int, send: Sizes, me: int) -> int:
    """The bytes a ragged all-to-all of ``x`` over a group of ``n`` moves from this device (index ``me``) to the
    OTHER members: ``(sum(send) - send[me])`` rows; with unknown counts (``send`` None, balanced routing)
    ``N * (n-1) / n`` rows.

    Example:
        >>> sent_bytes(torch.zeros(6, 4), 2, (2, 4), 0), sent_bytes(torch.zeros(6, 4), 2, None, 0)
        (64, 48)
    """
    row = math.prod(x.shape[1:]) * x.element_size()
    if send is None:
        return x.shape[0] * row * (n - 1) // n
    return (sum(send) - send[me]) * row


class RaggedAllToAll(Prim):
    """Ragged all-to-all ``[N, *s] -> [sum(recv), *s]`` over ``axes``: ``send[j]`` rows to member j (in order),
    ``recv[i]`` rows from member i, concatenated in source order.

    - forward: ``y = cat_i(x_i[off_i(me) : off_i(me) + send_i[me]])`` with ``off_i`` member i's row offsets.
    - backward: the reverse exchange (``send`` and ``recv`` swapped) of the cotangent: ``[sum(recv), *s] ->
      [sum(send), *s]``, and zeros for the rows of ``x`` after ``sum(send)`` (they were not sent).
    - jvp: the same exchange of the tangent.
    - vmap: ``[N, B, *s] -> [sum(recv), B, *s]`` in one exchange (out dim 1): rows stay the leading dim.
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each member receives its own rows: varies over ``axes`` (as ``all_to_all``)."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], send: Sizes, recv: Sizes, me: int) -> torch.Tensor:  # type: ignore[override]
        n = len(send) if send is not None else group_size(dev, axes)
        record(dev.rank, "ragged_all_to_all", axes, sent_bytes(x, n, send, me))
        return dev.ragged_all_to_all(x, axes, send, recv)  # [N, *s] -> [sum(recv), *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, ctx.dev, ctx.axes, ctx.send, ctx.recv, ctx.me = inputs
        ctx.rows = x.shape[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        gx = call(RaggedAllToAll, g, ctx.dev, ctx.axes, ctx.recv, ctx.send, ctx.me)  # [M, *s] -> [sum(send), *s]
        if gx.shape[0] < ctx.rows:  # the rows after sum(send) were not sent: no gradient
            gx = torch.cat((gx, gx.new_zeros(ctx.rows - gx.shape[0], *gx.shape[1:])))  # -> [N, *s]
        return gx, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(RaggedAllToAll, t, ctx.dev, ctx.axes, ctx.send, ctx.recv, ctx.me)  # [N, *s] -> [M, *s]

    @staticmethod
    def vmap(
        info: VmapInfo,
        in_dims: Dims,
        x: torch.Tensor,
        dev: Any,
        axes: tuple[str, ...],
        send: Sizes,
        recv: Sizes,
        me: int,
    ) -> tuple[torch.Tensor, int]:
        y = call(RaggedAllToAll, move_batch(x, in_dims[0], 1), dev, axes, send, recv, me)  # [N, B, *s] -> [M, B, *s]
        return y, 1
