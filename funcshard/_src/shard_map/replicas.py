"""``shard_map(check_vma=False)`` under ``"dist"``: the check that an output is the same on every device of the
axes its out_spec omits, as ``"sim"`` checks it on every call by comparing the devices' values.

Nothing else tells a ``check_vma=False`` program that it returns a per-device value as replicated (a ``pvary``
left out before ``torch.func.grad``: each device's gradient of its own batch, not the sum). Under dist each
process holds only its own block, so the processes compare fingerprints of their outputs (integer sums of the
values' bits: equal blocks give equal fingerprints, exactly) in one all-reduce per omitted axis; where they
differ, one more all-reduce of that output gives the largest difference for the error. It runs on the first
call of each output signature (``FUNCSHARD_AUDIT=1``: on every call; ``FUNCSHARD_AUDIT=0``: never).

Example:
    >>> import torch
    >>> fingerprint(torch.ones(3)).tolist() == fingerprint(torch.ones(3)).tolist()
    True
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..arrays.reshard import comparable
from ..errors import ShardingError
from ..runtime.mesh import Mesh
from .executor import audit_env

__all__ = ["check_replicas", "extremes", "fingerprint", "maybe_check_replicas"]

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements at a time (an int64 copy of 32 MiB at most)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``[3]`` int64 of ``t``'s bits (sum, sum of squares, sum weighted by position; wrapping): equal for equal
    tensors of one shape and dtype (``-0.0`` taken as ``0.0``), and different for different ones but by a rare
    collision.

    Example:
        >>> import torch
        >>> a = torch.tensor([1.0, 2.0])
        >>> bool((fingerprint(a) != fingerprint(a.flip(0))).any())
        True
    """
    x = comparable(t.detach())
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.contiguous().reshape(-1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    ints, floating = _INTS[x.element_size()], x.is_floating_point()
    out = torch.zeros(3, dtype=torch.int64, device=x.device)
    for i in range(0, x.numel(), _CHUNK):
        c = x[i : i + _CHUNK]
        if floating:
            c = c + 0  # -0.0 -> 0.0: equal values (torch.equal's sense, as sim compares) give equal bits
        b = c.view(ints).to(torch.int64)
        pos = torch.arange(i + 1, i + 1 + b.numel(), dtype=torch.int64, device=x.device)
        out += torch.stack((b.sum(), (b * b).sum(), (b * pos).sum()))
    return out


def extremes(dev: Any, x: torch.Tensor, axes: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise minimum and maximum of ``x`` over the devices of ``axes``: one all-reduce (max) of
    ``[x, -x]`` by the device handle itself (no ``fs.comm_stats`` count: not a collective of the program); a
    peer's failure raises the backend's ``PeerError`` as a collective's does.

    Example:
        >>> # lo, hi = extremes(dev, torch.tensor([3, 5]), ("dp",))  # equal replicas: lo == hi == x
    """
    buf = torch.stack((x, -x))  # 2 x [*s] -> [2, *s]
    buf = dev.all_reduce(buf.to(dev.mesh.local_device() or x.device), axes, "max").to(x.device)  # [2, *s] -> [2, *s]
    return -buf[1], buf[0]


_CHECKED: dict[int, Any] = {}  # id -> the output plans checked (kept: an id is not reused while they live)


def maybe_check_replicas(name: str, mesh: Mesh, check_vma: bool, plan: Any, leaves: list[Any], dev: Any) -> None:
    """:func:`check_replicas` where it is due: a ``check_vma=False`` call under ``"dist"`` whose output plan
    (one per output signature) was not checked yet, or every call with ``FUNCSHARD_AUDIT=1``; never with
    ``FUNCSHARD_AUDIT=0``. Every process of the mesh makes the same decision (the same calls, the same plans)."""
    if check_vma:
        return
    if _CHECKED.get(id(plan)) is plan:  # (checked: a dist mesh's plan; the common call, asked first)
        if not audit_env():
            return
    elif not mesh.is_multiprocess or os.environ.get("FUNCSHARD_AUDIT") == "0":
        return
    check_replicas(name, mesh, plan, leaves, dev)
    if len(_CHECKED) > 4096:
        _CHECKED.clear()
    _CHECKED[id(plan)] = plan


def check_replicas(name: str, mesh: Mesh, plan: Any, leaves: list[Any], dev: Any) -> None:
    """Raise, on every process, where an output differs from its replicas on the devices of an axis its spec
    omits (``plan``: the outputs' paths, specs and global shapes, ``leaves``: this device's blocks).

    One all-reduce per omitted axis compares the fingerprints within each group of that axis, one over the
    whole mesh tells every process what any group found; on a difference, two more give its size.

    Raises:
        ShardingError: the output's path and spec, the axis, and the largest difference between its replicas.
    """
    everywhere = tuple(mesh.axis_names)
    checks: list[tuple[str, int]] = []  # (axis, output index) compared
    found: list[torch.Tensor] = []
    for axis in mesh.axis_names:
        if mesh.shape[axis] == 1:
            continue
        ks = [k for k, ((_, _, gshape), allowed) in enumerate(zip(plan, plan.allowed, strict=True))
              if gshape is not None and axis not in allowed]  # fmt: skip
        if not ks:
            continue
        lo, hi = extremes(dev, torch.stack([fingerprint(leaves[k]).cpu() for k in ks]), (axis,))  # [n, 3] -> 2 x [n, 3]
        checks += [(axis, k) for k in ks]
        found.append((lo != hi).any(dim=1).to(torch.int64))  # [n]
    if not checks:
        return
    _, anywhere = extremes(dev, torch.cat(found), everywhere)  # [m] -> [m]: what any group of each axis found
    for (axis, k), bad in zip(checks, anywhere.tolist(), strict=True):
        if not bad:
            continue
        path, spec, _ = plan[k]
        v = leaves[k].detach()
        v = (torch.view_as_real(v) if v.is_complex() else v).double()
        vlo, vhi = extremes(dev, v, (axis,))  # [*s] -> 2 x [*s]
        diff = (vhi - vlo).abs().max() if v.numel() else torch.zeros((), dtype=torch.float64)
        _, diff = extremes(dev, diff.reshape(1).cpu(), everywhere)  # [1] -> [1]: the largest of every group's
        raise ShardingError(
            f"{name} at '{path}': out_specs gives {spec!r}, which says the output is the same on every device "
            f"of axis '{axis}', but the devices of '{axis}' hold blocks that differ by up to {diff.item():.3g} "
            f"(check_vma=False: checked under dist on the first call of each output signature). Reduce it over "
            f"'{axis}' (fs.psum / fs.pmean), or name '{axis}' in the out spec; where a pvary was left out before "
            f"a gradient, write fs.pvary(w, '{axis}') on the parameter, or use check_vma=True."
        )
