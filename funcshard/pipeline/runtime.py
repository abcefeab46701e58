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
    looped = schedule.placement_kind == "looped"
    paired = any(a.overlap for acts in schedule.actions for a in acts)
    if not looped or paired:
        raise ShardingError(
            f"pipeline.run: {schedule!r} "
            + ("places model chunks in a V" if not looped else "has overlapped F&B pairs")
            + "; this runtime runs looped placements (gpipe, 1f1b, interleaved, zb, interleaved_zb, looped_bfs) "
            "so far. Simulate and plot it with schedule.simulate() / schedule.plot(), or pick a looped schedule."
        )
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
    stage = _Stage(schedule, stage_fn, stage_params, microbatches, targets, loss_fn, axis)
    for tick in ticks(schedule):
        stage.tick(tick)
    return stage.result()


class _Stage:
    """One device's stage of a pipeline step: its parameter chunks (detached leaves requiring grad) and their
    accumulated gradients, what it has received, the graphs it keeps for the backward, and its loss sum.
    ``tick`` runs the action the timeline gives it, then takes part in that tick's shifts."""

    def __init__(
        self,
        schedule: Schedule,
        stage_fn: Callable[[PyTree, torch.Tensor], torch.Tensor],
        stage_params: PyTree,
        microbatches: torch.Tensor,
        targets: torch.Tensor | None,
        loss_fn: Callable[..., torch.Tensor],
        axis: str,
    ) -> None:
        ctx = current("pipeline.run")
        self.vma, self.device = ctx.check_vma, ctx.device
        self.schedule, self.stage_fn, self.loss_fn, self.axis = schedule, stage_fn, loss_fn, axis
        self.microbatches, self.targets = microbatches, targets
        self.p, self.m = schedule.n_stages, schedule.n_microbatches
        self.last = self.p * schedule.n_virtual - 1
        self.me = lax.axis_index_int(axis)
        # the axes every activation / activation gradient varies over (vma tags of what ppermute delivers)
        self.act_axes = get_vma(microbatches) | frozenset([axis]) if self.vma else frozenset()
        self.tgt_axes = get_vma(targets) if (self.vma and targets is not None) else frozenset()
        dtype = microbatches.dtype
        self.loss_sum = torch.zeros(
            (), dtype=dtype if dtype.is_floating_point else torch.get_default_dtype(), device=microbatches.device
        )
        self.leaves, self.treedef = optree.tree_flatten(stage_params)
        v = schedule.n_virtual
        self.chunk_leaves = [[leaf.detach()[c].requires_grad_(True) for leaf in self.leaves] for c in range(v)]
        self.chunk_params = [optree.tree_unflatten(self.treedef, ls) for ls in self.chunk_leaves]
        self.grad_acc: list[list[torch.Tensor | None]] = [[None] * len(self.leaves) for _ in range(v)]
        self.received: dict[str, dict[tuple[int, int], torch.Tensor]] = {"F": {}, "B": {}}  # (mb, vs) -> value
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, vs) -> (x, y or loss)
        self.pending_w: dict[tuple[int, int], torch.Tensor] = {}  # (mb, vs) -> grad of y, kept from B for W

    def tagged(self, t: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
        return set_vma(t, axes) if self.vma else t

    def zeros(self) -> torch.Tensor:
        mb = self.microbatches
        return self.tagged(torch.zeros(mb.shape[1:], dtype=mb.dtype, device=mb.device), self.act_axes)

    def tick(self, tick: Tick) -> None:
        """Run this stage's action of ``tick`` (if any), then the tick's forward and backward shifts."""
        a = tick.actions[self.me]
        sent: torch.Tensor | None = None
        if a is not None:
            vs = a.chunk * self.p + self.me
            if a.kind == "F":
                sent = self.forward(a, vs)
            elif a.kind == "B":
                sent = self.backward(a, vs)
            else:
                self.weight(a, vs)
        for kind, pairs, step in (("F", tick.fwd, 1), ("B", tick.bwd, -1)):
            if not pairs:  # nobody sends this way at this tick: every device skips the shift
                continue
            buf = sent if (a is not None and a.kind == kind and sent is not None) else self.zeros()
            got = lax.ppermute(self.tagged(buf, self.act_axes), self.axis, pairs)  # [*mb_shape] -> [*mb_shape]
            src = (self.me - step) % self.p
            sa = tick.actions[src]
            if (src, self.me) in pairs and sa is not None:
                self.received[kind][(sa.microbatch, sa.chunk * self.p + src + step)] = self.tagged(got, self.act_axes)

    def forward(self, a: Action, vs: int) -> torch.Tensor | None:
        """``F``: run the chunk on the received (or first) activation; keep the graph; the output to send."""
        src = self.microbatches[a.microbatch] if vs == 0 else self.received["F"].pop((a.microbatch, vs))
        x = src.detach().requires_grad_(vs > 0)
        with torch.enable_grad():
            y = self.checked(self.stage_fn(self.chunk_params[a.chunk], x), x, vs)
            if vs == self.last:
                tgt = () if self.targets is None else (self.targets[a.microbatch],)
                loss = self.loss_fn(y, *tgt) / self.m
                self.loss_sum = self.loss_sum + loss.detach().to(self.loss_sum.dtype)
                self.saved[(a.microbatch, vs)] = (x, loss)
                return None
        self.saved[(a.microbatch, vs)] = (x, y)
        return y.detach()

    def checked(self, y: Any, x: torch.Tensor, vs: int) -> torch.Tensor:
        """``stage_fn``'s output, checked to keep the activation's shape, dtype and varying axes."""
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
            found = (tuple(y.shape), y.dtype) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ShardingError(
                f"pipeline.run: stage_fn on virtual stage {vs} returned {found} for an input of "
                f"{(tuple(x.shape), x.dtype)}; every stage must keep the activation's shape and dtype "
                f"(that of one microbatch). Move shape-changing layers outside the pipeline."
            )
        if not self.vma:
            return y
        extra = get_vma(y) - self.act_axes
        if extra:
            raise ShardingError(
                f"pipeline.run: stage_fn's output on virtual stage {vs} varies over {sorted(extra)}, "
                f"which the microbatches do not (they vary over {sorted(self.act_axes - {self.axis})}); reduce "
                f"it inside stage_fn (fs.psum / fs.pmean) or pass microbatches varying over them."
            )
        return pvary_to(y, self.act_axes, self.device)  # invariant parts: their cotangent is psum'd

    def backward(self, a: Action, vs: int) -> torch.Tensor | None:
        """``B``: the input gradient (to send) and, without ``W`` actions, the parameter gradients."""
        key = (a.microbatch, vs)
        x, out = self.saved[key]
        g_out = None if vs == self.last else self.received["B"].pop(key)
        params = self.chunk_leaves[a.chunk]
        split = self.schedule.is_split(self.me, a.microbatch, a.chunk)  # a W follows: input gradient only
        wrt = ([x] if vs > 0 else []) + ([] if split else params)
        gs = torch.autograd.grad(out, wrt, g_out, retain_graph=split, allow_unused=True) if wrt else ()
        if split:
            self.pending_w[key] = g_out if g_out is not None else torch.ones_like(out)
        else:
            del self.saved[key]
            self.accumulate(a.chunk, gs[1:] if vs > 0 else gs)
        if vs == 0:
            return None
        return self.zeros() if gs[0] is None else gs[0].detach()

    def weight(self, a: Action, vs: int) -> None:
        """``W``: the parameter gradients from the graph ``B`` kept."""
        key = (a.microbatch, vs)
        _, out = self.saved.pop(key)
        gs = torch.autograd.grad(out, self.chunk_leaves[a.chunk], self.pending_w.pop(key), allow_unused=True)
        self.accumulate(a.chunk, gs)

    def accumulate(self, c: int, gs: tuple[torch.Tensor | None, ...]) -> None:
        for i, g in enumerate(gs):
            if g is not None:
                acc = self.grad_acc[c][i]
                self.grad_acc[c][i] = g if acc is None else acc + g

    def result(self) -> tuple[torch.Tensor, PyTree]:
        """The mean loss (invariant over the axis) and the gradients of this stage's parameters."""
        # loss: the last stage's sum over microbatches, others 0; the psum makes it invariant over axis
        loss_axes = self.act_axes | self.tgt_axes | (get_vma(self.loss_sum) if self.vma else frozenset())
        loss = lax.psum(self.tagged(self.loss_sum, loss_axes), self.axis)  # [] -> [], invariant over axis
        out_leaves = []
        for i, leaf in enumerate(self.leaves):
            per_chunk = [
                torch.zeros_like(self.chunk_leaves[c][i]) if g is None else g
                for c, g in enumerate(acc[i] for acc in self.grad_acc)
            ]
            out_leaves.append(torch.stack(per_chunk).to(leaf.dtype))  # v x [*s] -> [v, *s]
        return loss, optree.tree_unflatten(self.treedef, out_leaves)
