"""The ``sim`` backend: every device of the mesh runs in this process, one thread each.

Collectives are real exchanges of tensors between the device threads through a rendezvous (one slot per
group and call number). Every wait has a deadline and an abort path: an exception on one device ends the
call on all of them with that exception; devices that wait on a collective that some peer will never
reach (it finished, or waits on another collective) are told so at once instead of hanging. A device that
never reaches a collective its peers wait in (stuck in its own code) is reported after ``FUNCSHARD_TIMEOUT``
seconds: the call raises then and leaves that device's thread behind. Ctrl-C (``KeyboardInterrupt`` in the
calling thread) stops every device at its next collective before the interrupt goes on.

Point-to-point operations (:meth:`SimDevice.p2p`) go through a mailbox keyed by (source rank, destination rank,
tag), first in first out: a send and a receive match when both are posted (whichever comes second copies
the block into the receive buffer), and neither blocks until its work's ``wait()``. A wait has the same
deadline and abort path as a collective, and ends at once when the peer has finished without posting the
other half.

Example:
    >>> from funcshard import make_mesh
    >>> world = SimWorld(make_mesh({"tp": 2}, backend="sim"))
    >>> world.run(lambda dev: dev.all_reduce(torch.tensor([float(dev.rank)]), ("tp",), "sum").item())
    [1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._functorch.eager_transforms as _eager
import torch.autograd.forward_ad as fwAD

from ...errors import ShardingError
from ..comm import P2POp, P2PWork, default_timeout
from ..context import settle_annotations, swap_runtime_level
from .base import BackendImpl, DeviceHandle, check_p2p, from_order_key, group_members, order_key, ragged_mismatch

__all__ = ["SimBackend", "SimDevice", "SimWorld", "abandoned_threads"]

_GRACE = 0.2  # seconds the waiting devices get to leave once a call has failed on a timeout
_INTERRUPT_GRACE = 5.0  # seconds the devices get to stop after Ctrl-C, before the interrupt goes on without them
_ABANDONED: list[threading.Thread] = []


def abandoned_threads() -> list[threading.Thread]:
    """Device threads still running in calls that already raised (a device stuck in its own code, or one
    that did not stop after Ctrl-C). A program that exits with such a thread alive should leave with
    ``os._exit``: torch ops on a thread at interpreter shutdown can abort the process.

    Example:
        >>> abandoned_threads()
        []
    """
    _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
    return list(_ABANDONED)


_PUBLIC = {"reduce_scatter": "psum_scatter"}
_REDUCE = {"sum": "psum (or pmean)", "max": "pmax", "min": "pmin"}


def _describe(kind: str, meta: Any) -> str:
    """A collective as the user wrote it, e.g. ``psum (or pmean) of a (2, 3) torch.float32 block``."""
    if kind == "all_reduce":
        return f"{_REDUCE[meta[0]]} of a {meta[1]} {meta[2]} block"
    return f"{_PUBLIC.get(kind, kind)} of a {meta[0]} {meta[1]} block"


class _Aborted(Exception):
    """Raised in a device thread whose call was ended by another device's error."""


class _Slot:
    __slots__ = ("done", "first", "members", "n", "reads", "result", "vals")

    def __init__(self, n: int, members: list[int]) -> None:
        self.n = n
        self.vals: dict[int, Any] = {}
        self.first: tuple[str, Any, int] | None = None
        self.done = False
        self.reads = 0
        self.members = members
        self.result: Any = None  # what ``combine`` made of the payloads (see SimWorld.exchange)


@contextlib.contextmanager
def _shared_forward_level() -> Iterator[None]:
    """One forward-mode AD level for all the device threads of a call.

    torch keeps forward AD's level, and ``torch.func.jvp``'s nesting count, per process, not per thread:
    devices that each entered ``torch.func.jvp`` would race on them ("Trying to access a forward AD level
    with an invalid index"). Entered here, around the threads, each device's ``jvp`` uses this level (as a
    nested ``jvp`` does) instead of entering and leaving its own. A level the caller entered is used as is.
    """
    if fwAD._current_level >= 0:
        yield
        return
    fwAD.enter_dual_level()
    _eager.JVP_NESTING += 1
    prev = swap_runtime_level(fwAD._current_level)  # (no tangent on it unless a device's jvp nests in it)
    try:
        yield
    finally:
        swap_runtime_level(prev)
        _eager.JVP_NESTING -= 1
        fwAD.exit_dual_level()


class SimWorld:
    """The rendezvous of one ``shard_map`` call under ``sim``: one :class:`SimDevice` per device."""

    def __init__(self, mesh: Any, *, timeout: float | None = None) -> None:
        self.mesh = mesh
        self.timeout = default_timeout() if timeout is None else timeout
        self.cond = threading.Condition()
        self.devices = [SimDevice(self, r) for r in range(mesh.size)]
        self._reset()

    def _reset(self) -> None:
        if getattr(self, "abandoned", False):
            raise ShardingError(
                "shard_map: this call's simulated devices were left running after an earlier failure; "
                "call the shard_map again (a new call starts fresh devices)."
            )
        self.abandoned = False
        self.give_up = float("inf")  # after a failure: when to stop waiting for devices that do not stop
        self.slots: dict[Any, _Slot] = {}
        self.status: list[Any] = ["running"] * self.mesh.size
        self.seq: list[dict[Any, int]] = [defaultdict(int) for _ in range(self.mesh.size)]
        self.error: BaseException | None = None
        # point-to-point: (src rank, dst rank, tag) -> unmatched sends / unmatched receives, oldest first
        self.mail: dict[tuple[int, int, int], deque[_SimWork]] = defaultdict(deque)
        self.posted: dict[tuple[int, int, int], deque[_SimWork]] = defaultdict(deque)

    # -- running device functions -------------------------------------------------------------------
    def run(self, fn: Callable[[SimDevice], Any], *, grad: bool | None = None) -> list[Any]:
        """Run ``fn(device)`` on every device concurrently; return the results in rank order.

        The devices run with ``grad`` as autograd mode (default: the caller's). The first exception raised
        on any device ends the call on all of them and is re-raised here.
        """
        self._reset()
        results: list[Any] = [None] * self.mesh.size
        grad = torch.is_grad_enabled() if grad is None else grad
        # the devices share the caller's cores: each thread gets its share of torch's intra-op threads
        # (a new thread would otherwise start with all of them and oversubscribe the machine)
        per_device = max(1, torch.get_num_threads() // self.mesh.size)

        def work(dev: SimDevice) -> None:
            try:
                if self.mesh.size > 1:
                    torch.set_num_threads(per_device)
                with torch.set_grad_enabled(grad):
                    results[dev.rank] = fn(dev)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                with self.cond:
                    self._fail(e)
            finally:
                with self.cond:
                    self.status[dev.rank] = "done"
                    self._check_deadlock()
                    self.cond.notify_all()  # the caller waits for every device to be done

        if self.mesh.size == 1:
            work(self.devices[0])
        else:
            settle_annotations()  # (no first read of a function's annotations on the device threads: CPython 3.11)
            threads = [
                threading.Thread(target=work, args=(d,), name=f"funcshard-sim-{d.rank}", daemon=True)
                for d in self.devices
            ]
            try:  # Ctrl-C may land while the threads start: they are stopped all the same
                with _shared_forward_level():
                    for t in threads:
                        t.start()
                    self._join(threads)
            except KeyboardInterrupt:
                self._interrupt(threads)
                raise
        if self.error is not None:
            err = self.error
            if not self.abandoned:
                self.error = None
            raise err
        return results

    def _join(self, threads: list[threading.Thread]) -> None:
        """Wait for the device threads; after a failure, wait at most until its ``give_up`` time, then
        leave the devices still running behind (marked abandoned: they stop at their next collective).

        It waits on the rendezvous' condition, not with ``Thread.join(timeout)``: a Ctrl-C inside ``join``
        marks a running thread as stopped (CPython before 3.13), and it would be left behind unseen.
        """
        with self.cond:
            while not all(s == "done" for s in self.status):
                if self.error is not None and time.monotonic() > self.give_up:
                    self._abandon(threads)
                    return
                self.cond.wait(0.05)
        for t in threads:  # every device has finished its work: only the threads' own exit is left
            t.join()

    def _interrupt(self, threads: list[threading.Thread]) -> None:
        """Ctrl-C in the calling thread: stop every device at its next collective and wait a little for them."""
        with self.cond:
            if self.error is None:
                self.error = KeyboardInterrupt()
            self.give_up = time.monotonic() + _INTERRUPT_GRACE
            self.cond.notify_all()
        try:
            self._join(threads)
        except KeyboardInterrupt:  # a second Ctrl-C: leave at once
            self._abandon(threads)

    def _abandon(self, threads: list[threading.Thread]) -> None:
        """Leave the devices that have not finished (they stop at their next collective)."""
        with self.cond:  # re-entrant: _join holds it already
            self.abandoned = True
            _ABANDONED.extend(t for t, s in zip(threads, self.status, strict=True) if s != "done")
            self.cond.notify_all()

    # -- the rendezvous -----------------------------------------------------------------------------
    def exchange(
        self,
        dev: SimDevice,
        kind: str,
        axes: tuple[str, ...],
        payload: Any,
        meta: Any,
        combine: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Deposit ``payload`` and return every group member's payload, in logical order.

        With ``combine``, the last member to arrive calls it once on the payloads (in logical order) while the
        others wait, and every member gets its result: the payloads are read only while their owners wait
        here, so they need no copy, and the group's reduction is computed once instead of once per member.
        """
        members, idx = dev.group(axes)
        others = dev.others(axes)
        with self.cond:
            if self.error is not None or self.abandoned:
                raise _Aborted
            seq_key = (axes, others)
            seq = self.seq[dev.rank][seq_key]
            self.seq[dev.rank][seq_key] = seq + 1
            key = (axes, others, seq)
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(len(members), members)
                slot.first = (kind, meta, dev.rank)
            elif (kind, meta) != slot.first[:2]:
                self._fail(
                    ShardingError(
                        f"collective mismatch over {axes}: device {self._dev_name(dev.rank)} called "
                        f"{_describe(kind, meta)} as call #{seq} over this group, but device "
                        f"{self._dev_name(slot.first[2])} called {_describe(*slot.first[:2])}. Every device of a "
                        f"group must make the same collectives, with the same shapes, in the same order."
                    )
                )
                raise _Aborted
            slot.vals[idx] = payload
            if len(slot.vals) == slot.n:
                for m in slot.members:
                    self.status[m] = "running"
                if combine is not None:  # the others wait (their payloads untouched) while it is computed
                    self.cond.release()
                    try:
                        result = combine([slot.vals[i] for i in range(slot.n)])
                    finally:
                        self.cond.acquire()
                    slot.result = result
                slot.done = True
                self.cond.notify_all()
            else:
                self.status[dev.rank] = ("waiting", _describe(kind, meta), axes, seq)
                self._check_deadlock()
            deadline = time.monotonic() + self.timeout
            while not slot.done:
                if self.error is not None:
                    raise _Aborted
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [self._dev_name(m) for i, m in enumerate(slot.members) if i not in slot.vals]
                    what = f"{_describe(kind, meta)} over {axes}"
                    self._fail(
                        self._timed_out(what, dev.rank, f"device(s) {', '.join(missing)}", "reached it"),
                        give_up=time.monotonic() + _GRACE,
                    )
                    raise _Aborted
                self.cond.wait(timeout=min(left, 1.0))
            out = slot.result if combine is not None else [slot.vals[i] for i in range(slot.n)]
            slot.reads += 1
            if slot.reads == slot.n:
                del self.slots[key]
            return out

    # -- point-to-point ------------------------------------------------------------------------------
    def p2p(self, dev: SimDevice, ops: Sequence[P2POp], axes: tuple[str, ...]) -> list[_SimWork]:
        """Post ``ops`` (sends and receives of ``dev`` over the group ``axes``); match each with the oldest
        unmatched other half of the same (source, destination, tag) if there is one."""
        members = check_p2p(self.mesh, dev.coords, axes, ops)
        works = []
        with self.cond:
            if self.error is not None or self.abandoned:
                raise _Aborted
            for op in ops:
                w = _SimWork(self, op, dev.rank, members[op.peer], axes)
                if op.kind == "send":
                    key = (dev.rank, w.peer, op.tag)
                    if self.posted[key]:
                        self._match(w, self.posted[key].popleft())
                    else:
                        self.mail[key].append(w)
                else:
                    key = (w.peer, dev.rank, op.tag)
                    if self.mail[key]:
                        self._match(self.mail[key].popleft(), w)
                    else:
                        self.posted[key].append(w)
                works.append(w)
        return works

    def _match(self, send: _SimWork, recv: _SimWork) -> None:
        """Deliver ``send``'s block into ``recv``'s buffer (both shapes and dtypes must agree); both are done."""
        x, buf = send.op.tensor, recv.op.tensor
        if x.shape != buf.shape or x.dtype != buf.dtype:
            self._fail(
                ShardingError(
                    f"point-to-point over {send.axes}: device {self._dev_name(send.owner)} sent a "
                    f"{tuple(x.shape)} {x.dtype} block (tag {send.op.tag}) to device {self._dev_name(recv.owner)}, "
                    f"which posted a receive for a {tuple(buf.shape)} {buf.dtype} block. A send and its receive "
                    f"must agree on shape and dtype."
                )
            )
            raise _Aborted
        with torch._C.DisableTorchFunction(), torch.no_grad():
            buf.copy_(x)  # [*s] -> [*s]: the block, from the sender's device to the receiver's
        for w in (send, recv):
            w.done = True
            st = self.status[w.owner]
            if isinstance(st, tuple) and st[0] == "p2p" and st[4] is w:
                self.status[w.owner] = "running"
        self.cond.notify_all()

    def p2p_wait(self, w: _SimWork) -> torch.Tensor | None:
        """Block until ``w`` is matched (at most ``timeout`` seconds; at once an error when the peer has
        finished without posting the other half); the received buffer, or None for a send."""
        with self.cond:
            if not w.done:
                self.status[w.owner] = ("p2p", w.describe(), w.axes, w.peer, w)
                self._check_deadlock()
            deadline = time.monotonic() + self.timeout
            while not w.done:
                if self.error is not None or self.abandoned:
                    raise _Aborted
                if self.status[w.peer] == "done":
                    self._fail(self._peer_done(w))
                    raise _Aborted
                left = deadline - time.monotonic()
                if left <= 0:
                    other = "sent it" if w.op.kind == "recv" else "posted the matching receive"
                    peer = f"device {self._dev_name(w.peer)}"
                    self._fail(
                        self._timed_out(f"{w.describe()} over {w.axes}", w.owner, peer, other),
                        give_up=time.monotonic() + _GRACE,
                    )
                    raise _Aborted
                self.cond.wait(timeout=min(left, 1.0))
            self.status[w.owner] = "running"
        return w.op.tensor if w.op.kind == "recv" else None

    def _peer_done(self, w: _SimWork) -> ShardingError:
        other = "sending it" if w.op.kind == "recv" else "posting the matching receive"
        return ShardingError(
            f"{w.describe()} over {w.axes}: device {self._dev_name(w.owner)} waits for device "
            f"{self._dev_name(w.peer)}, which finished without {other}. Every point-to-point send needs a "
            f"receive of the same tag on its peer, and every receive a send."
        )

    def _fail(self, err: BaseException, *, give_up: float | None = None) -> None:
        """Record the call's error (the first one wins) and wake every waiting device; ``give_up``: when the
        caller stops waiting for devices still running (default: ``FUNCSHARD_TIMEOUT`` from now)."""
        if self.error is None:
            self.error = err
            self.give_up = time.monotonic() + self.timeout if give_up is None else give_up
        self.cond.notify_all()

    def _dev_name(self, rank: int) -> str:
        c = self.mesh.coords_of(rank)
        return "(" + ", ".join(f"{a}={i}" for a, i in c.items()) + ")"

    def _timed_out(self, what: str, waiter: int, peers: str, never: str) -> ShardingError:
        """The error of device ``waiter`` that waited the whole FUNCSHARD_TIMEOUT in ``what`` for ``peers``."""
        return ShardingError(
            f"{what}: device {self._dev_name(waiter)} waited {self.timeout:g} s (FUNCSHARD_TIMEOUT) for {peers}, "
            f"which never {never}; states: {self._states()}. A device stuck in its own code (a loop, a blocking "
            f"call) looks like this; raise FUNCSHARD_TIMEOUT if it is only slow."
        )

    def _states(self) -> str:
        parts = []
        for r, s in enumerate(self.status):
            if isinstance(s, tuple) and s[0] == "p2p":
                parts.append(f"{self._dev_name(r)} waits in {s[1]} over {s[2]}")
            elif isinstance(s, tuple):
                parts.append(f"{self._dev_name(r)} waits in {s[1]} over {s[2]} (call #{s[3]})")
            else:
                parts.append(f"{self._dev_name(r)} {s}")
        return "; ".join(parts)

    def _check_deadlock(self) -> None:
        if self.error is not None:
            return
        for s in self.status:  # a point-to-point wait on a peer that has finished: it can never be matched
            if isinstance(s, tuple) and s[0] == "p2p" and self.status[s[3]] == "done":
                self._fail(self._peer_done(s[4]))
                return
        if "running" in self.status:
            return
        if any(isinstance(s, tuple) for s in self.status):
            p2p = any(isinstance(s, tuple) and s[0] == "p2p" for s in self.status)
            self._fail(
                ShardingError(
                    "collective deadlock: every device is waiting on a collective that some peer will never "
                    f"reach: {self._states()}. Every device of a group must make the same collectives in the "
                    "same order (look for a collective inside a branch on axis_index)."
                    + (" A point-to-point wait needs its peer to post the other half first." if p2p else "")
                )
            )


class _SimWork(P2PWork):
    """One posted point-to-point operation of a simulated device (see :meth:`SimWorld.p2p`)."""

    __slots__ = ("axes", "done", "op", "owner", "peer", "world")

    def __init__(self, world: SimWorld, op: P2POp, owner: int, peer: int, axes: tuple[str, ...]) -> None:
        self.world, self.op, self.owner, self.peer, self.axes = world, op, owner, peer, axes
        self.done = False

    def describe(self) -> str:
        """E.g. ``a point-to-point receive of a (3, 4) torch.float32 block (tag 5) from device (pp=0)``."""
        t, peer = self.op.tensor, self.world._dev_name(self.peer)
        how = f"receive of a {tuple(t.shape)} {t.dtype} block (tag {self.op.tag}) from device {peer}"
        if self.op.kind == "send":
            how = f"send of a {tuple(t.shape)} {t.dtype} block (tag {self.op.tag}) to device {peer}"
        return "a point-to-point " + how

    def wait(self) -> torch.Tensor | None:
        """Block until matched; the received block (this receive's buffer), or None for a send."""
        return self.world.p2p_wait(self)

    def is_completed(self) -> bool:
        """Whether the other half has been posted and the block delivered."""
        return self.done


def _reduce(vals: list[torch.Tensor], op: str) -> torch.Tensor:
    """``vals[0] op vals[1] op ...`` in this order, into a new tensor (the same bits on every member)."""
    with torch.no_grad():
        if op == "sum":
            out = torch.add(vals[0], vals[1])
            if out._is_zerotensor():  # two zero tangents (torch's ZeroTensors) add up to one, which is immutable
                out = torch.zeros_like(out)  # [*s] -> [*s]: zeros the others are added into
            for v in vals[2:]:
                out.add_(v)
        elif vals[0].is_floating_point():  # NaN wins and -0 < +0, the same bits as under dist
            fn = torch.maximum if op == "max" else torch.minimum
            key = order_key(vals[0], op)
            for v in vals[1:]:
                fn(key, order_key(v, op), out=key)
            out = from_order_key(key, vals[0].dtype)
        else:
            fn = torch.maximum if op == "max" else torch.minimum
            out = fn(vals[0], vals[1])
            for v in vals[2:]:
                fn(out, v, out=out)
    return out


class SimDevice(DeviceHandle):
    """One simulated device."""

    point_to_point = True

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.mesh = world.mesh
        self.rank = rank
        self.coords = world.mesh.coords_of(rank)
        self._groups: dict[tuple[str, ...], tuple[list[int], int]] = {}
        self._others: dict[tuple[str, ...], tuple[int, ...]] = {}

    def group(self, axes: tuple[str, ...]) -> tuple[list[int], int]:
        """The ranks of this device's group over ``axes`` (logical order) and its index in it (cached)."""
        hit = self._groups.get(axes)
        if hit is None:
            hit = self._groups[axes] = group_members(self.mesh, self.coords, axes)
        return hit

    def others(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        """This device's coordinates on the axes other than ``axes`` (which group over ``axes`` it is in)."""
        hit = self._others.get(axes)
        if hit is None:
            hit = self._others[axes] = tuple(self.coords[a] for a in self.mesh.axis_names if a not in axes)
        return hit

    def _x(self, kind: str, x: torch.Tensor, axes: tuple[str, ...], meta: Any = ()) -> tuple[list[Any], int]:
        vals = self.world.exchange(self, kind, axes, x.detach().clone(), meta)
        return vals, self.group(axes)[1]

    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        if len(self.group(axes)[0]) == 1:  # a group of one: the reduction is the value itself
            return x.detach().clone()
        total = self.world.exchange(
            self, "all_reduce", axes, x.detach(), (op, tuple(x.shape), x.dtype), lambda vals: _reduce(vals, op)
        )
        return total.clone()  # [*s] -> [*s]: this device's own copy of the group's reduction

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        vals, _ = self._x("all_gather", x, axes, (tuple(x.shape), x.dtype))
        return torch.stack(vals)

    def reduce_scatter(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        vals, i = self._x("reduce_scatter", x, axes, (tuple(x.shape), x.dtype))
        out = vals[0][i].clone()
        for v in vals[1:]:
            out.add_(v[i])
        return out

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        vals, i = self._x("all_to_all", x, axes, (tuple(x.shape), x.dtype))
        return torch.stack([v[i] for v in vals])

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        vals, i = self._x("ppermute", x, axes, (tuple(x.shape), x.dtype, perm))
        for src, dst in perm:
            if dst == i:
                return vals[src].clone()
        return torch.zeros_like(x)

    def ragged_all_to_all(
        self, x: torch.Tensor, axes: tuple[str, ...], send: tuple[int, ...] | None, recv: tuple[int, ...] | None
    ) -> torch.Tensor:
        """Every member deposits its sent rows and its counts; each checks the counts of the whole group (every
        member raises the same error where ``recv`` disagrees with a peer's ``send``) and takes its rows."""
        assert send is not None and recv is not None, "a sim device holds data: the row counts are known"
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): immutable, sliced as zeros
            x = torch.zeros_like(x)  # [N, *s] -> [N, *s]
        rows = x.detach()[: sum(send)].clone()  # [N, *s] -> [sum(send), *s]: what leaves this device
        vals = self.world.exchange(self, "ragged_all_to_all", axes, (rows, send, recv), (tuple(x.shape[1:]), x.dtype))
        members, i = self.group(axes)
        err = ragged_mismatch(self.mesh, axes, members, [(s, r) for _, s, r in vals])
        if err is not None:
            raise err
        parts = [v[sum(s[:i]) : sum(s[: i + 1])] for v, s, _ in vals]  # member j's rows for me: [s_j[i], *s]
        return torch.cat(parts)  # -> [sum(recv), *s], in source order

    def p2p(self, ops: Sequence[P2POp], axes: tuple[str, ...]) -> list[P2PWork]:
        """Post point-to-point sends and receives over ``axes`` (see :meth:`SimWorld.p2p`); one work per op."""
        return list(self.world.p2p(self, ops, axes))


class SimBackend(BackendImpl):
    """The ``"sim"`` backend: every device of a mesh in this one process, one thread each, for one call at a time;
    the default (picked when nothing asks for another). A ``check_vma=False`` program is audited by default.

    Example:
        >>> SimBackend().multiprocess, SimBackend().audit
        (False, True)
    """

    name = "sim"
    audit = True

    def requested(self) -> bool:
        return True

    def started(self) -> bool:
        return True

    def abandoned_threads(self) -> list[Any]:
        return abandoned_threads()

    def world(self, mesh: Any) -> SimWorld:
        return SimWorld(mesh)
