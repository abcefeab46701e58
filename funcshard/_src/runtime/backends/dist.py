"""The ``dist`` backend: one device per torch.distributed process (gloo on CPU, NCCL on CUDA).

Process groups: one per mesh axis, built once per mesh shape when the mesh is made; a group over a tuple of
axes is built the first time a collective uses it (every process reaches that collective, so every process
takes part in building it) and kept. torch orders a group's ranks by global rank; the primitives here
reorder rows to the logical (row-major over the named axes) order.

Every group, the default one included when funcshard starts it, waits ``FUNCSHARD_TIMEOUT`` seconds (default
300) for its peers. A collective that times out, or whose connection breaks (a peer stopped, hung or died),
raises :class:`~funcshard.process.PeerError` on each surviving process, naming the axis, this rank and
the rank(s) it waited for; the processes that saw the failure tell each other through the default store, so
a process waiting on a live peer that itself waits names the rank that never answered.

A synchronous all-reduce small enough (``FUNCSHARD_ONE_SHOT_BYTES``, 256 KiB gathered) is one-shot on CPU: every
process gathers every copy and reduces them in the logical order (the sim backend's bits, half gloo's exchanges).

A ZeroTensor operand (a zero tangent or cotangent torch's autograd made, ``torch._efficientzerotensor``: no memory
behind it, immutable) is sent as zeros, so the process still takes its part in the collective.

Point-to-point operations (:meth:`DistDevice.p2p`) are ``send`` / ``recv`` calls on the group's process group
(as ``isend`` / ``irecv``; under NCCL one coalesced ``batch_isend_irecv``); each work's ``wait()`` has the same
timeout and the same :class:`~funcshard.process.PeerError` (naming the operation and the peer) as a
collective, at the cost of one C++ call when nothing fails.

Example:
    >>> # under torchrun --nproc-per-node 2:
    >>> # mesh = fs.make_mesh({"tp": 2}, backend="dist")
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import re
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError, MeshError, ShardingError
from ..comm import P2POp, P2PWork, PeerError, default_timeout
from ..context import env, overlapped_node, prefetching, tracing, user_call_name
from .base import BackendImpl, DeviceHandle, check_p2p, from_order_key, group_members, order_key, ragged_mismatch

__all__ = [
    "DistBackend",
    "DistDevice",
    "any_process",
    "barrier",
    "broadcast_object",
    "device_for",
    "initialized",
    "process_rank",
    "requested",
    "setup",
    "shutdown",
    "tensor_device",
]


def overlap_enabled() -> bool:
    """Whether the backward's gradient reductions are issued asynchronously (``FUNCSHARD_OVERLAP``, default on):
    the all-reduce / reduce-scatter that a backward node starts returns at once, as torch's functional
    collectives do, and is waited on where its result is first used, so the rest of the backward computes
    while it travels (DDP's overlap, in DDP's order: last layers first)."""
    return env("FUNCSHARD_OVERLAP") != "0"


#: called with each pending result the backward issues (a test's window on the overlap; None: nothing)
issued_hook: Any = None


def _issued(t: Any) -> Any:
    if issued_hook is not None:
        issued_hook(t)
    return t


#: in a backward that ``fs.value_and_grad`` runs (``Overlap``), whose gradients are settled on the way out, and not in
#: the node that backward runs last (nothing is left to overlap: synchronous is cheaper)
_in_backward = overlapped_node


def _functional(overlap: bool) -> bool:
    """Whether a collective goes through torch's functional collectives (it returns at once and is waited for
    at its first use): always while a body is recorded into a compiled graph (``shard_map(compile=...)``: the
    graph holds them as ops), and where ``overlap`` says its result may be pending (a gradient reduction in
    the backward, a prefetched gather) and ``FUNCSHARD_OVERLAP`` is on."""
    return _funcol is not None and (tracing() or (overlap and overlap_enabled()))


try:  # torch's functional collectives: a tensor that waits for its collective at its first use
    import torch.distributed._functional_collectives as _funcol

    # torch 2.13's names (and the older ones)
    _funcol_gather: Any = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
    _funcol_scatter: Any = getattr(_funcol, "reduce_scatter_single", None) or _funcol.reduce_scatter_tensor
except ImportError:  # pragma: no cover - torch without them: every collective is synchronous
    _funcol = None


# torch 2.13 renamed the flat collectives; keep both spellings working (torch >= 2.4).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _drop_groups() -> None:
    """Forget the cached process groups and devices (before the interpreter tears torch down: gloo can
    abort at exit while a module-level dict still holds its groups). A device held elsewhere (a shard_map's
    cached executor or context) keeps no group either: the group dicts it shares are emptied, not just dropped."""
    for dev in _DEVICES.values():
        dev._order.clear()
        dev._p2p.clear()
    for groups in _GROUPS.values():
        groups.clear()
    _DEVICES.clear()
    _GROUPS.clear()
    _SIDE.clear()


atexit.register(_drop_groups)


def shutdown() -> None:
    """End this process's part in torch.distributed cleanly: drop funcshard's groups, destroy the default
    process group (a no-op when none was started)."""
    _drop_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_GROUPS: dict[tuple[Any, ...], dict[frozenset[str], Any]] = {}
_DEVICES: dict[Any, DistDevice] = {}


def _init_default_group() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise MeshError(
            "make_mesh(backend='dist'): torch.distributed is not initialised and RANK / WORLD_SIZE are not set; "
            "launch with torchrun (torchrun --nproc-per-node N script.py) or use backend='sim'."
        )
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=_timeout())
        return
    store, rank, world = next(dist.rendezvous("env://", timeout=_timeout()))
    store = dist.PrefixStore(generation_prefix(store, rank), store)  # this generation's keys only
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_timeout())


def generation_prefix(store: Any, rank: int) -> str:
    """The store prefix of this generation of a torchrun job's workers: ``funcshard/restart_<n>/``.

    torchrun's agent keeps its store across restarts (``--max-restarts``), so a restarted worker that starts
    its process group under the plain keys can read the dead generation's gloo addresses and fail. ``n`` counts
    this rank's starts in that store (``store.add``): every worker of a job starts once per generation, so
    ``n`` is the generation on every rank and every node (it equals ``TORCHELASTIC_RESTART_COUNT`` on one node;
    that variable stays 0 on a node whose agent restarted its workers for another node's failure).

    Example:
        >>> import datetime, torch.distributed as dist
        >>> store = dist.HashStore()
        >>> generation_prefix(store, 0), generation_prefix(store, 0)
        ('funcshard/restart_0/', 'funcshard/restart_1/')
    """
    n = store.add(f"funcshard/starts/rank_{rank}", 1) - 1
    return f"funcshard/restart_{n}/"


def _timeout() -> datetime.timedelta:
    """``FUNCSHARD_TIMEOUT`` as a timedelta (parsed again only when the variable changes)."""
    text = os.environ.get("FUNCSHARD_TIMEOUT")
    hit = _TIMEOUT.get(text)
    if hit is None:
        hit = _TIMEOUT[text] = datetime.timedelta(seconds=default_timeout())
    return hit


_TIMEOUT: dict[str | None, datetime.timedelta] = {}


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (mesh.axis_names, tuple(mesh.shape.values()))


def _build_group(mesh: Any, axes: frozenset[str]) -> Any:
    """Build (collectively) every group over ``axes``; return the one holding this process."""
    world = dist.get_world_size()
    ordered = tuple(a for a in mesh.axis_names if a in axes)
    if len(ordered) == len(mesh.axis_names) or all(mesh.shape[a] == 1 for a in mesh.axis_names if a not in axes):
        return dist.group.WORLD
    seen: set[tuple[int, ...]] = set()
    mine = None
    me = dist.get_rank()
    for r in range(world):
        members = tuple(sorted(group_members(mesh, mesh.coords_of(r), ordered)[0]))
        if members in seen:
            continue
        seen.add(members)
        g = dist.new_group(list(members), timeout=_timeout())
        if me in members:
            mine = g
    return mine


def requested() -> bool:
    """True when torch.distributed is initialised or torchrun's RANK / WORLD_SIZE are set."""
    if dist.is_available() and dist.is_initialized():
        return True
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def process_rank() -> int:
    """This process's global rank."""
    return dist.get_rank()


def tensor_device() -> torch.device | None:
    """Where this process's shards live: the current CUDA device under NCCL, else None (leave them)."""
    if "nccl" not in _BACKEND:
        _BACKEND["nccl"] = dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if _BACKEND["nccl"] else None


_BACKEND: dict[str, bool] = {}


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def setup(mesh: Any) -> None:
    """Initialise the default process group if needed, check the world size, build one group per axis."""
    _init_default_group()
    world = dist.get_world_size()
    if mesh.size != world:
        raise MeshError(
            f"make_mesh: the mesh {mesh.shape} has {mesh.size} devices but torch.distributed runs {world} "
            f"processes; make the product of the axis sizes equal {world} (or launch {mesh.size} processes)."
        )
    key = _mesh_key(mesh)
    if key not in _GROUPS:
        _GROUPS[key] = {frozenset([a]): _build_group(mesh, frozenset([a])) for a in mesh.axis_names}


def device_for(mesh: Any) -> DistDevice:
    """This process's device handle on ``mesh`` (made once per mesh)."""
    dev = _DEVICES.get(mesh)
    if dev is None:
        setup(mesh)
        dev = _DEVICES[mesh] = DistDevice(mesh)
    return dev


_PEER_TROUBLE = ("timed out", "timeout", "connection", "closed", "reset by peer", "broken pipe", "peer")
_PROBE_S = 3.0  # at most this long, after a failure, to learn which processes failed alike


def _first_line(e: BaseException) -> str:
    """torch's message without the C++ source location: ``[.../pair.cc:534] Read error`` -> ``Read error``."""
    lines = str(e).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else type(e).__name__)[:200]


def _silent_ranks(wait_s: float) -> list[int] | None:
    """The ranks that did not report a failed collective within ``wait_s`` seconds (best effort: None when
    the default store cannot tell in time, e.g. its host process is the one that stopped)."""
    box: list[list[int]] = []

    def probe() -> None:
        store = dist.distributed_c10d._get_default_store()
        me, world = dist.get_rank(), dist.get_world_size()
        store.set(f"funcshard/failed/{me}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            failed = {r for r in range(world) if store.check([f"funcshard/failed/{r}"])}
            if len(failed) == world or time.monotonic() > deadline:
                box.append([r for r in range(world) if r not in failed])
                return
            time.sleep(0.1)

    def guarded() -> None:
        try:
            probe()
        except Exception:  # noqa: BLE001 - the probe only improves the message
            pass

    # a thread: a store whose host process is stopped blocks its callers, whatever their timeout
    t = threading.Thread(target=guarded, name="funcshard-peer-probe", daemon=True)
    t.start()
    t.join(wait_s + 1.0)
    return box[0] if box else None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def peer_error(what: str, axes: tuple[str, ...], members: list[int], err: BaseException) -> PeerError:
    """The error for collective ``what`` over ``axes`` (group ``members``, global ranks) that failed with
    ``err`` because a peer did not answer or its connection broke.

    Example:
        >>> # under torchrun, with rank 3 stopped (SIGSTOP) and FUNCSHARD_TIMEOUT=10, on rank 2:
        >>> # PeerError: psum over axis 'tp' (ranks 2, 3): rank 2 got no answer within 10 s (FUNCSHARD_TIMEOUT)
        >>> # waiting for rank 3, which does not answer (stopped, hung or dead) ...
    """
    me = dist.get_rank()
    cause = _first_line(err)
    timed_out = "timed out" in cause.lower() or "timeout" in cause.lower()
    t = default_timeout()
    where = ("axis " + " x ".join(f"'{a}'" for a in axes)) if axes else "every process"
    peers = [m for m in members if m != me]
    silent = _silent_ranks(min(_PROBE_S, t))
    how = f"got no answer within {t:g} s (FUNCSHARD_TIMEOUT)" if timed_out else "lost its connection"
    head = f"{what} over {where} ({_ranks(sorted(members))}): rank {me} {how}"
    call = user_call_name()
    if call is not None:  # the user's call, which they can find in their code; ``what`` is its inner collective
        head = f"{call} (a collective: every process calls it at the same point): its {head}"
    if silent is None:
        who = "which (or a rank it waits for) is" if len(peers) == 1 else "one of them (or a rank they wait for) is"
        body = f"waiting for {_ranks(peers)}, {who} stopped, hung or dead"
    elif set(silent) & set(peers):
        gone = [r for r in peers if r in silent]
        body = f"waiting for {_ranks(gone)}, which does not answer (stopped, hung or dead)"
    elif silent:
        body = (
            f"waiting for {_ranks(peers)}, which wait(s) in turn; {_ranks(silent)} does not answer "
            f"(stopped, hung or dead)"
        )
    else:
        body = f"waiting for {_ranks(peers)}, which failed too"
    return PeerError(
        f"{head} {body}. FUNCSHARD_TIMEOUT sets how many seconds a collective waits (now {t:g}). (torch: {cause})"
    )


@contextmanager
def _waiting(what: str, axes: tuple[str, ...], members: list[int]) -> Iterator[None]:
    """Around a torch.distributed call: a peer that does not answer, or a broken connection -> :func:`peer_error`."""
    try:
        yield
    except RuntimeError as e:
        if not _peer_trouble(e):
            raise
        raise peer_error(what, axes, members, e) from e


_grad_enabled = torch.is_grad_enabled
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_REDUCE_NAMES = {"sum": "psum", "max": "pmax", "min": "pmin"}  # an all-reduce's name in errors
_ALLREDUCE_OPTIONS: dict[str, Any] = {}


def _allreduce_options(op: str) -> Any:
    """The (synchronous) ``AllreduceOptions`` for ``op``, made once."""
    opts = _ALLREDUCE_OPTIONS.get(op)
    if opts is None:
        opts = _ALLREDUCE_OPTIONS[op] = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        opts.asyncOp = False  # as dist.all_reduce(async_op=False)
    return opts


def _peer_trouble(e: BaseException) -> bool:
    """Whether torch's error says a peer did not answer or a connection broke."""
    text = str(e).lower()
    return any(k in text for k in _PEER_TROUBLE)


class _DistWork(P2PWork):
    """One posted ``send`` / ``recv`` (or, where NCCL coalesces a batch into one work, the batch's).

    ``wait()`` costs one C++ call when nothing fails: the timeout was computed when the batch was posted, and
    the error's message (naming the operation, the peer and the axis) is built only on failure.
    """

    __slots__ = ("axes", "buf", "kind", "pair", "tag", "timeout", "works")

    def __init__(
        self,
        kind: str,
        buf: torch.Tensor | None,
        works: tuple[Any, ...],
        axes: tuple[str, ...],
        pair: tuple[int, int],
        tag: int,
        timeout: datetime.timedelta,
    ) -> None:
        self.kind, self.buf, self.works, self.axes, self.pair, self.tag, self.timeout = (
            kind,
            buf,
            works,
            axes,
            pair,
            tag,
            timeout,
        )

    def wait(self) -> torch.Tensor | None:
        """Block until done (``FUNCSHARD_TIMEOUT`` at most); the received buffer, or None for a send."""
        if self.works:
            try:
                for w in self.works:
                    w.wait(self.timeout)
            except RuntimeError as e:
                err = self.failure(e)
                if err is e:
                    raise
                raise err from e
            self.works = ()  # done: the block (a send's) is no longer needed
        return self.buf

    def failure(self, e: RuntimeError) -> BaseException:
        """The error for a wait that failed with ``e``: a :func:`peer_error` naming the operation and the peer
        when a peer did not answer or its connection broke, else ``e`` itself."""
        if not _peer_trouble(e):
            return e
        peer = self.pair[1]
        what = f"p2p {self.kind} {'to' if self.kind == 'send' else 'from'} rank {peer} (tag {self.tag})"
        return peer_error(what, self.axes, list(self.pair), e)

    def is_completed(self) -> bool:
        """Whether the operation has finished (without blocking)."""
        if self.works and all(w.is_completed() for w in self.works):
            self.wait()  # done: raises a failure the backend recorded, frees the block
        return not self.works


class DistDevice(DeviceHandle):
    """This process, as a device of ``mesh``."""

    inplace_sum = True
    pending_results = True
    point_to_point = True

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.coords = mesh.coords_of(self.rank)
        self._groups = _GROUPS[_mesh_key(mesh)]
        self._order: dict[tuple[str, ...], tuple[Any, list[int], list[int], int]] = {}
        self._p2p: dict[tuple[str, ...], tuple[Any, list[int], list[int], int, bool]] = {}

    def process_group(self, axes: tuple[str, ...]) -> Any:
        """The torch.distributed process group of this process over ``axes`` (built once, shared)."""
        return self._group(axes)[0]

    def _group(self, axes: tuple[str, ...]) -> tuple[Any, list[int], list[int], int]:
        """(process group, logical members, group-rank of each logical index, my logical index)."""
        hit = self._order.get(axes)
        if hit is None:
            s = frozenset(axes)
            g = self._groups.get(s)
            if g is None:
                g = self._groups[s] = _build_group(self.mesh, s)
            members, idx = group_members(self.mesh, self.coords, axes)
            by_rank = sorted(members)
            hit = self._order[axes] = (g, members, [by_rank.index(m) for m in members], idx)
        return hit

    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): no memory to send, zeros are sent
            x = torch.zeros_like(x)  # [*s] -> [*s]
        hit = self._order.get(axes)  # (_group's own lookup)
        g, members, row_of, _ = hit if hit is not None else self._group(axes)
        if op != "sum" and x.is_floating_point():  # max / min of floats: NaN wins, as torch.maximum and sim
            return from_order_key(self.all_reduce(order_key(x.detach(), op), axes, op), x.dtype)
        # (_functional(op == "sum" and _in_backward()) written out)
        if _funcol is not None and (tracing() or (op == "sum" and _in_backward() and overlap_enabled())):
            # a gradient's sum (or any, in a compiled graph): issued now, waited for at its first use
            with _waiting(_REDUCE_NAMES[op], axes, members):
                return _issued(_funcol.all_reduce(x.detach().contiguous(), op, g))  # [*s] -> [*s] (pending)
        n = len(members)
        if 1 < n and 0 < x.nbytes * n <= _ONE_SHOT_BYTES and x.dtype in _ONE_SHOT_DTYPES and x.device.type == "cpu":
            return _one_shot(x, op, g, _REDUCE_NAMES[op], axes, members, row_of)  # [*s] -> [*s]
        # (with grad mode off, as in a Function's forward or an undifferentiated backward, the copy records nothing)
        out = (x if not _grad_enabled() else x.detach()).clone(memory_format=torch.contiguous_format)
        _reduce_now(out, op, g, _REDUCE_NAMES[op], axes, members)  # [*s] -> [*s]
        return out

    def all_reduce_pending(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Sum ``x`` over ``axes``, issued now and waited for at the result's first use (torch's
        ``AsyncCollectiveTensor``), in the forward too: for a sum whose value is needed later than it can be
        issued (the loss's token count, summed while the forward computes; the loss itself, read after the
        backward). Synchronous, as :meth:`all_reduce`, with ``FUNCSHARD_OVERLAP=0`` or in a compiled graph."""
        if _funcol is None or tracing() or not overlap_enabled() or x._is_zerotensor():
            return self.all_reduce(x, axes, "sum")  # [*s] -> [*s] (a ZeroTensor: summed as zeros)
        g, members, _, _ = self._group(axes)
        with _waiting("psum", axes, members):
            return _issued(_funcol.all_reduce(x.detach().contiguous(), "sum", g))  # [*s] -> [*s] (pending)

    def all_reduce_inplace(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Sum ``x`` over ``axes`` into ``x`` itself, no copy: ``x`` is a contiguous buffer its caller gives up
        (a gradient bucket, as DDP reduces its flat bucket in place). In a backward under overlap it is issued
        now and waited for at its first use, as :meth:`all_reduce`; in a compiled graph it is ``all_reduce``."""
        if tracing() or x._is_zerotensor():  # (a ZeroTensor has no buffer to sum into)
            return self.all_reduce(x, axes, "sum")  # [*s] -> [*s]
        g, members, _, _ = self._group(axes)
        buf = x.detach()
        if _funcol is not None and _in_backward() and overlap_enabled():  # (_functional(_in_backward()): not tracing)
            with _waiting("psum", axes, members):
                out = torch.ops._c10d_functional.all_reduce_(buf, "sum", g.group_name)  # [*s] -> [*s] in place
                return _issued(_funcol._maybe_wrap_tensor(out))  # pending
        _reduce_now(buf, "sum", g, "psum", axes, members)  # [*s] -> [*s] in place
        return buf

    def pending_sums_share_storage(self) -> bool:
        """Whether several pending in-place sums may lie in one buffer (its rows: the layers' gradient buckets of
        ``_prims.PvaryBucket``): torch's registry of pending collectives keeps every one issued on a storage (a
        wait on any view waits for them all), as torch 2.13's does; older ones keep only the first, so a later
        row's sum would not be waited for. Probed once."""
        return _registry_keeps_every_work()

    def all_reduce_inplace_parts(
        self, x: torch.Tensor, axes: tuple[str, ...], shapes: Sequence[torch.Size]
    ) -> list[torch.Tensor]:
        """:meth:`all_reduce_inplace` of the flat buffer ``x``, handed back as its consecutive views of ``shapes``
        (a gradient bucket's gradients). In a backward under overlap each view is its own pending result, made
        from a plain view of ``x`` (one wrapper each, no dispatch through a pending flat result: splitting and
        viewing that one costs two Python dispatches a view); waiting for any of them waits for the sum (the
        collective is registered under ``x``'s storage, which they share)."""
        if tracing() or x._is_zerotensor():  # (a ZeroTensor has no buffer to sum into)
            return _cut(self.all_reduce(x, axes, "sum"), shapes)  # [n] -> k x [*s_i]
        g, members, _, _ = self._group(axes)
        buf = x.detach()
        if _functional(_in_backward()):
            with _waiting("psum", axes, members):
                torch.ops._c10d_functional.all_reduce_(buf, "sum", g.group_name)  # [n] -> [n] in place
                if issued_hook is not None:
                    _issued(_funcol.AsyncCollectiveTensor(buf))
                return [_funcol.AsyncCollectiveTensor(v) for v in _cut(buf, shapes)]  # pending views
        _reduce_now(buf, "sum", g, "psum", axes, members)  # [n] -> [n] in place
        return _cut(buf, shapes)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): no memory to send, zeros are sent
            x = torch.zeros_like(x)  # [*s] -> [*s]
        if x.dtype in _BYTES_ONLY:  # a dtype gloo does not gather: its bytes are gathered
            got = self.all_gather(x.detach().reshape(-1).contiguous().view(torch.uint8), axes)  # [n, |s| * size]
            return got.view(x.dtype).view(got.shape[0], *x.shape)
        g, members, gr, _ = self._group(axes)
        n = len(members)
        if _functional(prefetching()):
            with _waiting("all_gather", axes, members):  # issued now, waited for where it is first read
                pending = _issued(_funcol_gather(x.detach().reshape(-1).contiguous(), 0, g))
            out = pending.view(n, *x.shape)  # [n * |s|] -> [n, *s] (still pending: a view)
            return out if gr == sorted(gr) else out[gr]
        out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        with _waiting("all_gather", axes, members):
            _all_gather(out, x.detach().reshape(-1).contiguous(), group=g)  # [*s] -> [n * |s|] (group-rank order)
        out = out.view(n, *x.shape)
        return out if gr == sorted(gr) else out[gr]

    def reduce_scatter(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): no memory to send, zeros are sent
            x = torch.zeros_like(x)  # [n, *s] -> [n, *s]
        g, members, gr, _ = self._group(axes)
        inp = x.detach()
        if gr != sorted(gr):
            inp = inp[_inverse(gr)]  # logical order -> group-rank order
        if _functional(_in_backward()):
            # FSDP's gradient reduce-scatter: issued now, waited for at its first use
            with _waiting("psum_scatter", axes, members):
                out = _issued(_funcol_scatter(inp.reshape(-1).contiguous(), "sum", 0, g))  # -> [|s|]
            return out.view(x.shape[1:])
        out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
        with _waiting("psum_scatter", axes, members):
            _reduce_scatter(out, inp.reshape(-1).contiguous(), group=g)  # [n * |s|] -> [|s|]
        return out.view(x.shape[1:])

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): no memory to send, zeros are sent
            x = torch.zeros_like(x)  # [n, *s] -> [n, *s]
        if x.dtype in _BYTES_ONLY:  # a dtype gloo does not move: its bytes are moved
            flat = x.detach().reshape(x.shape[0], -1).contiguous().view(torch.uint8)  # [n, |s| * size]
            return self.all_to_all(flat, axes).view(x.dtype).view(x.shape)
        g, members, gr, _ = self._group(axes)
        inp = x.detach()
        reorder = gr != sorted(gr)
        if reorder:
            inp = inp[_inverse(gr)]  # logical order -> group-rank order
        flat = inp.reshape(-1).contiguous()
        if tracing():
            out = _funcol.all_to_all_single(flat, None, None, g).view(x.shape)  # [n * |s|] -> [n * |s|]
            return out[gr] if reorder else out
        out = torch.empty_like(flat)
        with _waiting("all_to_all", axes, members):
            dist.all_to_all_single(out, flat, group=g)  # [n * |s|] -> [n * |s|] (group-rank order)
        out = out.view(x.shape)
        return out[gr] if reorder else out

    def ragged_all_to_all(
        self, x: torch.Tensor, axes: tuple[str, ...], send: tuple[int, ...] | None, recv: tuple[int, ...] | None
    ) -> torch.Tensor:
        """One ``all_to_all_single`` with row splits (gloo's alltoallv) on the group's process group. With
        ``FUNCSHARD_AUDIT=1`` the group's counts are all-gathered and checked first (every member raises the same
        error); unchecked, counts that disagree end in the transport's error (gloo aborts the process)."""
        assert send is not None and recv is not None, "a dist device holds data: the row counts are known"
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): no memory to send, zeros are sent
            x = torch.zeros_like(x)  # [N, *s] -> [N, *s]
        rows = x.detach()[: sum(send)].reshape(sum(send), math.prod(x.shape[1:]))  # [N, *s] -> [S, |s|]
        if x.dtype in _BYTES_ONLY:  # a dtype gloo does not move: its bytes are moved
            got = self.ragged_all_to_all(rows.contiguous().view(torch.uint8), axes, send, recv)  # [S, |s| * size]
            return got.view(x.dtype).view(sum(recv), *x.shape[1:])
        g, members, gr, _ = self._group(axes)
        if env("FUNCSHARD_AUDIT") == "1":
            self._check_ragged(axes, members, send, recv)
        by_rank = _inverse(gr)  # the logical index of each group rank
        if gr != sorted(gr):  # logical order -> group-rank order
            rows = torch.cat([rows[sum(send[:j]) : sum(send[: j + 1])] for j in by_rank])
        in_splits, out_splits = [send[j] for j in by_rank], [recv[j] for j in by_rank]
        flat = rows.contiguous()
        if tracing():
            out = _funcol.all_to_all_single(flat, out_splits, in_splits, g)  # [S, |s|] -> [sum(recv), |s|]
        else:
            out = flat.new_empty(sum(recv), flat.shape[1])
            with _waiting("ragged_all_to_all", axes, members):
                dist.all_to_all_single(out, flat, out_splits, in_splits, group=g)  # [S, |s|] -> [sum(recv), |s|]
        if gr != sorted(gr):  # group-rank order -> logical order
            offs = [sum(out_splits[:k]) for k in range(len(gr))]
            out = torch.cat([out[offs[gr[j]] : offs[gr[j]] + recv[j]] for j in range(len(gr))])
        return out.view(sum(recv), *x.shape[1:])

    def _check_ragged(
        self, axes: tuple[str, ...], members: list[int], send: tuple[int, ...], recv: tuple[int, ...]
    ) -> None:
        """``FUNCSHARD_AUDIT=1``: the counts of every member (one all-gather of ``2n`` ints), checked alike on each."""
        n = len(send)
        got = self.all_gather(torch.tensor([*send, *recv], dtype=torch.int64), axes).tolist()  # [2n] -> [n, 2n]
        err = ragged_mismatch(self.mesh, axes, members, [(c[:n], c[n:]) for c in got])
        if err is not None:
            raise err

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if x._is_zerotensor():  # a zero tangent / cotangent (torch's ZeroTensor): no memory to send, zeros are sent
            x = torch.zeros_like(x)  # [*s] -> [*s]
        g, members, _, idx = self._group(axes)
        send = x.detach().contiguous()
        if tracing():
            return _traced_ppermute(send, g, members, idx, perm)
        out = torch.zeros_like(send)
        ops = []
        for src, dst in perm:
            if src == idx and dst == idx:
                out.copy_(send)
            elif src == idx:
                ops.append(dist.P2POp(dist.isend, send, members[dst], group=g))
            elif dst == idx:
                ops.append(dist.P2POp(dist.irecv, out, members[src], group=g))
        if ops:
            with _waiting("ppermute", axes, members):
                for req in dist.batch_isend_irecv(ops):  # [*s] -> [*s]
                    req.wait()
        return out

    def p2p(self, ops: Sequence[P2POp], axes: tuple[str, ...]) -> list[P2PWork]:
        """Post ``ops`` over the group ``axes``; one work per op (sends and receives between the same pair are
        matched by tag, in posting order).

        Under gloo each op is one ``send`` / ``recv`` call on the axis' process group (what ``dist.isend`` /
        ``irecv`` and ``batch_isend_irecv`` end in, without their per-op Python); under NCCL, which must
        coalesce a batch into one group call, ``batch_isend_irecv``.
        """
        if tracing():
            raise ShardingError(
                "p2p: point-to-point sends (the pipeline runtime's) cannot be recorded into a compiled graph; "
                "drop compile= from the shard_map of a pipelined step (a pp axis), or compile the stage function."
            )
        if not ops:
            return []
        ent = self._p2p.get(axes)
        if ent is None:
            ent = self._p2p_setup(axes, ops[0].tensor.device)
        g, members, gr, idx, coalesce = ent
        n, me, timeout = len(members), self.rank, _timeout()
        if coalesce:
            return self._p2p_coalesced(ops, axes, timeout)
        out: list[P2PWork] = []
        try:
            for op in ops:
                peer, t = op.peer, op.tensor
                if not peer < n or peer == idx:
                    check_p2p(self.mesh, self.coords, axes, ops)  # raises, naming the peer
                if t.requires_grad or not t.is_contiguous() or t.is_complex():
                    t = _p2p_tensor(op)
                if op.kind == "send":  # [*s] -> [*s] at the peer
                    out.append(
                        _DistWork(
                            "send", None, (g.send([t], gr[peer], op.tag),), axes, (me, members[peer]), op.tag, timeout
                        )
                    )
                else:
                    out.append(
                        _DistWork(
                            "recv",
                            op.tensor,
                            (g.recv([t], gr[peer], op.tag),),
                            axes,
                            (me, members[peer]),
                            op.tag,
                            timeout,
                        )
                    )
        except RuntimeError as e:
            if not _peer_trouble(e):
                raise
            raise peer_error("p2p", axes, members, e) from e
        return out

    def _p2p_coalesced(self, ops: Sequence[P2POp], axes: tuple[str, ...], timeout: datetime.timedelta) -> list[P2PWork]:
        """``p2p`` under NCCL: one ``batch_isend_irecv`` (a coalesced group call)."""
        g, members, _, idx, _ = self._p2p[axes]
        if any(not op.peer < len(members) or op.peer == idx for op in ops):
            check_p2p(self.mesh, self.coords, axes, ops)  # raises, naming the peer
        p2p_ops = [
            dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, _p2p_tensor(op), members[op.peer], g, op.tag)
            for op in ops
        ]
        with _waiting("p2p", axes, members):
            works = tuple(dist.batch_isend_irecv(p2p_ops))  # each [*s] -> [*s] at its peer
        coalesced = len(works) != len(ops)  # one work for the whole batch
        return [
            _DistWork(
                op.kind,
                op.tensor if op.kind == "recv" else None,
                works if coalesced else (works[i],),
                axes,
                (self.rank, members[op.peer]),
                op.tag,
                timeout,
            )
            for i, op in enumerate(ops)
        ]

    def _p2p_setup(self, axes: tuple[str, ...], device: torch.device) -> tuple[Any, list[int], list[int], int, bool]:
        """(group, logical members, group rank of each, my logical index, whether to coalesce a batch) for
        point-to-point operations over ``axes``; NCCL's first operation on a group involves all its ranks."""
        g, members, gr, idx = self._group(axes)
        coalesce = dist.get_backend(g) == "nccl"
        if coalesce:  # NCCL: a group's first operation must involve all its ranks
            with _waiting("p2p setup (all-reduce)", axes, members):
                dist.all_reduce(torch.zeros(1, device=device), group=g)  # [1] -> [1]
        ent = self._p2p[axes] = (g, members, gr, idx, coalesce)
        return ent


def _p2p_tensor(op: P2POp) -> torch.Tensor:
    """What torch.distributed sends from / receives into for ``op``: detached, contiguous (a send's), complex
    numbers as pairs of reals."""
    t = op.tensor.detach()
    if not t.is_contiguous():
        if op.kind == "recv":
            raise ShardingError("p2p: a receive buffer must be contiguous; allocate it with torch.empty(shape).")
        t = t.contiguous()
    return torch.view_as_real(t) if t.is_complex() else t


def _traced_ppermute(
    send: torch.Tensor, g: Any, members: list[int], idx: int, perm: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """``ppermute`` as one functional all-to-all with uneven splits (there is no functional send / receive): this
    device sends its whole block to its ``dst`` (nothing to the others) and receives one block from its ``src``;
    a device that receives nothing gets zeros."""
    n, k = len(members), send.numel()
    dst = next((d for s, d in perm if s == idx), None)
    src = next((s for s, d in perm if d == idx), None)
    in_splits = [k if j == dst else 0 for j in range(n)]  # group-rank order is logical order here: sorted members
    out_splits = [k if j == src else 0 for j in range(n)]
    order = sorted(range(n), key=lambda j: members[j])  # logical index of each group rank
    flat = send.reshape(-1) if dst is not None else send.reshape(-1)[:0]  # what goes out: [|s|] or [0]
    got = _funcol.all_to_all_single(
        flat, [out_splits[j] for j in order], [in_splits[j] for j in order], g
    )  # [|s|] or [0] -> [|s|] or [0]
    return got.view(send.shape) if src is not None else torch.zeros_like(send)


_EVERY_WORK: list[bool] = []

#: dtypes gloo's all-gather and all-to-all refuse ("Invalid scalar type"; point-to-point takes them): moved as bytes
_BYTES_ONLY = frozenset(
    getattr(torch, name)
    for name in (
        "int16",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
)


def _reduce_now(buf: torch.Tensor, op: str, g: Any, what: str, axes: tuple[str, ...], members: list[int]) -> None:
    """``buf`` reduced by ``op`` over the group ``g`` in place, synchronously: the process group's own call
    (``dist.all_reduce``'s Python around it costs ~20 us a call; a plain try, not the generator context manager
    ``_waiting``, ~3-5k instructions); a peer's trouble raised as the ``PeerError`` of ``what`` over ``axes``."""
    try:
        if buf.is_complex():
            dist.all_reduce(buf, op=_REDUCE_OPS[op], group=g)  # [*s] -> [*s]
        else:
            opts = _ALLREDUCE_OPTIONS.get(op)  # (_allreduce_options's own lookup)
            g.allreduce([buf], opts if opts is not None else _allreduce_options(op)).wait()  # [*s] -> [*s]
    except RuntimeError as e:
        if not _peer_trouble(e):
            raise
        raise peer_error(what, axes, members, e) from e


def _one_shot_bytes() -> int:
    """``FUNCSHARD_ONE_SHOT_BYTES`` (default 256 KiB), checked."""
    text = os.environ.get("FUNCSHARD_ONE_SHOT_BYTES")
    if text is None:
        return 256 << 10
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"FUNCSHARD_ONE_SHOT_BYTES={text!r}: expected a number of bytes, an integer >= 0 (default 262144; 0: "
            f"never one-shot), e.g. FUNCSHARD_ONE_SHOT_BYTES=65536."
        )
    return value


#: a synchronous all-reduce whose gathered copies take at most this many bytes is a one-shot all-reduce (every
#: member gathers every copy, then sums them itself): one ring pass (n - 1 exchanges) instead of gloo's reduce-scatter
#: plus all-gather (2 (n - 1)), i.e. half the wake-ups for a latency-bound sum (activations of a small batch, a loss, a
#: token count); as NCCL picks an algorithm by size. Measured (gloo, 2 cores, median wall clock of one sum): 1-64 KiB
#: over 2 processes 480-940 -> 385-810 us, over 4 processes 4.7-5.0 -> 3.5-3.8 ms; 1 MiB over 2: 1.48 -> 1.77 ms (so
#: not above). ``FUNCSHARD_ONE_SHOT_BYTES`` sets it (0: never).
_ONE_SHOT_BYTES = _one_shot_bytes()
_ONE_SHOT_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64))


def _one_shot(
    x: torch.Tensor, op: str, g: Any, what: str, axes: tuple[str, ...], members: list[int], row_of: list[int]
) -> torch.Tensor:
    """``x`` reduced by ``op`` over the group ``g`` by gathering every member's copy and reducing them here, in the
    group's logical order (``row_of``: the gathered row of each logical member): the same bits on every member, and
    the sim backend's (it reduces in that order too). A peer's trouble raised as :func:`_reduce_now` raises it."""
    src = x.detach().reshape(-1)  # [|s|] (a copy only where x is not contiguous)
    flat = torch.empty(len(members) * src.numel(), dtype=src.dtype)  # [n |s|]
    try:
        g._allgather_base(flat, src).wait()  # [|s|] -> [n |s|], rows in group-rank order
    except RuntimeError as e:
        if not _peer_trouble(e):
            raise
        raise peer_error(what, axes, members, e) from e
    rows = flat.view(len(members), *x.shape)  # [n, *s]
    fn = _ONE_SHOT_OPS[op]  # (max / min: integers; floats come as their order keys)
    out = fn(rows[row_of[0]], rows[row_of[1]])  # [*s] op [*s] -> [*s]
    for r in row_of[2:]:
        fn(out, rows[r], out=out)
    return out


_ONE_SHOT_OPS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _registry_keeps_every_work() -> bool:
    """See :meth:`DistDevice.pending_sums_share_storage`: two finished stand-in works registered on two views of
    one storage, counted, and ONE wait on a third view: it must unregister (wait for) both."""
    if not _EVERY_WORK:
        try:
            c10d = torch._C._distributed_c10d
            t = torch.empty(3)
            n0 = c10d._get_work_registry_size()
            c10d._register_work(t[:1], c10d.FakeWork())
            c10d._register_work(t[1:2], c10d.FakeWork())
            both = c10d._get_work_registry_size() - n0 == 2
            torch.ops._c10d_functional.wait_tensor(t[2:])  # (at once: fake works)
            both = both and c10d._get_work_registry_size() == n0
            for _ in range(2):  # whatever a torch that keeps one work a storage left registered
                torch.ops._c10d_functional.wait_tensor(t)
            _EVERY_WORK.append(both)
        except (AttributeError, RuntimeError):  # a torch without these: never share
            _EVERY_WORK.append(False)
    return _EVERY_WORK[0]


def _cut(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive views of ``shapes``."""
    parts = flat.split([s.numel() for s in shapes])  # [sum |s_i|] -> k x [|s_i|]
    return [p.view(s) for p, s in zip(parts, shapes, strict=True)]


def initialized() -> bool:
    """True when the default process group is up."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait until every process of the default group reaches this call."""
    with _waiting("barrier", (), list(range(dist.get_world_size()))):
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as process ``src`` passed it, on every process (pickled; a collective)."""
    box = [obj]
    with _waiting("broadcast", (), list(range(dist.get_world_size()))):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every process's ``obj``, in rank order, on every process (pickled; a collective): how the processes
    of a checkpoint load agree that one of them found the checkpoint damaged before any starts reading."""
    box: list[Any] = [None] * dist.get_world_size()
    with _waiting("all_gather_object", (), list(range(dist.get_world_size()))):
        dist.all_gather_object(box, obj)
    return box


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is True on any process (a collective over the default group): how
    the processes of a job agree, at the same step, to stop after Ctrl-C.

    Example:
        >>> # under torchrun: stop = any_process(interrupted)  # the same answer on every rank
    """
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=tensor_device())
    with _waiting("any_process", (), list(range(dist.get_world_size()))):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def peer_failure(what: str, err: BaseException) -> BaseException | None:
    """The :class:`PeerError` for ``err`` (or an exception in its chain, or one of the per-rank failures that
    torch.distributed.checkpoint's ``CheckpointException`` holds) when it says a peer did not answer or a
    connection broke; None otherwise. ``what``: the call that raised it."""
    seen: list[BaseException] = []
    todo = [err]
    while todo and len(seen) < 32:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, PeerError):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
    for e in seen:
        if isinstance(e, RuntimeError) and _peer_trouble(e) and initialized():
            return peer_error(what, (), list(range(dist.get_world_size())), e)
    return None


class DistBackend(BackendImpl):
    """The ``"dist"`` backend: one device per torch.distributed process; it answers the process questions over
    the default process group, and hands arrays off to torch's DTensor.

    Example:
        >>> DistBackend().multiprocess, DistBackend().dtensor
        (True, True)
    """

    name = "dist"
    multiprocess = True
    execution = "process"
    dtensor = True
    keeps_buckets = True  # (collectives.prims.BUCKETS)

    def requested(self) -> bool:
        return requested()

    def started(self) -> bool:
        return initialized()

    def setup(self, mesh: Any) -> None:
        setup(mesh)

    def shutdown(self) -> None:
        shutdown()

    def process_index(self) -> int:
        return process_rank()

    def process_count(self) -> int:
        return dist.get_world_size()

    def local_ranks(self, mesh: Any) -> list[int]:
        return [process_rank()]

    def local_device(self) -> torch.device | None:
        return tensor_device()

    def barrier(self) -> None:
        barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return all_gather_object(obj)

    def any_process(self, flag: bool) -> bool:
        return any_process(flag)

    def peer_failure(self, what: str, err: BaseException) -> BaseException | None:
        return peer_failure(what, err)

    def side_channel(self) -> BackendImpl:
        side = _SIDE.get("side")
        if side is None:
            side = _SIDE["side"] = SideChannel(dist.new_group(backend="gloo", timeout=_timeout()))
        return side

    def device(self, mesh: Any) -> DistDevice:
        return device_for(mesh)

    def live_devices(self) -> Collection[DistDevice]:
        return _DEVICES.values()  # (a live view: emptied when torch.distributed restarts)

    def is_dtensor(self, x: Any) -> bool:
        from . import dtensor

        return dtensor.is_dtensor(x)

    def dtensor_layout(self, dt: Any) -> tuple[tuple[str, ...] | None, tuple[int, ...], list[Any], torch.Tensor]:
        from . import dtensor

        return dtensor.layout(dt)

    def dtensor_from_local(
        self, local: torch.Tensor, mesh: Any, shard_dims: list[int | None], shape: tuple[int, ...]
    ) -> Any:
        from . import dtensor

        return dtensor.from_local(local, mesh, shard_dims, shape)


class SideChannel(DistBackend):
    """The process questions over a second process group (gloo, every process): a background thread's own
    channel (:meth:`DistBackend.side_channel`), so its collectives never interleave with the main thread's."""

    def __init__(self, group: Any) -> None:
        self._group = group

    @property
    def process_group(self) -> Any:
        return self._group

    def side_channel(self) -> BackendImpl:
        return self

    def barrier(self) -> None:
        with _waiting("barrier", (), list(range(dist.get_world_size()))):
            dist.barrier(group=self._group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        with _waiting("broadcast", (), list(range(dist.get_world_size()))):
            dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        box: list[Any] = [None] * dist.get_world_size()
        with _waiting("all_gather_object", (), list(range(dist.get_world_size()))):
            dist.all_gather_object(box, obj, group=self._group)
        return box

    def any_process(self, flag: bool) -> bool:
        return any(self.all_gather_object(bool(flag)))


_SIDE: dict[str, SideChannel] = {}
