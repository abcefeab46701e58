"""Stage parameters kept in natural layer order, moved to and from a schedule's chunk order inside ``shard_map``.

A model stacks its layers on a leading dim in their natural order (layer 0 first) and shards that dim over
the pipeline axis, ``P("pp", ...)``, so a checkpoint loads into a mesh without ``pp`` (and back) unchanged.
Device ``r`` then holds the contiguous block ``torch.tensor_split(range(L), p)[r]`` of the ``L`` layers. The
virtual stages split the layers the same way, ``torch.tensor_split(range(L), p * v)`` in virtual-stage order
(earlier virtual stages one layer more when ``p v`` does not divide ``L``, as DTorch assigns them; a virtual
stage may hold none, and is then the identity): :func:`chunk_layers`. With ``n_virtual`` 1 (``gpipe``,
``1f1b``, ``zb``) device ``r``'s block is its virtual stage. With more chunks per stage (interleaved, V shapes)
the virtual stages a device runs, ``schedule.placement[r]``, are spread over other devices' blocks:
:func:`to_chunks` brings each device its own with ``ppermute``\\ s over the axis (rounds in which every
device sends and receives at most one run of layers; layers already in place stay), and :func:`from_chunks`
sends the gradients back the same way. The cost is the stage parameters' size, once forward (parameters) and
once backward (gradients), per step; no data moves when ``n_virtual`` is 1.

Two forms: without ``n_layers`` every chunk has ``L/(p v)`` layers and the chunks are stacked, ``[v, L/(p v),
...]`` (``run``'s default form); with ``n_layers=L`` (any ``L``) this stage's chunks are concatenated in chunk
order, ``[sum of their layer counts, ...]``, the form ``run(..., n_layers=L)`` takes.

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

__all__ = ["chunk_layers", "from_chunks", "to_chunks"]

PyTree = Any
# a run of layers moved: (source stage, its first row, destination stage, its first row, number of rows)
Segment = tuple[int, int, int, int, int]


def _bounds(n: int, parts: int) -> list[int]:
    """The first index of each of ``torch.tensor_split``'s ``parts`` blocks of ``n`` rows, and ``n``."""
    return [k * (n // parts) + min(k, n % parts) for k in range(parts + 1)]


def chunk_layers(schedule: Schedule, n_layers: int) -> tuple[tuple[int, ...], ...]:
    """The number of layers of each stage's chunks, ``[stage][chunk]``: ``n_layers`` split over the
    ``n_stages * n_virtual`` virtual stages as ``torch.tensor_split`` splits it, in virtual-stage order (earlier
    virtual stages one layer more; a virtual stage may get none), chunk ``c`` of stage ``s`` holding virtual
    stage ``schedule.placement[s][c]``.

    Example:
        >>> from funcshard.pipeline import interleaved_1f1b, zbv
        >>> chunk_layers(interleaved_1f1b(2, 4, 2), 7)  # virtual stages 0..3 get 2, 2, 2, 1 layers
        ((2, 2), (2, 1))
        >>> chunk_layers(zbv(4, 8), 7)  # V: stage 0 holds virtual stages 0 and 7 (the empty one)
        ((1, 0), (1, 1), (1, 1), (1, 1))
    """
    if n_layers < 0:
        raise ShardingError(f"pipeline.chunk_layers: n_layers={n_layers}; expected a count >= 0.")
    b = _bounds(n_layers, schedule.n_virtual_stages)
    return tuple(tuple(b[vs + 1] - b[vs] for vs in row) for row in schedule.placement)


@functools.lru_cache(maxsize=64)
def _plan(
    placement: tuple[tuple[int, ...], ...], n_layers: int
) -> tuple[tuple[Segment, ...], tuple[tuple[Segment, ...], ...]]:
    """The runs of layers from each stage's natural block (``tensor_split`` over the stages) to its chunks
    (``tensor_split`` over the virtual stages, in chunk order): those within a stage, and the rounds of the
    others (each a permutation: every stage at most once a source and once a destination)."""
    p, v = len(placement), len(placement[0])
    own, vst = _bounds(n_layers, p), _bounds(n_layers, p * v)
    segments = []
    for r, row in enumerate(placement):
        at = 0  # this chunk's first row in stage r's chunk order
        for vs in row:
            lo, hi = vst[vs], vst[vs + 1]
            for q in range(p):
                a, b = max(lo, own[q]), min(hi, own[q + 1])
                if a < b:
                    segments.append((q, a - own[q], r, at + a - lo, b - a))
            at += hi - lo
    local = tuple(m for m in segments if m[0] == m[2])
    rounds: list[list[Segment]] = []
    for m in (m for m in segments if m[0] != m[2]):
        for rnd in rounds:
            if all(x[0] != m[0] and x[2] != m[2] for x in rnd):
                rnd.append(m)
                break
        else:
            rounds.append([m])
    return local, tuple(tuple(r) for r in rounds)


def _rows(leaf: torch.Tensor, start: int, n: int, k: int) -> torch.Tensor:
    """Rows ``[start, start + n)`` of ``leaf``, zero-padded to ``k`` rows: ``[k, ...]``."""
    block = leaf[start : start + n]  # [n, ...]
    if n == k:
        return block
    return torch.cat([block, block.new_zeros(k - n, *leaf.shape[1:])])  # [n, ...] -> [k, ...]


def _move_leaf(leaf: torch.Tensor, plan: tuple[Any, Any], me: int, axis: str) -> torch.Tensor:
    """One leaf's rows moved by ``plan`` (local runs and rounds); this stage's received rows in order."""
    local, rounds = plan
    parts = [(b, leaf[a : a + n]) for q, a, _, b, n in local if q == me]
    for rnd in rounds:
        k = max(m[4] for m in rnd)
        send = next(((a, n) for q, a, _, _, n in rnd if q == me), None)
        block = leaf.new_zeros(k, *leaf.shape[1:]) if send is None else _rows(leaf, send[0], send[1], k)
        got = lax.ppermute(block, axis, [(m[0], m[2]) for m in rnd])  # [k, ...] -> [k, ...]
        into = next(((b, n) for _, _, r, b, n in rnd if r == me), None)
        if into is not None:
            parts.append((into[0], got[: into[1]]))
    if not parts:
        return leaf[:0]  # [0, ...]: this stage holds no layer
    parts.sort(key=lambda t: t[0])
    return parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts])  # -> [rows, ...]


def _check_axis(schedule: Schedule, axis: str, fn: str) -> None:
    """The pipeline axis has the schedule's number of stages."""
    if lax.axis_size(axis) != schedule.n_stages:
        raise ShardingError(
            f"pipeline.{fn}: mesh axis '{axis}' has size {lax.axis_size(axis)} but the schedule {schedule!r} has "
            f"n_stages={schedule.n_stages}; build the schedule for the mesh."
        )


def _move(tree: PyTree, schedule: Schedule, axis: str, back: bool, fn: str, n_layers: int) -> PyTree:
    """``tree``'s leaves moved from natural order to chunk order (or ``back``), ``n_layers`` in all."""
    p = schedule.n_stages
    _check_axis(schedule, axis, fn)
    local, rounds = _plan(schedule.placement, n_layers)
    if back:  # the inverse: each run reversed
        local = tuple((r, b, q, a, n) for q, a, r, b, n in local)
        rounds = tuple(tuple((r, b, q, a, n) for q, a, r, b, n in rnd) for rnd in rounds)
    me = axis_index_int(axis)
    own = _bounds(n_layers, p)
    want = sum(chunk_layers(schedule, n_layers)[me]) if back else own[me + 1] - own[me]
    what = "this stage's chunks in chunk order" if back else "this stage's tensor_split block of the layers"

    def one(path: tuple[Any, ...], leaf: torch.Tensor) -> torch.Tensor:
        if leaf.dim() == 0 or leaf.shape[0] != want:
            raise ShardingError(
                f"pipeline.{fn}: leaf {'/'.join(map(str, path)) or '<root>'} has local shape {tuple(leaf.shape)} "
                f"on stage {me}; expected a leading dim of {want} ({what}, n_layers={n_layers} on "
                f"{p} stages x {schedule.n_virtual} chunk(s)): pass the n_layers the stack holds."
            )
        return _move_leaf(leaf, (local, rounds), me, axis)

    return optree.tree_map_with_path(one, tree)


def _stacked(tree: PyTree, schedule: Schedule, axis: str, back: bool) -> PyTree:
    """The stacked form (no ``n_layers``): every chunk ``L/(p v)`` layers, chunks on a leading dim."""
    v = schedule.n_virtual
    fn = "from_chunks" if back else "to_chunks"
    _check_axis(schedule, axis, fn)

    def rows(path: tuple[Any, ...], leaf: torch.Tensor) -> int:
        where = "/".join(map(str, path)) or "<root>"
        if back and (leaf.dim() < 2 or leaf.shape[0] != v):
            raise ShardingError(
                f"pipeline.from_chunks: leaf {where} has local shape {tuple(leaf.shape)}; expected a leading dim "
                f"of n_virtual={v} (to_chunks' output)."
            )
        if not back and (leaf.dim() == 0 or leaf.shape[0] % v):
            raise ShardingError(
                f"pipeline.to_chunks: leaf {where} has local shape {tuple(leaf.shape)}; its leading dim (this "
                f"stage's layers) must be a multiple of n_virtual={v}: use a number of layers divisible by "
                f"n_stages * n_virtual = {schedule.n_stages * v}, or pass n_layers= for chunks of unequal sizes."
            )
        return leaf.shape[0] * leaf.shape[1] if back else leaf.shape[0]

    n = optree.tree_map_with_path(rows, tree)
    if v == 1:  # each stage's block is its one chunk: no move
        return optree.tree_map(lambda t: t.flatten(0, 1) if back else t.unsqueeze(0), tree)
    if back:
        flat = optree.tree_map(lambda t: t.flatten(0, 1), tree)  # [v, k, ...] -> [v k, ...]
        return optree.tree_map(lambda t, k: _move(t, schedule, axis, True, fn, schedule.n_stages * k), flat, n)
    moved = optree.tree_map(lambda t, k: _move(t, schedule, axis, False, fn, schedule.n_stages * k), tree, n)
    return optree.tree_map(lambda t: t.reshape(v, t.shape[0] // v, *t.shape[1:]), moved)  # -> [v, k, ...]


def to_chunks(tree: PyTree, schedule: Schedule, axis: str = "pp", *, n_layers: int | None = None) -> PyTree:
    """Inside ``shard_map``: this stage's layers in natural order (the local block of a ``[L, ...]`` stack with
    spec ``P(axis, ...)``) as ``run``'s ``stage_params``, chunk ``c`` holding virtual stage
    ``schedule.placement[stage][c]``.

    Args:
        tree: a pytree of local layer stacks: ``[L/p, ...]`` per leaf, or, with ``n_layers``, stage ``r``'s
            block of ``torch.tensor_split`` over the stages.
        schedule: the schedule ``run`` will execute.
        axis: the pipeline axis.
        n_layers: the stack's total number of layers ``L``, any count: the virtual stages take
            ``torch.tensor_split``'s blocks of them (:func:`chunk_layers`) and the leaves come back as this
            stage's chunks concatenated in chunk order, ``[sum of its chunks' layers, ...]``, for
            ``run(..., n_layers=L)``. Without it (``L`` divisible by ``p v``): ``[v, L/(p v), ...]``.

    Returns:
        The tree with leaves ``[n_virtual, L/(p n_virtual), ...]``, or with ``n_layers`` ``[this stage's
        layers, ...]`` in chunk order.

    Raises:
        ShardingError: the axis size is not ``n_stages``, or a leading dim is not a multiple of ``n_virtual``
            (without ``n_layers``) or not this stage's block of ``n_layers``.

    Example:
        >>> import torch, funcshard as fs
        >>> from funcshard import P
        >>> from funcshard.pipeline import zbv
        >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
        >>> f = fs.shard_map(lambda w: to_chunks(w, zbv(2, 4)), mesh=mesh, in_specs=(P("pp"),), out_specs=P("pp"))
        >>> fs.device_get(f(torch.arange(4.0))).flatten().tolist()  # V: stage 0 runs 0 and 3, stage 1 runs 1, 2
        [0.0, 3.0, 1.0, 2.0]
        >>> g = fs.shard_map(lambda w: to_chunks(w, zbv(2, 4), n_layers=5), mesh=mesh, in_specs=(P("pp"),),
        ...                  out_specs=P("pp"))  # virtual stages hold [0, 1], [2], [3], [4]
        >>> fs.device_get(g(torch.arange(5.0))).tolist()  # stage 0: [0, 1 | 4], stage 1: [2 | 3]
        [0.0, 1.0, 4.0, 2.0, 3.0]
    """
    if n_layers is None:
        return _stacked(tree, schedule, axis, False)
    return _move(tree, schedule, axis, False, "to_chunks", n_layers)


def from_chunks(tree: PyTree, schedule: Schedule, axis: str = "pp", *, n_layers: int | None = None) -> PyTree:
    """The inverse of :func:`to_chunks`: leaves in chunk order (``run``'s stage gradients), ``[v, L/(p v), ...]``
    or with ``n_layers`` ``[this stage's layers, ...]``, back to natural layer order (this stage's block).

    Args:
        tree: a pytree in :func:`to_chunks`' output form.
        schedule: the schedule ``run`` executed.
        axis: the pipeline axis.
        n_layers: the stack's total number of layers, as given to :func:`to_chunks`.

    Returns:
        The tree with leaves ``[L/p, ...]`` (with ``n_layers``: the stage's ``torch.tensor_split`` block).

    Raises:
        ShardingError: the axis size is not ``n_stages``, or a leaf's leading dim is not that of
            :func:`to_chunks`' output.

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
    if n_layers is None:
        return _stacked(tree, schedule, axis, True)
    return _move(tree, schedule, axis, True, "from_chunks", n_layers)
