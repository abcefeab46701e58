"""What both backends share: group membership, the device-handle interface, and how long a collective waits."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...errors import MeshError, ShardingError

__all__ = [
    "DEFAULT_TIMEOUT",
    "DeviceHandle",
    "P2POp",
    "P2PWork",
    "PeerError",
    "check_p2p",
    "default_timeout",
    "dynamo_tracing",
    "from_order_key",
    "group_members",
    "order_key",
    "overlap_last",
    "prefetch_scope",
    "prefetching",
    "trace_scope",
    "tracing",
    "transforms_active",
    "wait_pending",
]

DEFAULT_TIMEOUT = 300.0

_KEY_DTYPES = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def order_key(x: torch.Tensor, op: str) -> torch.Tensor:
    """Integers ordered as the floats ``x`` are (their bits, the non-sign bits of negatives flipped: -0 < +0), NaN
    made the extreme that ``op`` (``"max"`` / ``"min"``) picks: the integer max / min of them over a group is the
    float one with NaN propagated, as ``torch.maximum``, the same bits on every member and under both backends
    (gloo's float max / min gave 1.0 for max(1, nan, 1, 2); NCCL's drop NaN). 16-bit floats in int32 (NCCL
    has no int16).

    Example:
        >>> from_order_key(order_key(torch.tensor([-0.0, 2.0]), "max"), torch.float32)
        tensor([-0., 2.])
    """
    kd = _KEY_DTYPES[x.dtype]
    bits = x.contiguous().view(kd)
    low = torch.iinfo(kd).max  # the non-sign bits
    key = torch.where(bits < 0, bits ^ low, bits)  # [*s] -> [*s]
    key = key.masked_fill(x.isnan(), low if op == "max" else -low - 1)
    return key.to(torch.int32) if kd == torch.int16 else key


def from_order_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of ``dtype`` whose :func:`order_key` is ``key`` (the bit map is its own inverse); a NaN key
    gives torch's NaN (positive, quiet).

    Example:
        >>> from_order_key(torch.tensor([2**31 - 1], dtype=torch.int32), torch.float32)
        tensor([nan])
    """
    kd = _KEY_DTYPES[dtype]
    key = key.to(kd)
    low = torch.iinfo(kd).max
    out = torch.where(key < 0, key ^ low, key).view(dtype)  # [*s] -> [*s]
    return out.masked_fill_((key == low) | (key == -low - 1), float("nan"))


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


def group_members(mesh: Any, coords: Mapping[str, int], axes: Sequence[str]) -> tuple[list[int], int]:
    """Ranks of the group of ``coords`` over ``axes`` in logical order, and this device's index in it.

    Example:
        >>> from funcshard import make_mesh
        >>> group_members(make_mesh({"dp": 2, "tp": 2}, backend="sim"), {"dp": 1, "tp": 0}, ("dp",))
        ([0, 2], 1)
    """
    shape = mesh.shape
    members: list[int] = []
    idx = 0
    n = 1
    for a in axes:
        n *= shape[a]
    for i in range(n):
        c = dict(coords)
        rem = i
        for a in reversed(tuple(axes)):
            c[a] = rem % shape[a]
            rem //= shape[a]
        members.append(mesh.rank_of(c))
    mine = mesh.rank_of(coords)
    idx = members.index(mine)
    return members, idx


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


def check_p2p(mesh: Any, coords: Mapping[str, int], axes: tuple[str, ...], ops: Sequence[P2POp]) -> list[int]:
    """The group's members (global ranks, logical order) after checking each op's peer: in the group over
    ``axes`` and not this device itself.

    Raises:
        ShardingError: a peer outside the group, or this device's own index.

    Example:
        >>> import torch
        >>> from funcshard import make_mesh
        >>> check_p2p(make_mesh({"pp": 2}, backend="sim"), {"pp": 0}, ("pp",), [P2POp("send", torch.ones(1), 1)])
        [0, 1]
    """
    members, idx = group_members(mesh, coords, axes)
    for op in ops:
        if not op.peer < len(members) or op.peer == idx:
            raise ShardingError(
                f"p2p {op.kind} over {axes}: peer {op.peer} of device {dict(coords)} must be another member of "
                f"the group, an index in 0..{len(members) - 1} other than its own ({idx})."
            )
    return members


class DeviceHandle:
    """One device of a mesh, as the collectives see it. Subclassed by each backend.

    Attributes:
        mesh: the mesh.
        rank: this device's rank (row-major index of its coordinates).
        coords: this device's coordinates, axis name -> index.
    """

    mesh: Any
    rank: int
    coords: dict[str, int]

    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        raise NotImplementedError

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        raise NotImplementedError

    def p2p(self, ops: Sequence[P2POp], axes: tuple[str, ...]) -> list[P2PWork]:
        """Post a batch of point-to-point sends and receives over the group ``axes`` without waiting; one work
        per op, in order. A send completes once its receiver has posted the matching receive (rendezvous), a
        receive once its block has arrived; neither blocks the caller until its work's ``wait()``.

        Not differentiable (no autograd): for runtimes that do their own backward, as ``pipeline.run``.
        """
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


_scope = threading.local()


class _Flag(contextlib.AbstractContextManager):
    """Set this thread's scope flag ``name`` to ``on`` for the block, then restore it (a plain class: entered
    on every ``fs.value_and_grad`` call, where a generator-based context manager costs several frames)."""

    __slots__ = ("name", "on", "prev")

    def __init__(self, name: str, on: bool) -> None:
        self.name, self.on = name, on

    def __enter__(self) -> None:
        self.prev = getattr(_scope, self.name, False)
        setattr(_scope, self.name, self.on)

    def __exit__(self, *exc: object) -> None:
        setattr(_scope, self.name, self.prev)


class Overlap(contextlib.AbstractContextManager):
    """This thread's overlap flag on, and the backward node that runs last, for the block.

    Within it (``fs.value_and_grad``'s own ``torch.autograd.grad``), the dist backend may issue the backward's
    gradient reductions asynchronously: every gradient leaves through that call and is :func:`settle`-d there,
    and inside the graph a pending result waits at its first use. A plain ``.backward()``, which stores gradients
    in ``.grad`` where nothing settles them, stays synchronous.

    ``last``: the graph's node that the backward runs last, when known (the engine runs ready nodes latest-made
    first, so the node made first in the forward runs after every other); a reduction it makes has nothing
    left to overlap with, and is made synchronously (cheaper: no pending result to wrap and wait for).

    Example:
        >>> with Overlap(None):
        ...     overlap_allowed()
        True
    """

    __slots__ = ("last", "prev")

    def __init__(self, last: Any) -> None:
        self.last = last

    def __enter__(self) -> None:
        self.prev = (getattr(_scope, "on", False), getattr(_scope, "last", None))
        _scope.on, _scope.last = True, self.last

    def __exit__(self, *exc: object) -> None:
        _scope.on, _scope.last = self.prev


def overlap_allowed() -> bool:
    """Whether this thread is inside :class:`Overlap`."""
    return getattr(_scope, "on", False)


def overlap_last() -> Any:
    """The backward node :class:`Overlap` was told runs last (None: not known)."""
    return getattr(_scope, "last", None)


def prefetch_scope(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within it (``ops.fsdp_gather(..., prefetch=True)``), the dist backend's all-gathers return at once and are
    waited for where their result is first read (the gathered weights of the next layer travel while this
    layer computes)."""
    return _Flag("prefetch", on)


def prefetching() -> bool:
    """Whether this thread is inside :func:`prefetch_scope`."""
    return getattr(_scope, "prefetch", False)


def trace_scope() -> contextlib.AbstractContextManager[None]:
    """Within it (``shard_map(..., compile=...)`` recording a device's body into a graph), the dist backend's
    collectives are torch's functional collectives, which the graph records as ops (so the compiler sees them,
    and no pending result escapes), and the optimisers keep their step count a tensor (a Python number read
    from a tensor would be frozen into the graph)."""
    return _Flag("trace", True)


def tracing() -> bool:
    """Whether this thread records a body into a graph (:func:`trace_scope`)."""
    return getattr(_scope, "trace", False)


#: whether ``torch.compile``'s dynamo is tracing the calling code (then a value read or an in-place write into
#: a buffer made outside the graph is not what it can hold: the functional paths are taken)
dynamo_tracing: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)

#: THE predicate for "may the fast path run?": whether a ``torch.func`` transform (grad, vjp, jvp, vmap) is active on
#: this thread. Its tensors are wrappers: no storage to read or write in place, no hand-made autograd node, no kept
#: buffer. Where a fast path has further conditions (:func:`tracing`, grad mode, an operand's flags) they are
#: spelled beside it at the call site. torch's own function, bound once (no Python frame added).
transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
