"""Execute a pipeline ``Schedule`` inside ``shard_map``: SPMD lock-step ticks, a few ``ppermute``\\ s per tick.

``run`` turns a schedule's simulated timeline (unit costs ``F = B = W = 1``) into integer ticks. At each tick
every device executes the actions its stage starts at that tick (one, or an overlapped F&B pair); then every
device on the pipeline axis takes part in the tick's shifts: each a ``ppermute`` in which every stage sends
and receives at most one block, carrying the activations its ``F`` actions produced to the stage holding the
next virtual stage, and the input gradients its ``B`` actions produced to the stage holding the previous one
(``Schedule.stage_of``, so looped, interleaved and V-shaped placements run alike; a hand-off within a stage,
the turn of a V, costs nothing). The timeline is the same on every device, so each one knows what it
receives and when, a shift nobody sends on is skipped by all devices together, and there is nothing that
could deadlock. An action consuming data produced at tick ``t`` starts at tick ``t + 1`` or later (the
simulator's dependency rule), so the data has always arrived. The communication is in :meth:`_Stage.shift`
alone, so an asynchronous runtime can replace it.

A model with an embedding and a head runs whole: ``first_fn`` turns the raw microbatch (tokens) into the
activation on virtual stage 0, ``loss_fn`` sees ``shared_params`` (final norm, head) on the last one, and the
gradients of ``shared_params`` (zero on stages that do not use them) are summed over the pipeline axis.

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
from typing import Any, NamedTuple

import optree
import torch

from .. import lax
from .._context import current
from .._errors import ShardingError
from .._vma import get_vma, pvary_to, set_vma
from .schedules import Action, Schedule

__all__ = ["PipelineGrads", "Send", "Tick", "run", "stage_order", "ticks", "virtual_stage_order"]

PyTree = Any
UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "comm": 0.0}
# dtypes an activation may have (its index travels in the shape probe)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.complex64)
_MAX_DIMS = 8


class PipelineGrads(NamedTuple):
    """The gradients ``run`` returns when ``shared_params`` or ``input_grad`` is given.

    Attributes:
        stage: the gradient of ``stage_params`` (its structure; varies over the pipeline axis).
        shared: the gradient of ``shared_params`` (summed over the pipeline axis), or None.
        input: the gradient of ``microbatches`` (``[n_microbatches, ...]``, invariant over the pipeline axis),
            or None.
    """

    stage: PyTree
    shared: PyTree
    input: torch.Tensor | None


@dataclass(frozen=True)
class Send:
    """One block a tick sends: from stage ``src`` to ``dst``, the output of ``kind`` (``"F"``: an activation,
    ``"B"``: an input gradient) for ``microbatch``, filed at the receiver under virtual stage ``virtual_stage``.

    Example:
        >>> Send(0, 1, "F", 0, 1)  # stage 0's activation of microbatch 0 goes to virtual stage 1
        Send(src=0, dst=1, kind='F', microbatch=0, virtual_stage=1)
    """

    src: int
    dst: int
    kind: str
    microbatch: int
    virtual_stage: int


@dataclass(frozen=True)
class Tick:
    """What happens at one tick of ``run``'s lock-step loop, the same on every device.

    Attributes:
        actions: ``actions[stage]``: the actions that stage starts at this tick (none, one, or an overlapped
            F&B pair, run one after the other).
        shifts: one ``ppermute`` each: sends in which every stage is at most once a source and once a
            destination. Forward sends come first, then backward ones.
        local: hand-offs within a stage (source and destination the same: the turn of a V), no communication.

    Example:
        >>> from funcshard.pipeline import one_f_one_b
        >>> t = ticks(one_f_one_b(2, 2))[0]  # stage 0 starts F0 and sends it to stage 1
        >>> [[str(a) for a in acts] for acts in t.actions], t.fwd, t.bwd
        ([['F0'], []], ((0, 1),), ())
    """

    actions: tuple[tuple[Action, ...], ...]
    shifts: tuple[tuple[Send, ...], ...]
    local: tuple[Send, ...] = ()

    @property
    def fwd(self) -> tuple[tuple[int, int], ...]:
        """``(src, dst)`` stage pairs of the activations sent at this tick."""
        return tuple((x.src, x.dst) for shift in self.shifts for x in shift if x.kind == "F")

    @property
    def bwd(self) -> tuple[tuple[int, int], ...]:
        """``(src, dst)`` stage pairs of the input gradients sent at this tick."""
        return tuple((x.src, x.dst) for shift in self.shifts for x in shift if x.kind == "B")


def _pack(sends: list[Send]) -> tuple[tuple[Send, ...], ...]:
    """Sends in as few ``ppermute``\\ s as first-fit gives (each stage once a source, once a destination per
    shift), forward ones apart from backward ones."""
    shifts: list[list[Send]] = []
    for kind in ("F", "B"):
        mine: list[list[Send]] = []
        for x in (x for x in sends if x.kind == kind):
            for shift in mine:
                if all(y.src != x.src and y.dst != x.dst for y in shift):
                    shift.append(x)
                    break
            else:
                mine.append([x])
        shifts += mine
    return tuple(tuple(s) for s in shifts)


def ticks(schedule: Schedule) -> list[Tick]:
    """The schedule as lock-step ticks: ``schedule.simulate`` with unit costs, cut at integer times.

    ``len(ticks(s))`` is the makespan; ``run`` makes one ``ppermute`` per shift of each tick.

    Example:
        >>> from funcshard.pipeline import gpipe, zbv
        >>> ts = ticks(gpipe(2, 2))
        >>> len(ts), sum(bool(t.fwd) for t in ts), sum(bool(t.bwd) for t in ts)
        (6, 2, 2)
        >>> [len(t.local) for t in ticks(zbv(2, 2))][:4]  # the V turns on stage 1: no communication
        [0, 1, 0, 1]
    """
    last = schedule.n_virtual_stages - 1
    sim = schedule.simulate(dict(UNIT_COSTS))
    n = round(sim.makespan)
    acts: list[list[list[Action]]] = [[[] for _ in range(schedule.n_stages)] for _ in range(n)]
    for s, row in enumerate(sim.timeline):
        for start, _, a in row:
            acts[round(start)][s].append(a)
    out = []
    for row in acts:
        sends = []
        for s, stage_acts in enumerate(row):
            for a in stage_acts:
                vs = schedule.virtual_stage(s, a.chunk)
                if a.kind == "F" and vs < last:
                    sends.append(Send(s, schedule.stage_of(vs + 1)[0], "F", a.microbatch, vs + 1))
                elif a.kind == "B" and vs > 0:
                    sends.append(Send(s, schedule.stage_of(vs - 1)[0], "B", a.microbatch, vs - 1))
        remote = [x for x in sends if x.src != x.dst]
        local = tuple(x for x in sends if x.src == x.dst)
        out.append(Tick(tuple(tuple(r) for r in row), _pack(remote), local))
    return out


def virtual_stage_order(n_stages: int, n_virtual: int) -> list[int]:
    """The virtual stage (layer chunk) held at each index of the globally stacked stage parameters (looped).

    ``run`` takes per device ``stage_params`` with a leading dim of ``n_virtual``; globally (spec
    ``P("pp", ...)``) they are stacked ``[n_stages * n_virtual, ...]``, so index ``s * n_virtual + c``
    is chunk ``c`` of stage ``s``, which is virtual stage ``c * n_stages + s`` in a looped placement. Stack
    your per-layer parameters as ``torch.stack([layers[i] for i in virtual_stage_order(p, v)])``; for any
    placement (V shapes included) use :func:`stage_order`.

    Example:
        >>> virtual_stage_order(2, 2)  # stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
        [0, 2, 1, 3]
    """
    return [(g % n_virtual) * n_stages + g // n_virtual for g in range(n_stages * n_virtual)]


def stage_order(schedule: Schedule) -> list[int]:
    """The virtual stage held at each index ``s * n_virtual + c`` of the stacked stage parameters, for the
    schedule's placement (``schedule.placement[s][c]``).

    Example:
        >>> from funcshard.pipeline import zbv
        >>> stage_order(zbv(2, 4))  # V: stage 0 holds virtual stages 0 and 3
        [0, 3, 1, 2]
    """
    return [vs for row in schedule.placement for vs in row]


def _leading(name: str, t: Any, n: int, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
        found = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ShardingError(
            f"pipeline.run: {name} has local shape {found}; expected a leading dim of {what}={n}. Reshape the "
            f"batch to [{n}, batch / {n}, ...]."
        )


def _check(
    schedule: Schedule,
    stage_params: PyTree,
    microbatches: torch.Tensor,
    targets: torch.Tensor | None,
    axis: str,
    input_grad: bool,
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
                f"P('{axis}', ...) (see stage_order)."
            )
    _leading("microbatches", microbatches, schedule.n_microbatches, "n_microbatches")
    if targets is not None:
        _leading("targets", targets, schedule.n_microbatches, "n_microbatches")
    if input_grad and not microbatches.dtype.is_floating_point:
        raise ShardingError(
            f"pipeline.run: input_grad=True needs floating-point microbatches, found {microbatches.dtype}; "
            f"integer inputs (tokens) have no gradient: drop input_grad."
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
    first_fn: Callable[..., torch.Tensor] | None = None,
    shared_params: PyTree = None,
    input_grad: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Run one pipelined forward + backward step of ``schedule`` inside ``shard_map``; return loss and grads.

    Call it inside ``fs.shard_map`` over a mesh whose axis ``axis`` has ``schedule.n_stages`` devices.
    Device ``s`` on ``axis`` runs stage ``s``'s actions; its chunk ``c`` is virtual stage
    ``schedule.virtual_stage(s, c)`` (``c * n_stages + s`` looped, ``s`` / ``2p-1-s`` for a V). The model
    is ``loss_fn(f_{V-1}(... f_1(f_0(first_fn(x))) ...), target)`` with ``f_v`` = ``stage_fn(params of
    virtual stage v, .)`` and ``V = n_stages * n_virtual``.

    Activations and their gradients travel between stages on ``axis`` with ``fs.ppermute`` on detached
    tensors; the gradients are accumulated here (no autograd across stages), so call ``run`` directly, not
    under ``torch.autograd.grad``. Other mesh axes (dp, fsdp, tp, cp) work inside ``stage_fn``, ``first_fn``
    and ``loss_fn`` as usual (collectives over them happen at the same tick on devices of the same stage).

    Args:
        schedule: a validated ``Schedule`` (any of ``by_name``'s, V-shaped and overlapped ones included).
            With ``W`` actions, ``B`` computes the input gradient only (keeping the graph) and ``W`` the
            parameter gradients from the same graph; an overlapped F&B pair runs one after the other.
        stage_fn: ``stage_fn(params_chunk, x) -> y``, where ``params_chunk`` is ``stage_params`` with the
            leading dim indexed. ``y`` has the shape and dtype of the activation between stages (that of
            ``microbatches[0]``, or of virtual stage 0's output with ``first_fn``).
        stage_params: this device's parameters, a pytree of tensors with a leading dim of ``n_virtual``.
            Globally ``[n_stages * n_virtual, ...]`` with spec ``P(axis, ...)``: global index
            ``s * n_virtual + c`` holds virtual stage ``placement[s][c]`` (see ``stage_order``).
        microbatches: ``[n_microbatches, ...]`` inputs, the same on every stage (only virtual stage 0
            reads them); any dtype with ``first_fn`` (token ids).
        loss_fn: ``loss_fn(y, target) -> scalar`` (``loss_fn(y)`` when ``targets`` is None;
            ``loss_fn(shared_params, y, ...)`` when ``shared_params`` is given), applied to the last virtual
            stage's output; the returned loss is its mean over microbatches.
        targets: ``[n_microbatches, ...]`` or None.
        axis: the pipeline mesh axis.
        first_fn: ``first_fn(x) -> h`` (``first_fn(shared_params, x)`` with ``shared_params``), run on
            virtual stage 0 before ``stage_fn``; it may change shape and dtype (tokens -> hidden states).
        shared_params: parameters of ``first_fn`` and ``loss_fn`` (embedding, final norm, head), the same
            on every stage (not sharded over ``axis``); their gradients are summed over ``axis``, so an
            embedding tied to the head gets both parts.
        input_grad: also return the gradient of ``microbatches`` (floating point only).

    Returns:
        ``(loss, grads)``: the mean of ``loss_fn`` over microbatches, invariant over ``axis`` (a 0-dim
        tensor), and the gradient of that loss w.r.t. ``stage_params`` (same structure and shapes; varies
        over ``axis``, return it with spec ``P(axis, ...)``); with ``shared_params`` or ``input_grad``,
        a :class:`PipelineGrads` ``(stage, shared, input)``.

    Raises:
        ShardingError: the size of ``axis`` differs from ``n_stages``, a parameter leaf's leading dim from
            ``n_virtual``, ``microbatches`` / ``targets``' leading dim from ``n_microbatches``,
            ``stage_fn`` changes the activation's shape or dtype, a shared parameter varies over ``axis``,
            or ``input_grad`` with integer microbatches.

    Example:
        >>> # layers[i] = (w1, w2): stack in pipeline order, shard over pp
        >>> # W1 = torch.stack([w1s[i] for i in stage_order(sched)])
        >>> # def step(params, shared, tokens, ts):  # params: ([v, d, h], [v, h, d]) per device
        >>> #     return run(sched, layer, params, tokens, targets=ts, loss_fn=head_loss,
        >>> #                first_fn=embed, shared_params=shared)
        >>> # loss, (g_stage, g_shared, _) = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P(), P()),
        >>> #                                             out_specs=(P(), (P("pp"), P(), None)))(...)
    """
    _check(schedule, stage_params, microbatches, targets, axis, input_grad)
    stage = _Stage(schedule, stage_fn, stage_params, microbatches, targets, loss_fn, axis)
    stage.first_fn, stage.input_grad = first_fn, input_grad
    stage.set_shared(shared_params)
    for i, tick in enumerate(ticks(schedule)):
        stage.tick(tick, probe=i == 0 and first_fn is not None and schedule.n_stages > 1)
    return stage.result()


@dataclass
class _Activation:
    """The shape, dtype and varying axes of every block sent between stages."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    axes: frozenset[str]


class _Stage:
    """One device's stage of a pipeline step: its parameter chunks (detached leaves requiring grad) and their
    accumulated gradients, what it has received, the graphs it keeps for the backward, and its loss sum.
    ``tick`` runs the actions the timeline gives it, then takes part in that tick's shifts."""

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
        self.vma, self.device, self.mesh = ctx.check_vma, ctx.device, ctx.mesh
        self.schedule, self.stage_fn, self.loss_fn, self.axis = schedule, stage_fn, loss_fn, axis
        self.first_fn: Callable[..., torch.Tensor] | None = None
        self.input_grad = False
        self.microbatches, self.targets = microbatches, targets
        self.p, self.m = schedule.n_stages, schedule.n_microbatches
        self.last = schedule.n_virtual_stages - 1
        self.me = lax.axis_index_int(axis)
        self.mb_axes = get_vma(microbatches) if self.vma else frozenset()
        # the activation: that of a microbatch, or (with first_fn) known once virtual stage 0 has run
        self.act = _Activation(tuple(microbatches.shape[1:]), microbatches.dtype, self.mb_axes | {axis})
        self.loss_sum: torch.Tensor | None = None  # float64 sum of the loss over microbatches (last stage)
        self.loss_dtype: torch.dtype | None = None
        self.loss_axes: frozenset[str] = frozenset()
        self.leaves, self.treedef = optree.tree_flatten(stage_params)
        v = schedule.n_virtual
        self.chunk_leaves = [[leaf.detach()[c].requires_grad_(True) for leaf in self.leaves] for c in range(v)]
        self.chunk_params = [optree.tree_unflatten(self.treedef, ls) for ls in self.chunk_leaves]
        self.grad_acc: list[list[torch.Tensor | None]] = [[None] * len(self.leaves) for _ in range(v)]
        self.received: dict[str, dict[tuple[int, int], torch.Tensor]] = {"F": {}, "B": {}}  # (mb, vs) -> value
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, vs) -> (x, y or loss)
        self.pending_w: dict[tuple[int, int], torch.Tensor] = {}  # (mb, vs) -> grad of y, kept from B for W
        self.input_grads: dict[int, torch.Tensor] = {}

    def set_shared(self, shared: PyTree) -> None:
        """Detached copies (requiring grad) of ``shared_params``, and their gradient accumulators."""
        self.has_shared = shared is not None
        self.shared_orig, self.shared_def = optree.tree_flatten(shared) if shared is not None else ([], None)
        for path, leaf in zip(optree.tree_paths(shared), self.shared_orig, strict=True):
            if self.vma and self.axis in get_vma(leaf):
                raise ShardingError(
                    f"pipeline.run: shared_params leaf {'/'.join(map(str, path)) or '<root>'} varies over "
                    f"'{self.axis}' (is it sharded over it?); shared parameters are the same on every stage: "
                    f"give them a spec without '{self.axis}', or put them in stage_params."
                )
        # tagged as varying over the axis: each stage uses them on its own data (no pvary, so no psum over the
        # axis inside one stage's backward); result() sums their gradients over the axis
        self.shared_leaves = [
            self.tagged(leaf.detach(), get_vma(leaf) | {self.axis}).requires_grad_(True) for leaf in self.shared_orig
        ]
        self.shared = optree.tree_unflatten(self.shared_def, self.shared_leaves) if self.has_shared else None
        self.shared_acc: list[torch.Tensor | None] = [None] * len(self.shared_leaves)

    def tagged(self, t: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
        return set_vma(t, axes) if self.vma else t

    def zeros(self) -> torch.Tensor:
        a = self.act
        return self.tagged(torch.zeros(a.shape, dtype=a.dtype, device=self.microbatches.device), a.axes)

    def tick(self, tick: Tick, *, probe: bool = False) -> None:
        """Run this stage's actions of ``tick``, then the tick's hand-offs and shifts."""
        out: dict[tuple[str, int, int], torch.Tensor | None] = {}  # (kind, mb, receiving vs) -> block
        for a in tick.actions[self.me]:
            vs = self.schedule.virtual_stage(self.me, a.chunk)
            if a.kind == "F":
                out[("F", a.microbatch, vs + 1)] = self.forward(a, vs)
            elif a.kind == "B":
                out[("B", a.microbatch, vs - 1)] = self.backward(a, vs)
            else:
                self.weight(a, vs)
        if probe:
            self.probe()
        for x in tick.local:
            if x.src == self.me:
                self.received[x.kind][(x.microbatch, x.virtual_stage)] = out[(x.kind, x.microbatch, x.virtual_stage)]
        for shift in tick.shifts:
            self.shift(shift, out)

    def shift(self, shift: tuple[Send, ...], out: dict[tuple[str, int, int], torch.Tensor | None]) -> None:
        """One ``ppermute`` over the axis: this stage's block of ``shift`` (zeros if none) goes out, and the
        block sent to it (if any) is filed under its (microbatch, virtual stage)."""
        mine = next((x for x in shift if x.src == self.me), None)
        block = out.get((mine.kind, mine.microbatch, mine.virtual_stage)) if mine is not None else None
        buf = block if block is not None else self.zeros()
        pairs = [(x.src, x.dst) for x in shift]
        got = lax.ppermute(self.tagged(buf, self.act.axes), self.axis, pairs)  # [*act] -> [*act]
        into = next((x for x in shift if x.dst == self.me), None)
        if into is not None:
            self.received[into.kind][(into.microbatch, into.virtual_stage)] = self.tagged(got, self.act.axes)

    def probe(self) -> None:
        """With ``first_fn``: the activation's shape, dtype and axes, from the stage holding virtual stage 0
        to every stage (a psum of a few ints over the axis, once per step)."""
        names = self.mesh.axis_names
        vec = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=self.microbatches.device)
        if self.me == self.schedule.stage_of(0)[0]:
            a = self.act
            if len(a.shape) > _MAX_DIMS or a.dtype not in _DTYPES:
                raise ShardingError(
                    f"pipeline.run: virtual stage 0 returned an activation of shape {a.shape} and dtype "
                    f"{a.dtype}; the runtime sends blocks of at most {_MAX_DIMS} dims of dtypes {_DTYPES}."
                )
            mask = sum(1 << i for i, n in enumerate(names) if n in a.axes)
            vec[:3] = torch.tensor([_DTYPES.index(a.dtype) + 1, len(a.shape), mask])
            vec[3 : 3 + len(a.shape)] = torch.tensor(a.shape, dtype=torch.int64)
        got = lax.psum(self.tagged(vec, frozenset([self.axis])), self.axis).tolist()  # [3 + 8] -> [3 + 8]
        dims = tuple(int(d) for d in got[3 : 3 + int(got[1])])
        axes = frozenset(n for i, n in enumerate(names) if int(got[2]) >> i & 1) if self.vma else frozenset()
        self.act = _Activation(dims, _DTYPES[int(got[0]) - 1], axes | {self.axis} if self.vma else frozenset())

    def forward(self, a: Action, vs: int) -> torch.Tensor | None:
        """``F``: run the chunk on the received (or first) activation; keep the graph; the output to send."""
        src = self.microbatches[a.microbatch] if vs == 0 else self.received["F"].pop((a.microbatch, vs))
        x = src.detach()
        if vs == 0:  # the raw microbatch, as varying over the axis as what the stages compute from it
            x = self.tagged(x, self.mb_axes | {self.axis})
        x.requires_grad_(vs > 0 or self.input_grad)
        with torch.enable_grad():
            h = x
            if vs == 0 and self.first_fn is not None:
                h = self.first_fn(*self.shared_args(), x)
            y = self.checked(self.stage_fn(self.chunk_params[a.chunk], h), vs)
            if vs == self.last:
                tgt = () if self.targets is None else (self.targets[a.microbatch],)
                loss = self.loss_fn(*self.shared_args(), y, *tgt) / self.m
                self.add_loss(loss)
                self.saved[(a.microbatch, vs)] = (x, loss)
                return None
        self.saved[(a.microbatch, vs)] = (x, y)
        return y.detach()

    def shared_args(self) -> tuple[PyTree, ...]:
        return (self.shared,) if self.has_shared else ()

    def add_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach().to(torch.float64)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.loss_dtype = loss.dtype
        if self.vma:
            self.loss_axes = get_vma(loss)

    def checked(self, y: Any, vs: int) -> torch.Tensor:
        """``stage_fn``'s output, checked to keep the activation's shape, dtype and varying axes (virtual
        stage 0 with ``first_fn`` sets them)."""
        if not isinstance(y, torch.Tensor):
            raise ShardingError(f"pipeline.run: stage_fn on virtual stage {vs} returned {type(y).__name__}.")
        if vs == 0 and self.first_fn is not None:
            axes = (get_vma(y) | {self.axis}) if self.vma else frozenset()
            self.act = _Activation(tuple(y.shape), y.dtype, axes)
        a = self.act
        if tuple(y.shape) != a.shape or y.dtype != a.dtype:
            raise ShardingError(
                f"pipeline.run: stage_fn on virtual stage {vs} returned {(tuple(y.shape), y.dtype)} for an "
                f"activation of {(a.shape, a.dtype)}; every stage must keep the activation's shape and dtype "
                f"(that of one microbatch, or of virtual stage 0's output with first_fn). Move shape-changing "
                f"layers into first_fn / loss_fn."
            )
        if not self.vma:
            return y
        extra = get_vma(y) - a.axes
        if extra:
            raise ShardingError(
                f"pipeline.run: stage_fn's output on virtual stage {vs} varies over {sorted(extra)}, "
                f"which the activations do not (they vary over {sorted(a.axes - {self.axis})}); reduce "
                f"it inside stage_fn (fs.psum / fs.pmean) or pass microbatches varying over them."
            )
        return pvary_to(y, a.axes, self.device)  # invariant parts: their cotangent is psum'd

    def params_of(self, vs: int, chunk: int) -> list[torch.Tensor]:
        """The leaves virtual stage ``vs`` differentiates: its chunk's, and the shared ones on the first and
        last virtual stages."""
        uses_shared = (vs == 0 and self.first_fn is not None) or vs == self.last
        return self.chunk_leaves[chunk] + (self.shared_leaves if uses_shared else [])

    def backward(self, a: Action, vs: int) -> torch.Tensor | None:
        """``B``: the input gradient (to send) and, without ``W`` actions, the parameter gradients."""
        key = (a.microbatch, vs)
        x, out = self.saved[key]
        g_out = None if vs == self.last else self.received["B"].pop(key)
        split = self.schedule.is_split(self.me, a.microbatch, a.chunk)  # a W follows: input gradient only
        want_x = vs > 0 or self.input_grad
        wrt = ([x] if want_x else []) + ([] if split else self.params_of(vs, a.chunk))
        gs = torch.autograd.grad(out, wrt, g_out, retain_graph=split, allow_unused=True) if wrt else ()
        if split:
            self.pending_w[key] = g_out if g_out is not None else torch.ones_like(out)
        else:
            del self.saved[key]
            self.accumulate(a.chunk, gs[1:] if want_x else gs)
        gx = gs[0] if want_x else None
        if vs == 0:
            if self.input_grad:
                self.input_grads[a.microbatch] = torch.zeros_like(x) if gx is None else gx.detach()
            return None
        return self.zeros() if gx is None else gx.detach()

    def weight(self, a: Action, vs: int) -> None:
        """``W``: the parameter gradients from the graph ``B`` kept."""
        key = (a.microbatch, vs)
        _, out = self.saved.pop(key)
        gs = torch.autograd.grad(out, self.params_of(vs, a.chunk), self.pending_w.pop(key), allow_unused=True)
        self.accumulate(a.chunk, gs)

    def accumulate(self, c: int, gs: tuple[torch.Tensor | None, ...]) -> None:
        n = len(self.leaves)
        for i, g in enumerate(gs):
            if g is None:
                continue
            accs, j = (self.grad_acc[c], i) if i < n else (self.shared_acc, i - n)
            accs[j] = g if accs[j] is None else accs[j] + g

    def loss_result(self) -> torch.Tensor:
        """The mean loss, invariant over the axis: the last stage's sum, its dtype and varying axes in one
        psum over the axis (the other stages add zeros)."""
        names = self.mesh.axis_names
        vec = torch.zeros(3, dtype=torch.float64, device=self.microbatches.device)
        if self.loss_sum is not None and self.loss_dtype is not None:
            mask = sum(1 << i for i, n in enumerate(names) if n in self.loss_axes)
            vec = torch.stack([self.loss_sum, vec[0] + _float_dtype_index(self.loss_dtype), vec[0] + mask])
        got = lax.psum(self.tagged(vec, frozenset([self.axis])), self.axis)  # [3] -> [3], invariant over axis
        dtype = _FLOATS[int(got[1].item())]
        axes = frozenset(n for i, n in enumerate(names) if int(got[2].item()) >> i & 1) - {self.axis}
        return self.tagged(got[0].to(dtype), axes)

    def result(self) -> tuple[torch.Tensor, Any]:
        """The mean loss (invariant over the axis) and the gradients of this stage's parameters (and of the
        shared parameters and the input, summed over the axis)."""
        loss = self.loss_result()
        out_leaves = []
        for i, leaf in enumerate(self.leaves):
            per_chunk = [
                torch.zeros_like(self.chunk_leaves[c][i]) if g is None else g
                for c, g in enumerate(acc[i] for acc in self.grad_acc)
            ]
            out_leaves.append(torch.stack(per_chunk).to(leaf.dtype))  # v x [*s] -> [v, *s]
        stage_grads = optree.tree_unflatten(self.treedef, out_leaves)
        if not self.has_shared and not self.input_grad:
            return loss, stage_grads
        shared = None
        if self.has_shared:
            local = [
                self.tagged((torch.zeros_like(leaf) if g is None else g).to(leaf.dtype), get_vma(leaf) | {self.axis})
                for leaf, g in zip(self.shared_orig, self.shared_acc, strict=True)
            ]
            summed = lax.psum(local, self.axis)  # each leaf [*s] -> [*s], summed over the stages that used it
            shared = optree.tree_unflatten(
                self.shared_def, [self.tagged(g, get_vma(leaf)) for g, leaf in zip(summed, self.shared_orig)]
            )
        inp = None
        if self.input_grad:
            mb = self.microbatches
            per = [self.input_grads.get(i, torch.zeros_like(mb[i])) for i in range(self.m)]
            inp = lax.psum(self.tagged(torch.stack(per), self.mb_axes | {self.axis}), self.axis)  # [m, ...]
            inp = self.tagged(inp, self.mb_axes)
        return loss, PipelineGrads(stage_grads, shared, inp)


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _float_dtype_index(dtype: torch.dtype) -> int:
    if dtype not in _FLOATS:
        raise ShardingError(f"pipeline.run: loss_fn returned a {dtype} value; return a floating-point scalar.")
    return _FLOATS.index(dtype)
