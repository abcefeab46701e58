"""What both backends share: group membership and the device-handle interface."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["DeviceHandle", "default_timeout", "group_members"]


def default_timeout() -> float:
    """Seconds a collective may wait for its peers (``FUNCSHARD_TIMEOUT``, default 300)."""
    return float(os.environ.get("FUNCSHARD_TIMEOUT", "300"))


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
