"""Stage parameters kept in natural layer order, moved to and from a schedule's chunk order inside ``shard_map``.

A model stacks its layers on a leading dim in their natural order (layer 0 first) and shards that dim over
the pipeline axis, ``P("pp", ...)``, so a checkpoint loads into a mesh without ``pp`` (and back) unchanged.
Device ``r`` then holds the contiguous layers ``[r * L/p, (r+1) * L/p)``, cut in ``n_virtual`` natural
chunks: chunk ``j`` is virtual stage ``r * n_virtual + j``. That is what ``run`` needs when ``n_virtual`` is 1
(``gpipe``, ``1f1b``, ``zb``). With more chunks per stage (interleaved, V shapes) the virtual stages a device
runs, ``schedule.placement[r]``, are spread over other devices' slices: :func:`to_chunks` brings each device
its own with ``ppermute``\\ s over the axis (rounds in which every device sends and receives at most one
chunk; chunks already in place stay), and :func:`from_chunks` sends the gradients back the same way. The
cost is the stage parameters' size, once forward (parameters) and once backward (gradients), per step; no
data moves when ``n_virtual`` is 1.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.pipeline import interleaved_1f1b
    >>> sched = interleaved_1f1b(2, 2, 2)  # stage 0 runs virtual stages 0 and 2, stage 1 runs 1 and 3
    >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
    >>> f = fs.shard_map(lambda w: to_chunks(w, sched), mesh=mesh, in_specs=(P("pp"),), out_specs=P("pp"))
    >>> fs.device_get(f(torch.arange(4.0))).flatten().tolist()  # layers in chunk order: [0, 2 | 1, 3]
    [0.0, 2.0, 1.0, 3.0]
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch

from .. import lax
from ..extend import ShardingError, axis_index_int
from .schedules import Schedule

__all__ = ["from_chunks", "to_chunks"]

PyTree = Any
Move = tuple[int, int, int, int]  # (source stage, its chunk slot, destination stage, its chunk slot)


@functools.lru_cache(maxsize=64)
def _plan(placement: tuple[tuple[int, ...], ...]) -> tuple[tuple[Move, ...], tuple[tuple[Move, ...], ...]]:
    """The moves from natural chunk slots to the placement's: those within a stage, and the rounds of the
    others (each a permutation: every stage at most once a source and once a destination)."""
    v = len(placement[0])
    where = {vs: (s, c) for s, row in enumerate(placement) for c, vs in enumerate(row)}
    moves = [(r, j, *where[r * v + j]) for r in range(len(placement)) for j in range(v)]
    local = tuple(m for m in moves if m[0] == m[2])
    rounds: list[list[Move]] = []
    for m in (m for m in moves if m[0] != m[2]):
        for rnd in rounds:
            if all(x[0] != m[0] and x[2] != m[2] for x in rnd):
                rnd.append(m)
                break
        else:
            rounds.append([m])
    return local, tuple(tuple(r) for r in rounds)


def _move(tree: PyTree, schedule: Schedule, axis: str, back: bool, fn: str) -> PyTree:
    p, v = schedule.n_stages, schedule.n_virtual
    if lax.axis_size(axis) != p:
        raise ShardingError(
            f"pipeline.{fn}: mesh axis '{axis}' has size {lax.axis_size(axis)} but the schedule {schedule!r} has "
            f"n_stages={p}; build the schedule for the mesh."
        )
    local, rounds = _plan(schedule.placement)
    if back:  # the inverse: each move reversed
        local = tuple((s, c, r, j) for r, j, s, c in local)
        rounds = tuple(tuple((s, c, r, j) for r, j, s, c in rnd) for rnd in rounds)
    me = axis_index_int(axis)

    def one(path: tuple[Any, ...], leaf: torch.Tensor) -> torch.Tensor:
        if back:
            if leaf.dim() == 0 or leaf.shape[0] != v:
                raise ShardingError(
                    f"pipeline.from_chunks: leaf {'/'.join(map(str, path))} has local shape {tuple(leaf.shape)}; "
                    f"expected a leading dim of n_virtual={v} (to_chunks' output)."
                )
            blocks = list(leaf.unbind(0))  # [v, k, ...] -> v x [k, ...]
        else:
            if leaf.dim() == 0 or leaf.shape[0] % v:
                raise ShardingError(
                    f"pipeline.to_chunks: leaf {'/'.join(map(str, path))} has local shape {tuple(leaf.shape)}; "
                    f"its leading dim (this stage's layers) must be a multiple of n_virtual={v}: use a number "
                    f"of layers divisible by n_stages * n_virtual = {p * v}."
                )
            blocks = list(leaf.reshape(v, leaf.shape[0] // v, *leaf.shape[1:]).unbind(0))  # v x [k, ...]
        out: list[torch.Tensor | None] = [None] * v
        for r, j, _, c in local:
            if r == me:
                out[c] = blocks[j]
        for rnd in rounds:
            send = next((blocks[j] for r, j, _, _ in rnd if r == me), None)
            got = lax.ppermute(  # [k, ...] -> [k, ...]
                torch.zeros_like(blocks[0]) if send is None else send, axis, [(m[0], m[2]) for m in rnd]
            )
            into = next((c for _, _, s, c in rnd if s == me), None)
            if into is not None:
                out[into] = got
        stacked = torch.stack(out)  # v x [k, ...] -> [v, k, ...]
        return stacked.flatten(0, 1) if back else stacked  # back: [v * k, ...], natural order

    return optree.tree_map_with_path(one, tree)


def to_chunks(tree: PyTree, schedule: Schedule, axis: str = "pp") -> PyTree:
    """Inside ``shard_map``: this stage's layers in natural order, ``[L/p, ...]`` per leaf (the local block
    of a ``[L, ...]`` stack with spec ``P(axis, ...)``), as ``run``'s ``stage_params``: ``[v, L/(p v), ...]``
    with chunk ``c`` holding virtual stage ``schedule.placement[stage][c]``.

    Args:
        tree: a pytree of local layer stacks, leading dim ``L/p`` divisible by ``n_virtual``.
        schedule: the schedule ``run`` will execute.
        axis: the pipeline axis.

    Returns:
        The tree with leaves ``[n_virtual, L/(p n_virtual), ...]``.

    Raises:
        ShardingError: the axis size is not ``n_stages``, or a leading dim is not a multiple of ``n_virtual``.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> from funcshard.pipeline import zbv
        >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
        >>> f = fs.shard_map(lambda w: to_chunks(w, zbv(2, 4)), mesh=mesh, in_specs=(P("pp"),), out_specs=P("pp"))
        >>> fs.device_get(f(torch.arange(4.0))).flatten().tolist()  # V: stage 0 runs 0 and 3, stage 1 runs 1, 2
        [0.0, 3.0, 1.0, 2.0]
    """
    return _move(tree, schedule, axis, False, "to_chunks")


def from_chunks(tree: PyTree, schedule: Schedule, axis: str = "pp") -> PyTree:
    """The inverse of :func:`to_chunks`: leaves ``[v, L/(p v), ...]`` in chunk order (``run``'s stage
    gradients) back to natural layer order, ``[L/p, ...]`` per leaf.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> from funcshard.pipeline import interleaved_1f1b
        >>> sched, mesh = interleaved_1f1b(2, 2, 2), fs.make_mesh({"pp": 2}, backend="sim")
        >>> f = fs.shard_map(lambda w: from_chunks(to_chunks(w, sched), sched), mesh=mesh,
        ...                  in_specs=(P("pp"),), out_specs=P("pp"))
        >>> fs.device_get(f(torch.arange(8.0))).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    return _move(tree, schedule, axis, True, "from_chunks")
