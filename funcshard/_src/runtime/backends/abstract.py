"""The ``"abstract"`` backend: a mesh of any size that holds no data and starts nothing.

Every block is a meta tensor (a shape and a dtype), every collective returns a meta tensor of the shape the real
one would, and ``fs.comm_stats`` counts it as a real run does. The executor above runs the body once per *class*
of devices (``shard_map.executor.ClassExecutor``), not once per device: devices whose programs cannot differ. A
body's program can only differ between devices through a Python number read from the device's coordinates
(``axis_index_int``: a pipeline's stage, a ring's position); :meth:`AbstractDevice.index` notes each axis read
that way, and the executor splits the devices by their coordinates on those axes, as JAX traces one program and
specialises only on what is concrete.

``fs.axis_index`` returns a meta tensor here: arithmetic on it works, ``int(...)`` of it raises (its value is
not known); funcshard's own ops read indices for control flow with ``axis_index_int``.

Example:
    >>> import torch
    >>> from funcshard import make_mesh
    >>> mesh = make_mesh({"fsdp": 512, "tp": 8}, backend="abstract")
    >>> dev = mesh.backend_impl.world(mesh).device(9)
    >>> dev.coords, tuple(dev.all_gather(torch.empty(3, 4, device="meta"), ("tp",)).shape)
    ({'fsdp': 1, 'tp': 1}, (8, 3, 4))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..comm import P2POp, P2PWork
from .base import BackendImpl, DeviceHandle, check_p2p, group_members

__all__ = ["AbstractBackend", "AbstractDevice", "AbstractWorld"]


def _meta(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


class _Done(P2PWork):
    """A posted point-to-point op of an abstract device: complete at once (no data moves)."""

    __slots__ = ("op",)

    def __init__(self, op: P2POp) -> None:
        self.op = op

    def wait(self) -> torch.Tensor | None:
        return self.op.tensor if self.op.kind == "recv" else None

    def is_completed(self) -> bool:
        return True


class AbstractDevice(DeviceHandle):
    """One device of an abstract mesh: collectives give meta results of the right shape.

    Attributes:
        read_axes: the axes whose index this device's body read as a Python number (:meth:`index`).
    """

    point_to_point = True
    holds_data = False

    def __init__(self, world: AbstractWorld, rank: int) -> None:
        self.world = world
        self.mesh = world.mesh
        self.rank = rank
        self.coords = self.mesh.coords_of(rank)
        self.read_axes: set[str] = set()
        self.calls: dict[tuple[int, ...], int] = {}  # per group: the all-reduces of values made so far

    def index(self, axes: tuple[str, ...]) -> int:
        """This device's index over ``axes``, noted as read: the body's program depends on it."""
        self.read_axes.update(axes)
        return super().index(axes)

    def _n(self, axes: tuple[str, ...]) -> int:
        shape = self.mesh.shape
        return math.prod(shape[a] for a in axes)

    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        if x.is_meta:
            return _meta(x.shape, x.dtype)  # [*s] -> [*s]
        return self.world.board(self, axes, x, op)  # [*s] -> [*s]: a value the program reads

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        return _meta((self._n(axes), *x.shape), x.dtype)  # [*s] -> [n, *s]

    def reduce_scatter(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        return _meta(x.shape[1:], x.dtype)  # [n, *s] -> [*s]

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        return _meta(x.shape, x.dtype)  # [n, *s] -> [n, *s]

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return _meta(x.shape, x.dtype)  # [*s] -> [*s]

    def ragged_all_to_all(
        self, x: torch.Tensor, axes: tuple[str, ...], send: tuple[int, ...] | None, recv: tuple[int, ...] | None
    ) -> torch.Tensor:
        """The received rows' shape: ``sum(recv)`` rows where the counts are known, else as many as were sent
        (balanced routing: every member sends and receives the same number of rows)."""
        rows = x.shape[0] if recv is None else sum(recv)
        return _meta((rows, *x.shape[1:]), x.dtype)  # [N, *s] -> [sum(recv), *s] (or [N, *s])

    def p2p(self, ops: Sequence[P2POp], axes: tuple[str, ...]) -> list[P2PWork]:
        check_p2p(self.mesh, self.coords, axes, ops)
        return [_Done(op) for op in ops]


class AbstractWorld:
    """The devices of one abstract call, made on request (a mesh of 4096 devices makes only those it runs), and
    the board where the values of small all-reduces of real tensors meet.

    A program that sums a few numbers over an axis and reads them (the pipeline runtime tells every stage the
    shape of the activations it will receive) gets, on an abstract mesh, the sum over the group's devices that
    already ran of what each passed (the others left out: each reduction is of what arrived so far): the
    executor runs one device per class in rank order, so the first stage, which knows the shape, has run by then.
    """

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self._board: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}

    def device(self, rank: int) -> AbstractDevice:
        """A fresh handle of the device of rank ``rank`` (its ``read_axes`` empty)."""
        return AbstractDevice(self, rank)

    def board(self, dev: AbstractDevice, axes: tuple[str, ...], x: torch.Tensor, op: str) -> torch.Tensor:
        """The reduction of ``x`` with what the devices of ``dev``'s group that ran before passed to the same
        call (its k-th all-reduce of values over this group)."""
        group = tuple(group_members(self.mesh, dev.coords, axes)[0])
        k = dev.calls.get(group, 0)
        dev.calls[group] = k + 1
        have = self._board.get((group, k))
        if have is None:
            out = x.detach().clone()
        elif op == "sum":
            out = have + x.detach()
        else:
            out = (torch.maximum if op == "max" else torch.minimum)(have, x.detach())
        self._board[(group, k)] = out
        return out.clone()


class AbstractBackend(BackendImpl):
    """The ``"abstract"`` backend: no data, no processes, any size (see the module docstring). Never picked by
    ``backend="auto"``.

    Example:
        >>> AbstractBackend().holds_data, AbstractBackend().execution
        (False, 'classes')
    """

    name = "abstract"
    holds_data = False
    execution = "classes"

    def world(self, mesh: Any) -> AbstractWorld:
        return AbstractWorld(mesh)
