"""What both backends share: group membership, the device-handle interface, and how long a collective waits."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import MeshError, ShardingError

__all__ = ["DEFAULT_TIMEOUT", "DeviceHandle", "PeerError", "default_timeout", "group_members"]

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
