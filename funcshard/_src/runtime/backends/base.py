"""What every backend shares: group membership, the device-handle interface with its declared capabilities, and
:class:`BackendImpl`, what a backend declares about itself and how it answers the process questions (``Mesh`` asks
them). The records and flags the code above the backends shares with them live in ``runtime.comm`` and
``runtime.context``."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from ...errors import ShardingError
from ..comm import P2POp, P2PWork

__all__ = [
    "BackendImpl",
    "DeviceHandle",
    "check_p2p",
    "from_order_key",
    "group_members",
    "order_key",
    "ragged_mismatch",
]

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


def ragged_mismatch(
    mesh: Any, axes: tuple[str, ...], members: Sequence[int], sizes: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> ShardingError | None:
    """The error for a ragged all-to-all over ``axes`` whose row counts disagree, or None: ``sizes[i]`` is member
    i's ``(send_sizes, recv_sizes)`` (logical order, ``members`` their ranks), and ``recv_sizes[j]`` of member i
    must equal ``send_sizes[i]`` of member j. The first disagreement in (receiver, sender) order is named, so
    every member that checks the same counts raises the same error.

    Example:
        >>> from funcshard import make_mesh
        >>> ragged_mismatch(make_mesh({"ep": 2}, backend="sim"), ("ep",), [0, 1], [((1, 2), (1, 0)), ((0, 3), (2, 3))])
    """
    for i, (_, recv) in enumerate(sizes):
        for j, (send, _) in enumerate(sizes):
            if int(recv[j]) != int(send[i]):

                def name(k: int) -> str:
                    return "(" + ", ".join(f"{a}={c}" for a, c in mesh.coords_of(members[k]).items()) + ")"

                return ShardingError(
                    f"ragged_all_to_all over {axes}: device {name(i)} (index {i}) expects recv_sizes[{j}] = "
                    f"{int(recv[j])} rows from device {name(j)} (index {j}), which sends it send_sizes[{i}] = "
                    f"{int(send[i])}; device {name(i)} has send_sizes={list(map(int, sizes[i][0]))}, "
                    f"recv_sizes={list(map(int, recv))}. recv_sizes[j] on device i must equal send_sizes[i] on "
                    f"device j: exchange the counts first (recv_sizes = fs.all_to_all(send_sizes, axis, 0, 0)), or "
                    f"pass recv_sizes=None to have them exchanged."
                )
    return None


class DeviceHandle:
    """One device of a mesh, as the collectives see it. Subclassed by each backend, which declares what it can
    do beyond the five collectives by overriding the capabilities below (class attributes: a check is one read).

    Attributes:
        mesh: the mesh.
        rank: this device's rank (row-major index of its coordinates).
        coords: this device's coordinates, axis name -> index.
        inplace_sum: :meth:`all_reduce_inplace` (and :meth:`all_reduce_inplace_parts`) sum into the caller's
            buffer with no copy (default False: the collectives copy).
        pending_results: :meth:`all_reduce_pending` may return a pending result, waited for at its first use
            (``collectives.vma.settle``); default False: every result is ready.
        point_to_point: :meth:`p2p` posts sends and receives (default False).
        holds_data: blocks and results hold values (default True); False: meta tensors, shapes only.

    Example:
        >>> DeviceHandle.inplace_sum, DeviceHandle.pending_results
        (False, False)
    """

    mesh: Any
    rank: int
    coords: dict[str, int]
    inplace_sum: bool = False
    pending_results: bool = False
    point_to_point: bool = False
    holds_data: bool = True

    def index(self, axes: tuple[str, ...]) -> int:
        """This device's index over ``axes`` (row-major over them), as a Python number: what the body reads for
        a shape or a branch (``axis_index_int``)."""
        idx = 0
        shape, coords = self.mesh.shape, self.coords
        for a in axes:
            idx = idx * shape[a] + coords[a]
        return idx

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

    def ragged_all_to_all(
        self, x: torch.Tensor, axes: tuple[str, ...], send: tuple[int, ...] | None, recv: tuple[int, ...] | None
    ) -> torch.Tensor:
        """``[N, *s] -> [sum(recv), *s]``: the first ``send[j]`` rows after member j-1's go to member j, the rows
        from member i arrive in source order (``recv[i]`` of them); rows after ``sum(send)`` are not sent. ``send``
        and ``recv`` both None (only where not :attr:`holds_data`): balanced routing, ``[N, *s] -> [N, *s]``."""
        raise NotImplementedError

    def p2p(self, ops: Sequence[P2POp], axes: tuple[str, ...]) -> list[P2PWork]:
        """Post a batch of point-to-point sends and receives over the group ``axes`` without waiting; one work
        per op, in order. A send completes once its receiver has posted the matching receive (rendezvous), a
        receive once its block has arrived; neither blocks the caller until its work's ``wait()``.

        Not differentiable (no autograd): for runtimes that do their own backward, as ``pipeline.run``.
        """
        raise NotImplementedError

    def all_reduce_pending(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Sum ``x`` over ``axes``, possibly as a pending result (where :attr:`pending_results`); by default the
        synchronous :meth:`all_reduce`."""
        return self.all_reduce(x, axes, "sum")

    def all_reduce_inplace(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Sum ``x`` over ``axes`` into ``x``'s own buffer (a contiguous temporary its caller gives up); only
        where :attr:`inplace_sum`."""
        raise NotImplementedError

    def all_reduce_inplace_parts(
        self, x: torch.Tensor, axes: tuple[str, ...], shapes: Sequence[torch.Size]
    ) -> list[torch.Tensor]:
        """:meth:`all_reduce_inplace` of the flat buffer ``x``, handed back as its consecutive views of ``shapes``
        (a gradient bucket's gradients); only where :attr:`inplace_sum`."""
        total = self.all_reduce_inplace(x, axes)  # [n] -> [n]
        parts = total.split([s.numel() for s in shapes])  # [n] -> k x [|s_i|]
        return [p.view(s) for p, s in zip(parts, shapes, strict=True)]

    def pending_sums_share_storage(self) -> bool:
        """Whether several pending in-place sums may lie in one buffer (rows of a layers' gradient bucket); only
        asked where :attr:`pending_results` and :attr:`inplace_sum`. Default False."""
        return False


class BackendImpl:
    """What a backend declares about itself, and how it answers the process questions that ``Mesh`` asks it
    (process index, local devices, barrier, broadcast of an object). One instance per backend, from the registry
    (``runtime.backends.get(name)``); a mesh holds its backend's as ``mesh.backend_impl``. The defaults are those
    of a backend whose devices all run in this one process and need no setup.

    Attributes:
        name: the backend's name (``mesh.backend``).
        multiprocess: each device of a mesh runs in its own process, this process one of them (its collectives
            cross processes; the device and its groups live from call to call); False: this process runs every
            device of the mesh.
        audit: a ``check_vma=False`` program is audited by default (``FUNCSHARD_AUDIT=1`` asks for it elsewhere).
        dtensor: arrays hand off to torch's DTensor (:meth:`dtensor_from_local`, :meth:`dtensor_layout`).
        holds_data: arrays hold values (False: shapes and dtypes only, every block a meta tensor).
        execution: how ``shard_map`` runs a body on this backend's devices: ``"threads"`` (every device in
            this process, one thread each, :meth:`world`), ``"process"`` (this process's one device,
            :meth:`device`) or ``"classes"`` (one run per class of devices whose programs cannot differ,
            :meth:`world`).
        keeps_buckets: a step's gradient buckets stay allocated from one step to the next, in a pool (as DDP
            keeps its buckets): what an ahead-of-time memory analysis of a run on this backend counts (``lower``).

    Example:
        >>> impl = BackendImpl()
        >>> impl.multiprocess, impl.process_index(), impl.broadcast_object("hi")
        (False, 0, 'hi')
    """

    name: str = ""
    multiprocess: bool = False
    audit: bool = False
    dtensor: bool = False
    holds_data: bool = True
    execution: str = "threads"
    keeps_buckets: bool = False

    # ------------------------------------------------------------------------------------ choosing, setting up
    def requested(self) -> bool:
        """Whether ``make_mesh(backend="auto")`` picks this backend (its environment asks for it)."""
        return False

    def started(self) -> bool:
        """Whether this backend's processes are up now (what a job with no mesh at hand runs on)."""
        return False

    def setup(self, mesh: Any) -> None:
        """Make ``mesh`` ready to run (``make_mesh`` calls it once per mesh made); by default nothing."""

    def shutdown(self) -> None:
        """Leave cleanly at the end of a job (``process.shutdown``); by default nothing."""

    def abandoned_threads(self) -> list[Any]:
        """Device threads still running in calls that already raised (``process.abandoned_threads``)."""
        return []

    # ------------------------------------------------------------------------------------ the process questions
    def process_index(self) -> int:
        """This process's index among the job's processes (0 in a one-process job)."""
        return 0

    def process_count(self) -> int:
        """The number of the job's processes."""
        return 1

    def local_ranks(self, mesh: Any) -> list[int]:
        """The ranks of ``mesh``'s devices that this process runs, in rank order (every one by default)."""
        return list(range(mesh.size))

    def local_device(self) -> torch.device | None:
        """The torch device this process's shards live on; None: shards stay where they are."""
        return None

    def barrier(self) -> None:
        """Wait until every process reaches this call (one process: nothing to wait for)."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as process ``src`` passed it, on every process (one process: ``obj`` itself)."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in process order, on every process."""
        return [obj]

    def any_process(self, flag: bool) -> bool:
        """``flag`` on any process (the same answer on every process)."""
        return flag

    @property
    def process_group(self) -> Any:
        """The torch.distributed process group these process questions go over, for a library that takes one
        (torch.distributed.checkpoint); None: the default group, or none at all."""
        return None

    def side_channel(self) -> BackendImpl:
        """These process questions over a second channel of their own, for ONE background thread whose
        collectives run while the main thread's go on (an asynchronous checkpoint): under torch.distributed a
        second process group over every process, made once, by every process at the same point (the first call
        is a collective). Where there are no peers, the backend itself.

        Example:
            >>> BackendImpl().side_channel().barrier()  # one process: nothing to wait for
        """
        return self

    def peer_failure(self, what: str, err: BaseException) -> BaseException | None:
        """The ``PeerError`` for ``err``, raised by ``what`` (a library call this backend did not make, such as
        torch.distributed.checkpoint's own collectives) when it says that a peer process did not answer or its
        connection broke; None otherwise (and always where there are no peer processes)."""
        return None

    # ------------------------------------------------------------------------------------------------- devices
    def world(self, mesh: Any) -> Any:
        """Where this process runs every device of ``mesh`` (not :attr:`multiprocess`): an object whose
        ``run(fn, *, grad=None)`` calls ``fn(device_handle)`` once per device and returns the results in rank
        order."""
        raise NotImplementedError(f"the '{self.name}' backend runs one device per process: use device(mesh)")

    def device(self, mesh: Any) -> DeviceHandle:
        """This process's device handle on ``mesh`` (:attr:`multiprocess` backends; made once per mesh)."""
        raise NotImplementedError(f"the '{self.name}' backend runs every device in this process: use world(mesh)")

    def live_devices(self) -> Collection[DeviceHandle]:
        """The device handles :meth:`device` holds now (a live view: one no longer in it is stale)."""
        return ()

    # ------------------------------------------------------------------------------------------------ DTensor
    def is_dtensor(self, x: Any) -> bool:
        """Whether ``x`` is a torch DTensor (where :attr:`dtensor`)."""
        return False

    def dtensor_layout(self, dt: Any) -> tuple[tuple[str, ...] | None, tuple[int, ...], list[Any], torch.Tensor]:
        """A DTensor's mesh dim names and sizes, the tensor dim each mesh dim shards (None: replicated) and its
        local block, partial placements reduced first (where :attr:`dtensor`)."""
        raise NotImplementedError(f"the '{self.name}' backend has no DTensor hand-off")

    def dtensor_from_local(
        self, local: torch.Tensor, mesh: Any, shard_dims: list[int | None], shape: tuple[int, ...]
    ) -> Any:
        """The DTensor holding this process's block ``local`` of a value of ``shape`` (where :attr:`dtensor`)."""
        raise NotImplementedError(f"the '{self.name}' backend has no DTensor hand-off")
