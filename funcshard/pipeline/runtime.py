"""Execute a pipeline ``Schedule`` inside ``shard_map``: SPMD lock-step ticks, one ring shift per direction.

``run`` turns a schedule's simulated timeline (unit costs ``F = B = W = 1``) into integer ticks. At each tick
every device executes the action its stage starts at that tick (if any); then every device on the pipeline
axis takes part in at most two ``ppermute``\\ s: a forward shift ``s -> s+1`` carrying the activations the
``F`` actions of this tick produced, and a backward shift ``s -> s-1`` carrying the input gradients the ``B``
actions produced. The timeline is the same on every device, so each one knows what it receives and when,
a shift nobody sends on is skipped by all devices together, and there is nothing that could deadlock.
An action consuming data produced at tick ``t`` starts at tick ``t + 1`` or later (the simulator's
dependency rule), so the data has always arrived.

Example:
    >>> import torch, funcshard as fs
    >>> from funcshard import P
    >>> from funcshard.pipeline import one_f_one_b, run
    >>> mesh = fs.make_mesh({"pp": 2}, backend="sim")
    >>> sched = one_f_one_b(2, 4)
    >>> w = torch.ones(2, 1, 3, 3) * 0.1  # [n_stages * n_virtual, 1 layer, d, d]
    >>> def step(w, xs, ts):
    ...     return run(sched, lambda p, x: x + x @ p[0], w, xs, targets=ts,
    ...                loss_fn=lambda y, t: ((y - t) ** 2).mean())
    >>> f = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")))
    >>> loss, grads = f(w, torch.ones(4, 2, 3), torch.zeros(4, 2, 3))
    >>> round(fs.device_get(loss).item(), 4), tuple(grads.shape)
    (2.8561, (2, 1, 3, 3))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from .. import lax
from .._context import current
from .._errors import ShardingError
from .._vma import get_vma, pvary_to, set_vma
from .schedules import Action, Schedule

__all__ = ["Tick", "run", "ticks", "virtual_stage_order"]

PyTree = Any
UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "comm": 0.0}


@dataclass(frozen=True)
class Tick:
    """What happens at one tick of ``run``'s lock-step loop, the same on every device.

    Attributes:
        actions: ``actions[stage]`` is the action that stage starts at this tick, or None.
        fwd: ``(src, dst)`` stage pairs of the forward shift (an ``F`` not on the last virtual stage).
        bwd: ``(src, dst)`` stage pairs of the backward shift (a ``B`` not on virtual stage 0).

    Example:
        >>> from funcshard.pipeline import one_f_one_b
        >>> ticks(one_f_one_b(2, 2))[0]  # stage 0 starts F0 and sends it to stage 1
        Tick(actions=(Action(kind='F', microbatch=0, chunk=0), None), fwd=((0, 1),), bwd=())
    """

    actions: tuple[Action | None, ...]
    fwd: tuple[tuple[int, int], ...]
    bwd: tuple[tuple[int, int], ...]


def ticks(schedule: Schedule) -> list[Tick]:
    """The schedule as lock-step ticks: ``schedule.simulate`` with unit costs, cut at integer times.

    ``len(ticks(s))`` is the makespan; ``run`` makes one forward ``ppermute`` per tick with a non-empty
    ``fwd`` and one backward ``ppermute`` per tick with a non-empty ``bwd``.

    Example:
        >>> from funcshard.pipeline import gpipe
        >>> ts = ticks(gpipe(2, 2))
        >>> len(ts), sum(bool(t.fwd) for t in ts), sum(bool(t.bwd) for t in ts)
        (6, 2, 2)
    """
    p, last = schedule.n_stages, schedule.n_stages * schedule.n_virtual - 1
    sim = schedule.simulate(dict(UNIT_COSTS))
    n = round(sim.makespan)
    acts: list[list[Action | None]] = [[None] * p for _ in range(n)]
    for s, row in enumerate(sim.timeline):
        for start, _, a in row:
            acts[round(start)][s] = a
    out = []
    for row in acts:
        fwd, bwd = [], []
        for s, a in enumerate(row):
            if a is None:
                continue
            vs = a.chunk * p + s
            if a.kind == "F" and vs < last:
                fwd.append((s, (s + 1) % p))
            elif a.kind == "B" and vs > 0:
                bwd.append((s, (s - 1) % p))
        out.append(Tick(tuple(row), tuple(fwd), tuple(bwd)))
    return out


def virtual_stage_order(n_stages: int, n_virtual: int) -> list[int]:
    """The virtual stage (layer chunk) held at each index of the globally stacked stage parameters.

    ``run`` takes per device ``stage_params`` with a leading dim of ``n_virtual``; globally (spec
    ``P("pp", ...)``) they are stacked ``[n_stages * n_virtual, ...]``, so index ``s * n_virtual + c``
    is chunk ``c`` of stage ``s``, which is virtual stage ``c * n_stages + s``. Stack your per-layer
    parameters as ``torch.stack([layers[i] for i in virtual_stage_order(p, v)])``.

    Example:
        >>> virtual_stage_order(2, 2)  # stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
        [0, 2, 1, 3]
    """
    return [(g % n_virtual) * n_stages + g // n_virtual for g in range(n_stages * n_virtual)]


def _check(
    schedule: Schedule, stage_params: PyTree, microbatches: torch.Tensor, targets: torch.Tensor | None, axis: str
) -> None:
    n = lax.axis_size(axis)
    if n != schedule.n_stages:
        raise ShardingError(
            f"pipeline.run: mesh axis '{axis}' has size {n} but the schedule {schedule!r} has "
            f"n_stages={schedule.n_stages}; build the schedule with n_stages={n} or use a mesh with "
            f"{axis}={schedule.n_stages}."
        )
    paths, leaves, _ = optree.tree_flatten_with_path(stage_params)
    if not leaves:
        raise ShardingError("pipeline.run: stage_params has no tensor leaves; pass the stage's parameters.")
    for path, leaf in zip(paths, leaves, strict=True):
        where = "/".join(map(str, path)) or "<root>"
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != schedule.n_virtual:
            found = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ShardingError(
                f"pipeline.run: stage_params leaf {where} has local shape {found}; expected a leading dim of "
                f"n_virtual={schedule.n_virtual} (the chunks of this stage). Stack the parameters globally as "
                f"[n_stages * n_virtual, ...] = [{schedule.n_stages * schedule.n_virtual}, ...] with spec "
                f"P('{axis}', ...) (see virtual_stage_order)."
            )
    for name, t in (("microbatches", microbatches), ("targets", targets)):
        if t is None and name == "targets":
            continue
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != schedule.n_microbatches:
            found = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShardingError(
                f"pipeline.run: {name} has local shape {found}; expected a leading dim of "
                f"n_microbatches={schedule.n_microbatches}. Reshape the batch to "
                f"[{schedule.n_microbatches}, batch / {schedule.n_microbatches}, ...]."
            )


def run(
    schedule: Schedule,
    stage_fn: Callable[[PyTree, torch.Tensor], torch.Tensor],
    stage_params: PyTree,
    microbatches: torch.Tensor,
    *,
    loss_fn: Callable[..., torch.Tensor],
    targets: torch.Tensor | None = None,
    axis: str = "pp",
) -> tuple[torch.Tensor, PyTree]:
    """Run one pipelined forward + backward step of ``schedule`` inside ``shard_map``; return loss and grads.

    Call it inside ``fs.shard_map`` over a mesh whose axis ``axis`` has ``schedule.n_stages`` devices.
    Device ``s`` on ``axis`` runs stage ``s``'s actions; its chunk ``c`` is virtual stage
    ``c * n_stages + s``. The model is ``loss_fn(f_{V-1}(... f_1(f_0(x)) ...), target)`` with ``f_v`` =
    ``stage_fn(params of virtual stage v, .)`` and ``V = n_stages * n_virtual``.

    Activations and their gradients travel between stages on ``axis`` with ``fs.ppermute`` on detached
    tensors; the gradients are accumulated here (no autograd across stages), so call ``run`` directly, not
    under ``torch.autograd.grad``. Other mesh axes (dp, tp, ...) work inside ``stage_fn`` and ``loss_fn``
    as usual (collectives over them happen at the same tick on devices of the same stage).

    Args:
        schedule: a validated ``Schedule`` (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``,
            ``zero_bubble_h1``, ...). With ``W`` actions, ``B`` computes the input gradient only (keeping
            the graph) and ``W`` the parameter gradients from the same graph.
        stage_fn: ``stage_fn(params_chunk, x) -> y``, where ``params_chunk`` is ``stage_params`` with the
            leading dim indexed. ``y`` must have the shape and dtype of ``x`` (one activation shape for all
            stages: put embeddings / heads in the first / last chunk only if they keep the shape, or outside).
        stage_params: this device's parameters, a pytree of tensors with a leading dim of ``n_virtual``.
            Globally ``[n_stages * n_virtual, ...]`` with spec ``P(axis, ...)``: global index
            ``s * n_virtual + c`` holds virtual stage ``c * n_stages + s`` (see ``virtual_stage_order``).
        microbatches: ``[n_microbatches, ...]`` inputs, the same on every stage (only virtual stage 0
            reads them).
        loss_fn: ``loss_fn(y, target) -> scalar`` (``loss_fn(y)`` when ``targets`` is None), applied to the
            last virtual stage's output; the returned loss is its mean over microbatches.
        targets: ``[n_microbatches, ...]`` or None.
        axis: the pipeline mesh axis.

    Returns:
        ``(loss, grads)``: the mean of ``loss_fn`` over microbatches, invariant over ``axis`` (a 0-dim
        tensor), and the gradient of that loss w.r.t. ``stage_params`` (same structure and shapes; varies
        over ``axis``, return it with spec ``P(axis, ...)``).

    Raises:
        ShardingError: the size of ``axis`` differs from ``n_stages``, a parameter leaf's leading dim from
            ``n_virtual``, ``microbatches`` / ``targets``' leading dim from ``n_microbatches``, or
            ``stage_fn`` changes the activation's shape or dtype.

    Example:
        >>> # layers[i] = (w1, w2): stack in pipeline order, shard over pp
        >>> # order = virtual_stage_order(p, v); W1 = torch.stack([w1s[i] for i in order])
        >>> # def step(params, xs, ts):  # params: ([v, d, h], [v, h, d]) per device
        >>> #     return run(interleaved_1f1b(p, m, v), layer, params, xs, targets=ts, loss_fn=mse)
        >>> # loss, grads = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()),
        >>> #                            out_specs=(P(), P("pp")))(params, xs, ts)
    """
    _check(schedule, stage_params, microbatches, targets, axis)
    ctx = current("pipeline.run")
    vma = ctx.check_vma
    p, v, m = schedule.n_stages, schedule.n_virtual, schedule.n_microbatches
    last = p * v - 1
    split = schedule.split_backward
    me = lax.axis_index_int(axis)
    timeline = ticks(schedule)

    # the axes every activation / activation gradient varies over (vma tags of what ppermute delivers)
    act_axes = get_vma(microbatches) | frozenset([axis]) if vma else frozenset()
    tgt_axes = get_vma(targets) if (vma and targets is not None) else frozenset()
    shape, dtype = microbatches.shape[1:], microbatches.dtype
    loss_dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()

    def tagged(t: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
        return set_vma(t, axes) if vma else t

    def zeros() -> torch.Tensor:
        return tagged(torch.zeros(shape, dtype=dtype, device=microbatches.device), act_axes)

    # per chunk: detached leaf parameters that require grad, and their accumulated gradients
    leaves, treedef = optree.tree_flatten(stage_params)
    chunk_leaves = [[leaf.detach()[c].requires_grad_(True) for leaf in leaves] for c in range(v)]
    chunk_params = [optree.tree_unflatten(treedef, ls) for ls in chunk_leaves]
    grad_acc: list[list[torch.Tensor | None]] = [[None] * len(leaves) for _ in range(v)]

    acts_in: dict[tuple[int, int], torch.Tensor] = {}  # (mb, vs) -> received activation
    grads_in: dict[tuple[int, int], torch.Tensor] = {}  # (mb, vs) -> received gradient of the output
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, vs) -> (x leaf, y or loss)
    pending_w: dict[tuple[int, int], torch.Tensor] = {}  # (mb, vs) -> grad of y, kept from B for W
    loss_sum = torch.zeros((), dtype=loss_dtype, device=microbatches.device)

    def accumulate(c: int, gs: tuple[torch.Tensor | None, ...]) -> None:
        for i, g in enumerate(gs):
            if g is not None:
                acc = grad_acc[c][i]
                grad_acc[c][i] = g if acc is None else acc + g

    def forward(a: Action, vs: int) -> torch.Tensor | None:
        nonlocal loss_sum
        src = microbatches[a.microbatch] if vs == 0 else acts_in.pop((a.microbatch, vs))
        x = src.detach().requires_grad_(vs > 0)
        with torch.enable_grad():
            y = stage_fn(chunk_params[a.chunk], x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
                found = (tuple(y.shape), y.dtype) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ShardingError(
                    f"pipeline.run: stage_fn on virtual stage {vs} returned {found} for an input of "
                    f"{(tuple(x.shape), x.dtype)}; every stage must keep the activation's shape and dtype "
                    f"(that of one microbatch). Move shape-changing layers outside the pipeline."
                )
            if vma:
                extra = get_vma(y) - act_axes
                if extra:
                    raise ShardingError(
                        f"pipeline.run: stage_fn's output on virtual stage {vs} varies over {sorted(extra)}, "
                        f"which the microbatches do not (they vary over {sorted(act_axes - {axis})}); reduce "
                        f"it inside stage_fn (fs.psum / fs.pmean) or pass microbatches varying over them."
                    )
                y = pvary_to(y, act_axes, ctx.device)  # invariant parts: their cotangent is psum'd
            if vs == last:
                tgt = () if targets is None else (targets[a.microbatch],)
                loss = loss_fn(y, *tgt) / m
                loss_sum = loss_sum + loss.detach().to(loss_dtype)
                saved[(a.microbatch, vs)] = (x, loss)
                return None
        saved[(a.microbatch, vs)] = (x, y)
        return y.detach()

    def backward(a: Action, vs: int) -> torch.Tensor | None:
        key = (a.microbatch, vs)
        x, out = saved[key]
        g_out = None if vs == last else grads_in.pop(key)
        params = chunk_leaves[a.chunk]
        wrt = ([x] if vs > 0 else []) + ([] if split else params)
        if wrt:
            gs = torch.autograd.grad(out, wrt, grad_outputs=g_out, retain_graph=split, allow_unused=True)
        else:
            gs = ()
        if split:
            pending_w[key] = g_out if g_out is not None else torch.ones_like(out)
        else:
            del saved[key]
            accumulate(a.chunk, gs[1:] if vs > 0 else gs)
        if vs == 0:
            return None
        gx = gs[0]
        return zeros() if gx is None else gx.detach()

    def weight(a: Action, vs: int) -> None:
        key = (a.microbatch, vs)
        _, out = saved.pop(key)
        g_out = pending_w.pop(key)
        gs = torch.autograd.grad(out, chunk_leaves[a.chunk], grad_outputs=g_out, allow_unused=True)
        accumulate(a.chunk, gs)

    for tick in timeline:
        a = tick.actions[me]
        sent: torch.Tensor | None = None
        if a is not None:
            vs = a.chunk * p + me
            if a.kind == "F":
                sent = forward(a, vs)
            elif a.kind == "B":
                sent = backward(a, vs)
            else:
                weight(a, vs)
        for kind, pairs, store, step in (("F", tick.fwd, acts_in, 1), ("B", tick.bwd, grads_in, -1)):
            if not pairs:  # nobody sends this way at this tick: every device skips the shift
                continue
            buf = sent if (a is not None and a.kind == kind and sent is not None) else zeros()
            got = lax.ppermute(tagged(buf, act_axes), axis, pairs)  # [*mb_shape] -> [*mb_shape]
            src = (me - step) % p
            sa = tick.actions[src]
            if (src, me) in pairs and sa is not None:
                store[(sa.microbatch, sa.chunk * p + src + step)] = tagged(got, act_axes)

    # loss: the last stage's sum over microbatches, others 0; the psum makes it invariant over axis
    loss_axes = act_axes | tgt_axes | (get_vma(loss_sum) if vma else frozenset())
    loss = lax.psum(tagged(loss_sum, loss_axes), axis)  # [] -> [], invariant over axis

    out_leaves = []
    for i, leaf in enumerate(leaves):
        per_chunk = []
        for c in range(v):
            g = grad_acc[c][i]
            per_chunk.append(torch.zeros_like(chunk_leaves[c][i]) if g is None else g)
        out_leaves.append(torch.stack(per_chunk).to(leaf.dtype))  # v x [*s] -> [v, *s]
    return loss, optree.tree_unflatten(treedef, out_leaves)
