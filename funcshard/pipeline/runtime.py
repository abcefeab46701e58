"""Execute a pipeline ``Schedule`` inside ``shard_map``: each device runs its own stage's list, asynchronously.

Device ``s`` on the pipeline axis runs stage ``s``'s actions in the schedule's order, each as soon as its
input has arrived; there are no global ticks and no round in which every device takes part. What it sends
and receives is planned from the schedule alone (:func:`funcshard.pipeline.messages.stage_plan`): every block
(an activation going to the stage holding the next virtual stage, or an input gradient going to the one
holding the previous; ``Schedule.stage_of``, so looped, interleaved and V-shaped placements run alike) is
one point-to-point message. The receive of a block is posted a couple of actions before the action that
consumes it, and waited on right before that action; a block is sent the moment its action has produced it,
together with the receives due next in one batch (one rendezvous, as a fused send-forward / receive-backward),
and the sends are waited on at the end of the step, so they never hold up compute. A hand-off within a stage
(the turn of a V) is no message at all. Under ``"dist"`` these are ``isend`` / ``irecv`` on the axis' process
group; under ``"sim"`` a mailbox between the device threads with the same semantics and timeouts.

Why it cannot deadlock: posting never blocks, and each device only ever waits (a) for a block right before
the action that needs it, which its producer sends as soon as it has run it, or (b) at the end of the step for
its sends, whose receives every peer posts before it finishes its own list. So the devices progress exactly as
``Schedule.simulate`` runs the lists (each action when its dependencies are done, sends never blocking), which
``Schedule.validate`` proves completes; ``run`` validates the schedule first. Collectives over other axes
inside ``stage_fn`` (tp, dp) match as before: the devices of one stage run the same list in the same order.

A model with an embedding and a head runs whole: ``first_fn`` turns the raw microbatch (tokens) into the
activation on virtual stage 0, ``loss_fn`` sees ``shared_params`` (final norm, head) on the last one, and the
gradients of ``shared_params`` (zero on stages that do not use them) are summed over the pipeline axis. The
activation's shape with ``first_fn`` is known only once virtual stage 0 has run: one ``psum`` of a few
integers over the axis tells the other stages before they post any receive. Gradients are accumulated in
place by the autograd engine (``torch.autograd.backward(..., inputs=...)`` into the ``.grad`` of one detached
leaf per parameter and chunk, as ``Tensor.backward`` does), no Python per gradient.

Layer counts the virtual stages do not divide: with ``n_layers=L``, ``stage_params``' leaves hold a stack of
``L`` layers split over the ``n_stages * n_virtual`` virtual stages as ``torch.tensor_split`` splits it (earlier
virtual stages one layer more, as DTorch assigns them: :func:`~funcshard.pipeline.chunk_layers`), this stage's
chunks concatenated in chunk order (leading dim: the sum of their layer counts; ``to_chunks(..., n_layers=L)``
lays them out from the natural order). ``stage_fn`` then gets chunk ``c`` with its leading dim of
``chunk_layers(schedule, L)[stage][c]`` kept (not indexed away), and a virtual stage with no layer (more virtual
stages than layers) is the identity: ``stage_fn`` is not called on it, it still passes activations and
gradients on. The stage gradients come back in the same form (``from_chunks(..., n_layers=L)`` takes them back).

Under ``check_vma=True`` the vma mode's per-op dispatch is paid once per chunk and step: ``stage_fn``'s first
microbatch on each chunk (and ``first_fn``'s and ``loss_fn``'s first) runs tracked, and when that run only
tagged (no ``pvary`` inserted on the way to the parameters, no collective, no custom Function) the later
microbatches, whose operands carry the same tags, run untracked (the same ops, values and graph) and their
output takes the tag of the first. So these functions must run the same ops on every microbatch (no Python
control flow on the data, as under ``jax.jit``); a collective made only by a later microbatch raises.

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

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import optree
import torch
from torch.autograd.function import BackwardCFunction

from .. import lax
from ..extend import (
    Op,
    ShardingError,
    axis_index_int,
    bind,
    capture,
    current,
    find_vma,
    get_vma,
    observer,
    p2p,
    set_vma,
    tracing,
    transforms_active,
)
from .layout import chunk_layers
from .messages import Send as Send
from .messages import StagePlan, Step, plans
from .schedules import Action, Schedule
from .trace import active_trace, now

__all__ = ["PipelineGrads", "Send", "run", "stage_order", "virtual_stage_order"]

PyTree = Any
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
    n_layers: int | None = None,
) -> None:
    """:func:`run`'s arguments checked, in order: no ``torch.func`` transform around, the axis' size, the
    parameters' leading dims, the microbatches' and targets', ``input_grad``'s dtype."""
    if transforms_active():
        raise ShardingError(_THROUGH.format(how="called under a torch.func transform (grad, vjp, vmap)"))
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
    sizes = None if n_layers is None else chunk_layers(schedule, n_layers)[axis_index_int(axis)]
    want = schedule.n_virtual if sizes is None else sum(sizes)
    for path, leaf in zip(paths, leaves, strict=True):
        where = "/".join(map(str, path)) or "<root>"
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != want:
            found = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            if sizes is not None:
                raise ShardingError(
                    f"pipeline.run: stage_params leaf {where} has local shape {found}; with n_layers={n_layers} "
                    f"expected a leading dim of {want}, the layers of this stage's chunks {sizes} in chunk order "
                    f"(to_chunks(..., n_layers={n_layers})'s output)."
                )
            raise ShardingError(
                f"pipeline.run: stage_params leaf {where} has local shape {found}; expected a leading dim of "
                f"n_virtual={schedule.n_virtual} (the chunks of this stage). Stack the parameters globally as "
                f"[n_stages * n_virtual, ...] = [{schedule.n_stages * schedule.n_virtual}, ...] with spec "
                f"P('{axis}', ...) (see stage_order)."
            )
        _differentiable("stage_params", where, leaf)
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
    n_layers: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """Run one pipelined forward + backward step of ``schedule`` inside ``shard_map``; return loss and grads.

    Call it inside ``fs.shard_map`` over a mesh whose axis ``axis`` has ``schedule.n_stages`` devices. Device ``s``
    on ``axis`` runs stage ``s``'s actions; its chunk ``c`` is virtual stage ``schedule.virtual_stage(s, c)``
    (``c * n_stages + s`` looped, ``s`` / ``2p-1-s`` for a V). The model is ``loss_fn(f_{V-1}(... f_1(f_0(first_fn(x)))
    ...), target)`` with ``f_v`` = ``stage_fn(params of virtual stage v, .)`` and ``V = n_stages * n_virtual``.

    Each device runs its own stage's list (no lock-step; see the module's docstring): activations and their gradients
    travel between stages on ``axis`` as point-to-point messages, and the gradients are accumulated here (no autograd
    across stages), so call ``run`` directly, not under ``torch.autograd.grad`` (differentiating its loss raises).
    Other mesh axes (dp, fsdp, tp, cp) work inside ``stage_fn``, ``first_fn`` and ``loss_fn`` as usual; with
    ``check_vma=True`` these three run tracked on the first microbatch of each chunk and untracked on the others where
    that is exact: they must run the same ops on every microbatch.

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
        n_layers: ``stage_params`` hold this stage's chunks of ``n_layers`` layers (module docstring: "Layer counts").

    Returns:
        ``(loss, grads)``: the mean of ``loss_fn`` over microbatches, invariant over ``axis`` (a 0-dim
        tensor), and the gradient of that loss w.r.t. ``stage_params`` (same structure and shapes; varies
        over ``axis``, return it with spec ``P(axis, ...)``); with ``shared_params`` or ``input_grad``,
        a :class:`PipelineGrads` ``(stage, shared, input)``.

    Raises:
        ScheduleError: the schedule does not validate (a missing action, a deadlock).
        ShardingError: the size of ``axis`` differs from ``n_stages``, a parameter leaf's leading dim from
            ``n_virtual`` (its chunks' layers with ``n_layers``), ``microbatches`` / ``targets``' leading dim from
            ``n_microbatches``, ``stage_fn`` changes the activation's shape or dtype, a shared parameter varies over
            ``axis``, ``input_grad`` with integer microbatches, an integer leaf in ``stage_params`` or
            ``shared_params``, ``loss_fn`` returning no floating-point scalar, or ``run`` called under a ``torch.func``
            transform or its loss differentiated (its backward raises: ``run`` returns the gradients itself). A
            chunk or loss with no gradient path to a parameter gives it zero gradients.

    Example:
        >>> # W1 = torch.stack([w1s[i] for i in stage_order(sched)])  # layers in pipeline order, shard over pp
        >>> # def step(params, shared, tokens, ts):  # params: ([v, d, h], [v, h, d]) per device
        >>> #     return run(sched, layer, params, tokens, targets=ts, loss_fn=head_loss,
        >>> #                first_fn=embed, shared_params=shared)
        >>> # loss, (g_stage, g_shared, _) = fs.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P(), P()),
        >>> #                                             out_specs=(P(), (P("pp"), P(), None)))(...)
    """
    _check(schedule, stage_params, microbatches, targets, axis, input_grad, n_layers)
    rest = (targets, loss_fn, axis, first_fn, shared_params, input_grad, n_layers)
    return _run_step(schedule, stage_fn, stage_params, microbatches, *rest)


def _run_step(
    schedule: Schedule,
    stage_fn: Callable[[PyTree, torch.Tensor], torch.Tensor],
    stage_params: PyTree,
    microbatches: torch.Tensor,
    targets: torch.Tensor | None,
    loss_fn: Callable[..., torch.Tensor],
    axis: str,
    first_fn: Callable[..., torch.Tensor] | None,
    shared_params: PyTree,
    input_grad: bool,
    n_layers: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """:func:`run` on its checked arguments: this device's stage runs its plan, then hands back the loss (whose
    backward raises) and the gradients."""
    plan = plans(schedule)  # validated
    # The runtime's own tensor work (slicing, detaching, receive buffers, the backward's autograd.grad, gradient
    # accumulation) runs with torch functions off, so the vma mode sees only the user's functions (the mode's
    # Python dispatch costs several microseconds per op); the runtime tags what it hands them itself.
    tf_on = torch._C._is_torch_function_enabled()
    with torch._C.DisableTorchFunction():
        stage = _Stage(schedule, stage_fn, stage_params, microbatches, targets, loss_fn, axis, n_layers)
        stage.first_fn, stage.input_grad, stage.tf_on = first_fn, input_grad, tf_on
        stage.set_shared(shared_params)
        stage.execute(plan[stage.me])
        stage_grads = stage.stage_grads()
    loss, grads = stage.result(stage_grads)
    obs = observer()
    if obs is not None:  # an ahead-of-time analysis (shard_map's lower) counts these as params and grads
        obs.note("params", stage_params)
        obs.note("grads", grads)
    return _not_differentiable(loss, [*stage.leaves, *stage.shared_orig, microbatches], axis), grads


@dataclass
class _Activation:
    """The shape, dtype and varying axes of every block sent between stages."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    axes: frozenset[str]


class _Stage:
    """One device's stage of a pipeline step: its parameter chunks (detached leaves requiring grad) and their
    accumulated gradients, what it has received, the graphs it keeps for the backward, and its loss sum.
    ``execute`` runs the stage's plan: its actions in order, with their point-to-point messages."""

    def __init__(
        self,
        schedule: Schedule,
        stage_fn: Callable[[PyTree, torch.Tensor], torch.Tensor],
        stage_params: PyTree,
        microbatches: torch.Tensor,
        targets: torch.Tensor | None,
        loss_fn: Callable[..., torch.Tensor],
        axis: str,
        n_layers: int | None = None,
    ) -> None:
        ctx = current("pipeline.run")
        self.vma, self.device, self.mesh = ctx.check_vma, ctx.device, ctx.mesh
        # whether the caller runs with torch functions on (the vma mode, when shard_map tracks): the user's
        # functions and the collectives run so, the runtime's own work without (see run)
        self.tf_on = True
        self.schedule, self.stage_fn, self.loss_fn, self.axis = schedule, stage_fn, loss_fn, axis
        self.first_fn: Callable[..., torch.Tensor] | None = None
        self.input_grad = False
        self.microbatches, self.targets = microbatches, targets
        self.p, self.m = schedule.n_stages, schedule.n_microbatches
        self.last = schedule.n_virtual_stages - 1
        self.me = axis_index_int(axis)
        self.mb_axes = get_vma(microbatches) if self.vma else frozenset()
        self.tgt_axes = (get_vma(targets) | {axis}) if self.vma and targets is not None else frozenset()
        # the activation: that of a microbatch, or (with first_fn) known once virtual stage 0 has run
        self.act = _Activation(tuple(microbatches.shape[1:]), microbatches.dtype, self.mb_axes | {axis})
        self.loss_sum: torch.Tensor | None = None  # float64 sum of the loss over microbatches (last stage)
        self.loss_dtype: torch.dtype | None = None
        self.loss_axes: frozenset[str] = frozenset()
        self.n_losses = 0
        # [loss sum, dtype index, axes mask] (float64), once known: made by the stage holding the last virtual
        # stage after its last F there, carried to the others by the blocks of the plan's loss route
        self.note: torch.Tensor | None = None
        self.notes: frozenset[Send] = frozenset()
        self.routed = False
        self.leaves, self.treedef = optree.tree_flatten(stage_params)
        v = schedule.n_virtual
        self.leaf_axes = [get_vma(leaf) if self.vma else frozenset() for leaf in self.leaves]
        # with n_layers, chunk c is its run of rows of the concatenated chunks (None: the stacked form, index c)
        self.sizes = None if n_layers is None else chunk_layers(schedule, n_layers)[self.me]
        rows = [c if self.sizes is None else slice(sum(self.sizes[:c]), sum(self.sizes[: c + 1])) for c in range(v)]
        self.chunk_leaves = [
            [self.tagged(leaf.detach()[r], ax).requires_grad_(True) for leaf, ax in zip(self.leaves, self.leaf_axes)]
            for r in rows
        ]
        self.chunk_params = [optree.tree_unflatten(self.treedef, ls) for ls in self.chunk_leaves]
        self.received: dict[Send, torch.Tensor] = {}  # hand-offs within the stage (the turn of a V)
        self.recv_works: dict[Send, Any] = {}  # posted receives (their works), by block
        self.send_works: deque[Any] = deque()  # posted sends (their works) not known to be done, oldest first
        # the (microbatch, chunk) pairs whose backward this stage splits (a W follows the B)
        self.split = {(a.microbatch, a.chunk) for a in schedule.actions[self.me] if a.kind == "W"}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, vs) -> (x, y or loss)
        self.pending_w: dict[tuple[int, int], torch.Tensor] = {}  # (mb, vs) -> grad of y, kept from B for W
        self.input_grads: dict[int, torch.Tensor] = {}
        # (function, chunk) -> (operands' tags, output's tag) of a plain tracked call (see call_user)
        self.typed: dict[tuple[Any, ...], tuple[tuple[frozenset[str] | None, ...], frozenset[str]]] = {}

    def set_shared(self, shared: PyTree) -> None:
        """Detached copies (requiring grad) of ``shared_params``, and their gradient accumulators."""
        self.has_shared = shared is not None
        self.shared_orig, self.shared_def = optree.tree_flatten(shared) if shared is not None else ([], None)
        for path, leaf in zip(optree.tree_paths(shared), self.shared_orig, strict=True):
            _differentiable("shared_params", "/".join(map(str, path)) or "<root>", leaf)
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

    def tagged(self, t: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
        return set_vma(t, axes) if self.vma else t

    def user(self) -> contextlib.AbstractContextManager[Any]:
        """Around the user's functions and the collectives: torch functions (the vma mode) as the caller had them."""
        return torch._C._EnableTorchFunction() if self.tf_on else contextlib.nullcontext()

    def zeros(self) -> torch.Tensor:
        a = self.act
        return self.tagged(torch.zeros(a.shape, dtype=a.dtype, device=self.microbatches.device), a.axes)

    def execute(self, plan: StagePlan) -> None:
        """Run ``plan``: post the first receives, then each unit's actions in order, each waiting for its
        input right before it runs and sending its output at once (with the receives due next in the same
        batch); at the end, wait for the sends.

        With ``first_fn`` the activation's shape is learnt first (:meth:`probe`): the stage holding virtual
        stage 0 runs its first unit (always an ``F`` there, which needs nothing) before it probes, the others
        probe before they post anything."""
        probing = self.first_fn is not None and self.p > 1
        first = probing and self.me == self.schedule.stage_of(0)[0]
        self.posts, self.next_post = plan.posts, 0
        self.notes, self.routed = plan.notes, plan.routed
        if probing and not first:
            self.probe()
        if not first:
            self.post([], 0)
        for i, unit in enumerate(plan.units):
            for j, step in enumerate(unit):
                out = self.run_step(step)
                last = j == len(unit) - 1
                if first and i == 0 and last:
                    self.probe()
                sends = []
                if step.send is not None and step.send.dst == self.me:
                    self.received[step.send] = self.zeros() if out is None else out
                elif step.send is not None:
                    sends.append((step.send, self.zeros() if out is None else out))
                self.post(sends, i + 1 if last else -1)
        while self.send_works:
            self.send_works.popleft().wait()

    def post(self, sends: list[tuple[Send, torch.Tensor]], upto: int) -> None:
        """One batch of point-to-point operations: ``sends``, and the receives planned up to unit ``upto``."""
        out, into, recvs = [], [], []  # (block, peer, tag) of each send and each receive; the received blocks
        for x, t in sends:
            if x in self.notes:  # the block and the loss note behind it, as bytes: [block bytes + 24]
                if self.note is None:
                    raise RuntimeError(f"pipeline.run: stage {self.me} must send the loss with {x} before knowing it")
                t = torch.cat([t.reshape(-1).view(torch.uint8), self.note.view(torch.uint8)])
            out.append((t, x.dst, x.tag(self.m)))
        a = self.act
        with torch._C.DisableTorchFunction():
            while self.next_post <= min(upto, len(self.posts) - 1):
                for x in self.posts[self.next_post]:
                    if x in self.notes:
                        n = math.prod(a.shape) * a.dtype.itemsize + _NOTE_BYTES
                        buf = torch.empty(n, dtype=torch.uint8, device=self.microbatches.device)
                    else:
                        buf = torch.empty(a.shape, dtype=a.dtype, device=self.microbatches.device)
                    into.append((buf, x.src, x.tag(self.m)))
                    recvs.append(x)
                self.next_post += 1
            if not out and not into:
                return
            works = p2p(out, into, self.axis)  # each block [*act] -> [*act], at its peer
        while self.send_works and self.send_works[0].is_completed():  # let go of blocks already delivered
            self.send_works.popleft()
        self.send_works.extend(works[: len(sends)])
        self.recv_works.update(zip(recvs, works[len(sends) :], strict=True))

    def take(self, x: Send) -> torch.Tensor:
        """Block ``x``: handed over within the stage, or waited for right now."""
        if x.src == self.me:
            return self.tagged(self.received.pop(x), self.act.axes)
        got = cast(torch.Tensor, self.recv_works.pop(x).wait())  # a receive's work returns its buffer
        if x in self.notes:  # [block bytes + 24] -> the block, and the loss note
            a = self.act
            self.note = got[-_NOTE_BYTES:].clone().view(torch.float64)
            got = got[:-_NOTE_BYTES].view(a.dtype).view(a.shape)
        return self.tagged(got, self.act.axes)

    def run_step(self, step: Step) -> torch.Tensor | None:
        """One action, its input taken first; the block it produces (None if it produces none)."""
        a, vs = step.action, step.virtual_stage
        x = None if step.recv is None else self.take(step.recv)
        tr = active_trace()
        start = now() if tr is not None else 0.0
        out = None
        if a.kind == "F":
            out = self.forward(a, vs, x)
        elif a.kind == "B":
            out = self.backward(a, vs, x)
        else:
            self.weight(a, vs)
        if tr is not None:
            tr.add(self.me, start, now(), a)
        return out

    def probe(self) -> None:
        """With ``first_fn``: the activation's shape, dtype and axes, from the stage holding virtual stage 0
        to every stage (a psum of a few ints over the axis, once per step)."""
        names = self.mesh.axis_names
        where = self.microbatches.device
        # (an abstract run: the probe holds values all the same, which the abstract device sums over the stages)
        vec = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device="cpu" if where.type == "meta" else where)
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
        with self.user():
            got = lax.psum(self.tagged(vec, frozenset([self.axis])), self.axis).tolist()  # [3 + 8] -> [3 + 8]
        dims = tuple(int(d) for d in got[3 : 3 + int(got[1])])
        axes = frozenset(n for i, n in enumerate(names) if int(got[2]) >> i & 1) if self.vma else frozenset()
        self.act = _Activation(dims, _DTYPES[int(got[0]) - 1], axes | {self.axis} if self.vma else frozenset())

    def forward(self, a: Action, vs: int, got: torch.Tensor | None) -> torch.Tensor | None:
        """``F``: run the chunk on the received (or first) activation; keep the graph; the output to send."""
        if got is None:  # the raw microbatch, as varying over the axis as what the stages compute from it
            x = self.tagged(self.microbatches[a.microbatch].detach(), self.mb_axes | {self.axis})
        else:
            x = _detached(got)
        x.requires_grad_(vs > 0 or self.input_grad)
        with torch.enable_grad():
            h = x
            if vs == 0 and self.first_fn is not None:
                h = self.call_user("first_fn", ("first",), self.first_fn, *self.shared_args(), x)
            if self.sizes is not None and self.sizes[a.chunk] == 0:  # a virtual stage with no layer: the identity
                y = _identity(h)
            else:
                y = self.call_user("stage_fn", ("stage", a.chunk), self.stage_fn, self.chunk_params[a.chunk], h)
            y = self.checked(y, vs)
            if vs == self.last:
                # varying over the axis, as the output it meets (no pvary inserted per microbatch: no gradient)
                tgt = () if self.targets is None else (self.tagged(self.targets[a.microbatch], self.tgt_axes),)
                raw = self.call_user("loss_fn", ("loss",), self.loss_fn, *self.shared_args(), y, *tgt)
                loss = raw / self.m
                self.add_loss(raw, loss)
                self.saved[(a.microbatch, vs)] = (x, loss)
                return None
        self.saved[(a.microbatch, vs)] = (x, y)
        return _detached(y)

    def call_user(self, what: str, key: tuple[Any, ...], fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, one of the user's functions (``stage_fn`` on a chunk, ``first_fn``, ``loss_fn``); under
        the vma mode, tracked once per ``key`` (the function and chunk) and step.

        The first call for ``key`` runs under the mode (tagging every op, inserting ``pvary`` where operands
        differ). If that run was plain (no collective, no ``pvary`` or custom Function in the graph from its
        output back to its operands: the mode only tagged), the later calls for ``key``, whose tensor operands
        carry the same tags, run with torch functions off (no per-op dispatch into the mode; the same ops,
        values and graph) and their output gets the tag the first run gave it. A later call that makes a
        collective (control flow on the data) raises: its operand's axes were not tracked."""
        if not self.tf_on:  # no mode to skip (dist without check_vma)
            return fn(*args)
        if not self.vma or tracing() or transforms_active():
            with self.user():
                return fn(*args)
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        tags = tuple(find_vma(t) for t in tensors)
        typed = self.typed.get(key)
        if typed is not None and typed[0] == tags:
            with capture() as log:
                y = fn(*args)  # torch functions off: run's own DisableTorchFunction
            if log:
                names = sorted({r[1] for r in log})
                raise ShardingError(
                    f"pipeline.run: {what} made collectives {names} on a later microbatch ({key}) but none on "
                    f"the first this step. Under check_vma=True the runtime tracks the first call of {what} (per "
                    f"chunk) and runs the later ones untracked when that first run needed no pvary or collective, "
                    f"so {what} must run the same ops on every microbatch (no Python control flow on the data, as "
                    f"under jax.jit): make the collective unconditional."
                )
            if isinstance(y, torch.Tensor):
                set_vma(y, typed[1])
            return y
        with self.user(), capture() as log:
            y = fn(*args)
        if typed is None and not log and isinstance(y, torch.Tensor) and _plain_graph(y, tensors):
            self.typed[key] = (tags, get_vma(y))
        return y

    def shared_args(self) -> tuple[PyTree, ...]:
        return (self.shared,) if self.has_shared else ()

    def add_loss(self, raw: torch.Tensor, loss: torch.Tensor) -> None:
        """Add ``loss`` (``raw``, the user's value, divided by ``m``) to the step's float64 sum."""
        if not isinstance(raw, torch.Tensor) or raw.dim() != 0:
            found = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
            raise ShardingError(f"pipeline.run: loss_fn returned {found}; return a 0-dim tensor (the mean loss).")
        _float_dtype_index(raw.dtype)  # a float, checked before any backward needs its gradient
        value = loss.detach().to(torch.float64)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.loss_dtype = loss.dtype
        if self.vma:
            self.loss_axes = get_vma(raw)
        self.n_losses += 1
        if self.n_losses == self.m:
            self.note = self.loss_vector()

    def loss_vector(self) -> torch.Tensor:
        """``[loss sum, dtype index, axes mask]`` in float64: this stage's part of the loss (zeros if none)."""
        vec = torch.zeros(3, dtype=torch.float64, device=self.microbatches.device)
        if self.loss_sum is not None and self.loss_dtype is not None:
            mask = sum(1 << i for i, n in enumerate(self.mesh.axis_names) if n in self.loss_axes)
            vec = torch.stack([self.loss_sum, vec[0] + _float_dtype_index(self.loss_dtype), vec[0] + mask])
        return vec

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
        have = get_vma(y)
        extra = have - a.axes
        if extra:
            raise ShardingError(
                f"pipeline.run: stage_fn's output on virtual stage {vs} varies over {sorted(extra)}, "
                f"which the activations do not (they vary over {sorted(a.axes - {self.axis})}); reduce "
                f"it inside stage_fn (fs.psum / fs.pmean) or pass microbatches varying over them."
            )
        if a.axes <= have:
            return y
        return lax.pvary(y, tuple(n for n in self.mesh.axis_names if n in a.axes))  # invariant parts: cotangent psum'd

    def params_of(self, vs: int, chunk: int) -> list[torch.Tensor]:
        """The leaves virtual stage ``vs`` differentiates: its chunk's, and the shared ones on the first and
        last virtual stages."""
        uses_shared = (vs == 0 and self.first_fn is not None) or vs == self.last
        return self.chunk_leaves[chunk] + (self.shared_leaves if uses_shared else [])

    def backward(self, a: Action, vs: int, g_out: torch.Tensor | None) -> torch.Tensor | None:
        """``B``: the input gradient (to send) and, without ``W`` actions, the parameter gradients, which the
        autograd engine adds into the leaves' ``.grad`` in place (as ``Tensor.backward`` does: the first one
        taken over where no one else holds it, else copied)."""
        key = (a.microbatch, vs)
        x, out = self.saved[key]
        split = (a.microbatch, a.chunk) in self.split  # a W follows: input gradient only
        want_x = vs > 0 or self.input_grad
        gx = None
        # an output that needs no gradient depends on no parameter and on no input that needs one (a chunk that
        # passes its input through on virtual stage 0, a constant loss): every gradient from it is zero
        path = out.requires_grad
        if split:
            if want_x and path:
                (gx,) = torch.autograd.grad(out, [x], g_out, retain_graph=True, allow_unused=True)
            self.pending_w[key] = g_out if g_out is not None else torch.ones_like(out)
        else:
            del self.saved[key]
            wrt = ([x] if want_x else []) + self.params_of(vs, a.chunk)
            if path:
                torch.autograd.backward(out, g_out, inputs=wrt)  # accumulates into each leaf's .grad
            gx = x.grad if want_x else None
        if vs == 0:
            if self.input_grad:
                self.input_grads[a.microbatch] = torch.zeros_like(x) if gx is None else _detached(gx)
            return None
        return self.zeros() if gx is None else _detached(gx)

    def weight(self, a: Action, vs: int) -> None:
        """``W``: the parameter gradients from the graph ``B`` kept, added into the leaves' ``.grad``."""
        key = (a.microbatch, vs)
        _, out = self.saved.pop(key)
        g_out = self.pending_w.pop(key)
        if out.requires_grad:  # (else: no gradient path, zero gradients; see backward)
            torch.autograd.backward(out, g_out, inputs=self.params_of(vs, a.chunk))

    def loss_result(self) -> torch.Tensor:
        """The mean loss, invariant over the axis: the last stage's sum, its dtype and varying axes, from the
        note the plan's loss route brought to this stage (the same float64 values on every stage), or, where
        the plan has no route, in one psum over the axis (the other stages add zeros)."""
        names = self.mesh.axis_names
        if self.routed:
            if self.note is None:
                raise RuntimeError(f"pipeline.run: stage {self.me} ended its step without the loss its plan routes")
            got = self.note
        else:
            vec = self.tagged(self.loss_vector(), self.loss_axes | {self.axis})
            with self.user():
                got = lax.psum(vec, self.axis)  # [3] -> [3], invariant over the axis
        if got.is_meta:  # an abstract run: no values to read; the loss's dtype and axes as this stage knows them
            return self.abstract_loss()
        with torch._C.DisableTorchFunction():  # a few reads of the runtime's own vector: no dispatch to the mode
            _, index, mask = got.tolist()
            value = got[0].to(_FLOATS[int(index)])
        axes = frozenset(n for i, n in enumerate(names) if int(mask) >> i & 1) - {self.axis}
        return self.tagged(value, axes)

    def abstract_loss(self) -> torch.Tensor:
        """:meth:`loss_result` on an abstract mesh (meta tensors: shapes only): a meta scalar of the loss's dtype
        where this stage computed a loss (the last), else float32, the dtype of a cross-entropy loss."""
        known = self.loss_dtype is not None
        value = torch.empty((), dtype=self.loss_dtype if known else torch.float32, device="meta")
        return self.tagged(value, (self.loss_axes if known else frozenset()) - {self.axis})

    def stage_grads(self) -> PyTree:
        """The accumulated gradients of this stage's parameters, stacked over its chunks in their structure,
        each varying over what its parameter varies over."""
        out_leaves = []
        for i, (leaf, axes) in enumerate(zip(self.leaves, self.leaf_axes, strict=True)):
            per_chunk = [
                torch.zeros_like(leaves[i]) if leaves[i].grad is None else leaves[i].grad
                for leaves in self.chunk_leaves
            ]
            if self.sizes is not None:  # the chunks' runs of rows, concatenated in chunk order
                g = per_chunk[0] if len(per_chunk) == 1 else torch.cat(per_chunk)  # v x [n_c, *s] -> [sum n_c, *s]
            elif len(per_chunk) == 1:  # the accumulator (a fresh tensor) as the one chunk: no copy
                g = per_chunk[0].unsqueeze(0)  # [*s] -> [1, *s]
            else:
                g = torch.stack(per_chunk)  # v x [*s] -> [v, *s]
            out_leaves.append(self.tagged(g.to(leaf.dtype), axes))
        return optree.tree_unflatten(self.treedef, out_leaves)

    def result(self, stage_grads: PyTree) -> tuple[torch.Tensor, Any]:
        """The mean loss (invariant over the axis) and the gradients: ``stage_grads`` (this stage's parameters,
        from :meth:`stage_grads`), and those of the shared parameters and the input, summed over the axis."""
        loss = self.loss_result()
        if not self.has_shared and not self.input_grad:
            return loss, stage_grads
        shared = None
        if self.has_shared:
            local = [
                self.tagged((torch.zeros_like(leaf) if g is None else g).to(leaf.dtype), get_vma(leaf) | {self.axis})
                for leaf, g in zip(self.shared_orig, (t.grad for t in self.shared_leaves), strict=True)
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
_NOTE_BYTES = 24  # the loss note: 3 float64
_THROUGH = (
    "pipeline.run: {how}. run computes the gradients itself and returns them: its loss has no graph back to "
    "stage_params, shared_params or microbatches, so differentiating it would give zero gradients. Call run "
    "directly and use what it returns, loss, grads = run(...), not under fs.value_and_grad, torch.func.grad "
    "or torch.autograd.grad."
)


def _differentiable(what: str, where: str, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
        raise ShardingError(
            f"pipeline.run: {what} leaf {where} is a {leaf.dtype} tensor of local shape {tuple(leaf.shape)}; run "
            f"differentiates every leaf of {what}, and only floating-point tensors have gradients. Keep integer "
            f"buffers (indices, counters) out of {what}: close over them in the function that uses them."
        )


class _Undifferentiable(Op):
    """``run``'s loss where its inputs require grad: the value (a copy, varying over what the loss varies over),
    whose backward raises (see ``_THROUGH``). Bound with ``bind(_Undifferentiable, loss, axis=..., name=...,
    params=inputs)``: the inputs only connect the value to the graph of ``run``'s inputs."""

    @staticmethod
    def forward(dev: Any, axes: tuple[str, ...], value: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return (value.clone(),)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        raise ShardingError(
            _THROUGH.format(how="its loss was differentiated (backward, autograd.grad, value_and_grad)")
        )

    @staticmethod
    def vma(axes: frozenset[str], value: frozenset[str]) -> frozenset[str]:
        """vma rule: the copy varies over what the loss does."""
        return value


def _not_differentiable(loss: torch.Tensor, inputs: list[torch.Tensor], axis: str) -> torch.Tensor:
    """``loss``, or, when autograd records and one of ``run``'s ``inputs`` requires grad (``run`` called under
    ``fs.value_and_grad`` or ``torch.autograd.grad`` of its inputs), a copy whose backward raises: differentiating
    it would otherwise find no path to the inputs and give zero gradients without a word."""
    if not torch.is_grad_enabled():
        return loss
    with torch._C.DisableTorchFunction():  # (flag reads)
        needs = [t for t in inputs if t.requires_grad]
    if not needs:
        return loss
    return bind(_Undifferentiable, loss, axis=axis, name="pipeline.run", params=tuple(needs))[0]  # type: ignore[index]


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` with ``t``'s varying axes, outside the vma mode (what the mode would tag, at no cost)."""
    with torch._C.DisableTorchFunction():
        out = t.detach()
    axes = find_vma(t)
    return out if axes is None else set_vma(out, axes)


def _identity(h: torch.Tensor) -> torch.Tensor:
    """A virtual stage with no layer: ``h`` itself, as a view (its own graph node, so the stage's backward takes
    the gradient through it as through any chunk), with ``h``'s varying axes."""
    with torch._C.DisableTorchFunction():
        out = h.view_as(h)
    axes = find_vma(h)
    return out if axes is None else set_vma(out, axes)


def _plain_graph(y: torch.Tensor, operands: list[torch.Tensor]) -> bool:
    """Whether the autograd graph from ``y`` back to ``operands`` and the leaves holds only torch's own nodes:
    no ``Function`` of Python (a ``pvary`` the vma mode inserted, a collective, a user's custom Function)."""
    stops = {t.grad_fn for t in operands if t.grad_fn is not None}
    todo = [] if y.grad_fn is None else [y.grad_fn]
    seen = set(todo)
    while todo:
        node = todo.pop()
        if node in stops:  # an operand's own graph: not this call's
            continue
        if isinstance(node, BackwardCFunction):
            return False
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return True


def _float_dtype_index(dtype: torch.dtype) -> int:
    if dtype not in _FLOATS:
        raise ShardingError(f"pipeline.run: loss_fn returned a {dtype} value; return a floating-point scalar.")
    return _FLOATS.index(dtype)
