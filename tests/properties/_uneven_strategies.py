"""Hypothesis strategies and single-device references shared by the uneven-dim properties (issue #31, API §14).

Meshes of 1-8 devices with 1-3 axes named from dp / fsdp / tp / cp / ep; tensors of rank 1-4 whose dims (0..13)
the axes rarely divide; specs that shard a dim over one axis or a tuple of axes (each axis at most once). The
reference layout is ``torch.tensor_split``'s, computed here from the mesh coordinates alone (not from funcshard).
"""

from __future__ import annotations

import math
import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from funcshard import P

AXIS_NAMES = ("dp", "fsdp", "tp", "cp", "ep")
#: deterministic in CI (derandomize: the same examples on every run), no example database, no per-example deadline
FIXED = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}


#: ``FUNCSHARD_PROPS_SCALE=N`` (a bug hunt, not CI): N times the examples, drawn at random (not derandomized)
SCALE = int(os.environ.get("FUNCSHARD_PROPS_SCALE", "0"))


def fixed(max_examples: int) -> settings:
    """The folder's settings with ``max_examples`` examples (``SCALE`` times as many, random ones, where set).

    Example:
        >>> @fixed(20)
        ... @given(meshes())
        ... def test_x(mesh_shape): ...
    """
    if SCALE:
        return settings(max_examples=max_examples * SCALE, **{**FIXED, "derandomize": False})
    return settings(max_examples=max_examples, **FIXED)


@st.composite
def meshes(draw: st.DrawFn, max_devices: int = 8, names: tuple[str, ...] = AXIS_NAMES) -> dict[str, int]:
    """A mesh shape (name -> size): 1-3 axes with distinct names, sizes 1-4 (mostly 2-4), at most ``max_devices``
    devices."""
    k = draw(st.integers(1, min(3, len(names))))
    chosen = draw(st.permutations(names))[:k]
    shape, left = {}, max_devices
    for name in chosen:
        shape[name] = draw(st.sampled_from([s for s in (2, 3, 4, 1) if s <= left]))
        left //= shape[name]
    return shape


@st.composite
def specs(draw: st.DrawFn, mesh_shape: dict[str, int], rank: int, axes: tuple[str, ...] | None = None) -> P:
    """A spec for a value of ``rank`` dims: each of ``axes`` (default: all) shards one dim or none; a dim with
    two or more axes is sharded over their tuple (in the drawn order), one axis alone by its name or a 1-tuple."""
    pool = draw(st.permutations(tuple(mesh_shape) if axes is None else axes))
    entries: list[list[str]] = [[] for _ in range(rank)]
    for a in pool:
        d = draw(st.integers(-1, rank - 1)) if rank else -1
        if d >= 0:
            entries[d].append(a)
    out: list[str | tuple[str, ...] | None] = []
    for e in entries:
        if not e:
            out.append(None)
        elif len(e) == 1 and draw(st.booleans()):
            out.append(e[0])
        else:
            out.append(tuple(e))
    return P(*out)


def shapes(min_rank: int = 1, max_rank: int = 4, max_dim: int = 13, min_dim: int = 0) -> st.SearchStrategy:
    """Shapes of ``min_rank``-``max_rank`` dims, each ``min_dim``..``max_dim`` drawn uniformly (zero-size dims
    included where ``min_dim`` is 0, as often as any other size)."""
    sizes = st.sampled_from((*range(max(min_dim, 1), max_dim + 1), *((0,) if min_dim == 0 else ())))
    return st.integers(min_rank, max_rank).flatmap(lambda r: st.tuples(*[sizes for _ in range(r)]))


def rank_coords(mesh_shape: dict[str, int]) -> list[dict[str, int]]:
    """Every device's coordinates, in rank order (row-major, the first axis major)."""
    out = []
    for r in range(math.prod(mesh_shape.values())):
        c, j = {}, r
        for a in reversed(tuple(mesh_shape)):
            j, c[a] = divmod(j, mesh_shape[a])
        out.append({a: c[a] for a in mesh_shape})
    return out


def index_on(axes: tuple[str, ...], mesh_shape: dict[str, int], at: dict[str, int]) -> int:
    """The device at ``at``'s index on the tuple ``axes`` (row-major, the first axis major)."""
    i = 0
    for a in axes:
        i = i * mesh_shape[a] + at[a]
    return i


def group(axes: tuple[str, ...], mesh_shape: dict[str, int], at: dict[str, int]) -> list[int]:
    """The ranks of the devices that share ``at``'s coordinates off ``axes``, in their index order on ``axes``."""
    members = [
        (index_on(axes, mesh_shape, c), r)
        for r, c in enumerate(rank_coords(mesh_shape))
        if all(c[a] == at[a] for a in mesh_shape if a not in axes)
    ]
    return [r for _, r in sorted(members)]


def dim_axes(spec: P, rank: int) -> list[tuple[str, ...]]:
    """The axes (a tuple, maybe empty) sharding each of ``rank`` dims under ``spec``."""
    entries = [*tuple(spec), *([None] * (rank - len(tuple(spec))))]
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


def block(x: torch.Tensor, spec: P, mesh_shape: dict[str, int], at: dict[str, int]) -> torch.Tensor:
    """The block of ``x`` the device at ``at`` holds: ``torch.tensor_split`` dim by dim (a view: differentiable)."""
    for d, axes in enumerate(dim_axes(spec, x.dim())):
        if axes:
            n = math.prod(mesh_shape[a] for a in axes)
            x = torch.tensor_split(x, n, dim=d)[index_on(axes, mesh_shape, at)]
    return x


def blocks(x: torch.Tensor, spec: P, mesh_shape: dict[str, int]) -> list[torch.Tensor]:
    """Every device's block of ``x``, in rank order."""
    return [block(x, spec, mesh_shape, c) for c in rank_coords(mesh_shape)]


def probe(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A random tensor of ``shape`` from ``seed`` (the cotangent of a random linear functional of an output)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
