"""Point-to-point messages between the devices of a mesh axis, outside autograd: for a runtime that does its own
backward (``pipeline.run``: activations forward, their gradients back, each one message)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..runtime.comm import P2POp
from ..runtime.context import axes_of, current
from ..runtime.stats import record

__all__ = ["p2p"]

#: one message: ``(tensor, peer, tag)``, the peer as its index on the axis (0 .. axis size - 1)
Message = tuple[torch.Tensor, int, int]


def p2p(sends: Sequence[Message], recvs: Sequence[Message], axis: str | tuple[str, ...]) -> list[Any]:
    """Post ``sends`` and ``recvs`` over ``axis`` as one batch, without waiting; return one work per message, the
    sends' first. A work's ``wait()`` blocks until it is done (at most ``FUNCSHARD_TIMEOUT`` seconds, then an error
    naming the axis and the peer) and returns the received block (None for a send); ``is_completed()`` asks
    without blocking.

    Each message is ``(tensor, peer, tag)``: a send's block (left untouched until its work completes) or a
    receive's buffer (of the block's shape and dtype), the other device's index on ``axis``, and a tag that tells
    apart blocks between one pair of devices (a receive matches the oldest unmatched send of the same source,
    destination and tag). Sends are counted by ``fs.comm_stats`` as ``"send"`` (their bytes). Not differentiable.

    Raises:
        ShardingError: outside shard_map, or ``axis`` not in the mesh.

    Example:
        >>> # inside shard_map over {"pp": 2}: device 0 sends x to device 1
        >>> # (work,) = p2p([(x, 1, 0)], [], "pp") if me == 0 else p2p([], [(torch.empty_like(x), 0, 0)], "pp")
        >>> # got = work.wait()  # device 1: the block; device 0: None
    """
    ctx = current("p2p")
    axes = axes_of(axis, ctx.mesh, "p2p")
    dev = ctx.device
    ops = []
    with torch._C.DisableTorchFunction():  # (sizes read, blocks posted: nothing for the vma mode to see)
        for t, peer, tag in sends:
            ops.append(P2POp("send", t, peer, tag))
            record(dev.rank, "send", axes, t.numel() * t.element_size())
        for t, peer, tag in recvs:
            ops.append(P2POp("recv", t, peer, tag))
        return dev.p2p(ops, axes) if ops else []  # each block [*s] -> [*s], at its peer
