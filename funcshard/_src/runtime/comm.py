"""What the code above the backends shares with them: the point-to-point records a device handle's ``p2p`` takes
and gives back (:class:`P2POp`, :class:`P2PWork`), the pending result of a collective (:func:`wait_pending`), the
error a collective raises when its peers fail (:class:`PeerError`), and how long it waits for them
(:func:`default_timeout`).

Example:
    >>> import torch
    >>> P2POp("send", torch.zeros(2), peer=1).peer
    1
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..errors import MeshError, ShardingError
from .context import transforms_active

__all__ = ["DEFAULT_TIMEOUT", "P2POp", "P2PWork", "PeerError", "default_timeout", "wait_pending"]

DEFAULT_TIMEOUT = 300.0


class PeerError(ShardingError):
    """A collective whose peers did not answer in time, or whose connection broke (a process stopped, hung or
    died). Under ``"dist"`` each process has its own view of it, so each one reports its own message.

    Example:
        >>> issubclass(PeerError, ShardingError)
        True
    """


def default_timeout() -> float:
    """Seconds a collective may wait for its peers: ``FUNCSHARD_TIMEOUT`` (default 300), read at each call.

    Under ``"sim"`` it bounds every wait of a simulated device; under ``"dist"`` it is the timeout of the default
    process group (when funcshard starts it) and of every per-axis group.

    Raises:
        MeshError: a value that is not a positive number of seconds.

    Example:
        >>> default_timeout() > 0  # FUNCSHARD_TIMEOUT=10 python ... gives 10.0
        True
    """
    text = os.environ.get("FUNCSHARD_TIMEOUT", "")
    if not text.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise MeshError(f"FUNCSHARD_TIMEOUT={text!r}: expected a positive number of seconds (default 300), e.g. 60.")
    return value


class P2POp:
    """One point-to-point operation of a :meth:`DeviceHandle.p2p` batch: not differentiable, no autograd.

    A plain record with slots (one is made per message of a pipeline step: no dataclass machinery); treat it
    as immutable.

    Attributes:
        kind: ``"send"`` (``tensor`` goes to ``peer``) or ``"recv"`` (a block from ``peer`` lands in
            ``tensor``, a buffer of the block's shape and dtype).
        tensor: the block to send (left untouched until its work completes), or the buffer to receive into.
        peer: the other device, as its index in the group over the batch's axes (0 .. group size - 1).
        tag: tells apart blocks between the same pair of devices: a recv matches the oldest unmatched send of
            the same (source, destination, tag).

    Example:
        >>> import torch
        >>> P2POp("send", torch.zeros(2), peer=1, tag=7).kind
        'send'
    """

    __slots__ = ("kind", "peer", "tag", "tensor")

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        if not (
            kind in ("send", "recv")
            and type(peer) is int
            and type(tag) is int
            and peer >= 0
            and tag >= 0
            and isinstance(tensor, torch.Tensor)
        ):
            _check_op(kind, tensor, peer, tag)
        self.kind, self.tensor, self.peer, self.tag = kind, tensor, peer, tag

    def __repr__(self) -> str:
        t = self.tensor
        return f"P2POp({self.kind!r}, <{tuple(t.shape)} {t.dtype}>, peer={self.peer}, tag={self.tag})"


def _check_op(kind: object, tensor: object, peer: object, tag: object) -> None:
    """Raise for a malformed :class:`P2POp` (the slow path of its constructor)."""
    if kind not in ("send", "recv"):
        raise ShardingError(f"P2POp: kind must be 'send' or 'recv', found {kind!r}.")
    if not isinstance(tensor, torch.Tensor):
        raise ShardingError(f"P2POp: tensor must be a torch.Tensor, found {type(tensor).__name__}.")
    for name, v in (("peer", peer), ("tag", tag)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ShardingError(f"P2POp: {name} must be an int >= 0, found {v!r}.")


class P2PWork:
    """A posted point-to-point operation: ``wait()`` blocks until it is done (at most ``FUNCSHARD_TIMEOUT``
    seconds, then a :class:`PeerError` / ``ShardingError`` naming the axis and the peer) and returns the
    received block (``None`` for a send); ``is_completed()`` asks without blocking.

    Example:
        >>> # works = dev.p2p([P2POp("recv", torch.empty(2, 3), peer=0)], ("pp",)); x = works[0].wait()
    """

    __slots__ = ()

    def wait(self) -> torch.Tensor | None:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError


def wait_pending(t: Any) -> torch.Tensor:
    """The pending result ``t`` of an asynchronous collective (torch's ``AsyncCollectiveTensor``: the dist
    backend's gradient reductions during a backward) once it is done, as a plain tensor. Its tags stay on ``t``:
    ``collectives.vma.settle`` carries them over (and passes anything else through): call that one.
    """
    if (t.requires_grad and torch.is_grad_enabled()) or transforms_active():
        return t.wait()  # a gradient may flow through the wait (autograd's, or a torch.func transform's level)
    with torch._C._AutoDispatchBelowAutograd():  # no gradient through the wait: the op itself, below its Python
        return torch.ops._c10d_functional.wait_tensor.default(t.elem)  # autograd kernel (~12 Python calls)
