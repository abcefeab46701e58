"""What each pipeline stage sends and receives, and when it posts each receive: pure data from a ``Schedule``.

:func:`stage_plan` is one stage's part of a step as :func:`funcshard.pipeline.run` executes it: the stage's own
action list cut into units (one action, or an overlapped F&B pair), and for each action the block it waits
for and the block it sends, each a :class:`Send` ``(src, dst, kind, microbatch, virtual_stage)`` (``src ==
dst``: a hand-off within the stage, the turn of a V, no communication). ``posts[i]`` lists the receives the
stage posts before unit ``i``: each one ``lookahead`` units before the unit that consumes it, and the blocks
from one peer in the order that peer sends them (so no receive overtakes an earlier one from the same
sender, which a backend matching in order, as NCCL does, needs).

Nothing here runs a model or imports torch.

Example:
    >>> from funcshard.pipeline import one_f_one_b
    >>> plan = stage_plan(one_f_one_b(2, 3), 1)  # the last stage: receives activations, sends gradients
    >>> [str(u[0].action) for u in plan.units]
    ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']
    >>> [[str(x) for x in p] for p in plan.posts]  # each activation posted two units before its F
    [['F0>1', 'F1>1'], [], ['F2>1'], [], [], []]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

from .schedules import Action, Schedule, ScheduleError

__all__ = ["LOOKAHEAD", "Send", "StagePlan", "Step", "loss_route", "messages", "plans", "stage_plan"]

LOOKAHEAD = 2  # units between posting a receive and the unit that waits on it


@dataclass(frozen=True)
class Send:
    """One block between stages: from stage ``src`` to ``dst``, the output of ``kind`` (``"F"``: an activation,
    ``"B"``: an input gradient) for ``microbatch``, filed at the receiver under virtual stage ``virtual_stage``.

    Example:
        >>> x = Send(0, 1, "F", 0, 1)  # stage 0's activation of microbatch 0 goes to virtual stage 1
        >>> x, str(x), x.tag(4)
        (Send(src=0, dst=1, kind='F', microbatch=0, virtual_stage=1), 'F0>1', 8)
    """

    src: int
    dst: int
    kind: str
    microbatch: int
    virtual_stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}>{self.virtual_stage}"

    def tag(self, n_microbatches: int) -> int:
        """A number unique to this block within a step: ``(virtual_stage * m + microbatch) * 2 + (kind == "B")``."""
        return (self.virtual_stage * n_microbatches + self.microbatch) * 2 + (self.kind == "B")


@dataclass(frozen=True)
class Step:
    """One action of a stage's plan.

    Attributes:
        action: the schedule's action.
        virtual_stage: the virtual stage it runs.
        recv: the block it waits for (an activation for an ``F`` past virtual stage 0, a gradient for a ``B``
            before the last one), or None.
        send: the block it produces for another virtual stage, or None.
    """

    action: Action
    virtual_stage: int
    recv: Send | None
    send: Send | None


@dataclass(frozen=True)
class StagePlan:
    """One stage's part of a pipeline step (see :func:`stage_plan`).

    Attributes:
        stage: the stage.
        units: its actions in execution order, grouped in units (one action, or an overlapped F&B pair).
        posts: ``posts[i]``: the receives from other stages to post before unit ``i``.
        notes: the blocks, sent or received by this stage, that also carry the step's loss (see
            :func:`loss_route`); empty when ``routed`` is False.
        routed: every stage learns the loss from the blocks it receives (:func:`plans` sets it), so the
            runtime needs no collective to hand the loss to every stage.
    """

    stage: int
    units: tuple[tuple[Step, ...], ...]
    posts: tuple[tuple[Send, ...], ...]
    notes: frozenset[Send] = frozenset()
    routed: bool = False

    @property
    def sends(self) -> list[Send]:
        """The blocks this stage sends to other stages, in the order it sends them."""
        return [s.send for u in self.units for s in u if s.send is not None and s.send.dst != self.stage]

    @property
    def recvs(self) -> list[Send]:
        """The blocks this stage receives from other stages, in the order it posts the receives."""
        return [x for p in self.posts for x in p]


def _io(schedule: Schedule, stage: int, a: Action, owner: dict[int, int]) -> tuple[int, Send | None, Send | None]:
    """The virtual stage of ``a``, the block it consumes and the block it produces (``owner``: virtual stage
    -> the stage holding it)."""
    vs, mb, last = schedule.placement[stage][a.chunk], a.microbatch, schedule.n_virtual_stages - 1
    recv = send = None
    if a.kind == "F":
        if vs > 0:
            recv = Send(owner[vs - 1], stage, "F", mb, vs)
        if vs < last:
            send = Send(stage, owner[vs + 1], "F", mb, vs + 1)
    elif a.kind == "B":
        if vs < last:
            recv = Send(owner[vs + 1], stage, "B", mb, vs)
        if vs > 0:
            send = Send(stage, owner[vs - 1], "B", mb, vs - 1)
    return vs, recv, send


def _owner(schedule: Schedule) -> dict[int, int]:
    return {vs: s for s, row in enumerate(schedule.placement) for vs in row}


def _units(acts: list[Action]) -> list[list[Action]]:
    out: list[list[Action]] = []
    for a in acts:
        if a.overlap and out:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def messages(schedule: Schedule) -> list[Send]:
    """Every block that crosses from one stage to another in a step, each stage's in its sending order.

    Example:
        >>> from funcshard.pipeline import one_f_one_b, zbv
        >>> len(messages(one_f_one_b(4, 8)))  # m (p - 1) activations and as many gradients
        48
        >>> len(messages(zbv(4, 8)))  # the V's turn stays on stage 3: 2p - 2 crossings each way
        96
    """
    owner = _owner(schedule)
    return [x for s in range(schedule.n_stages) for x in _sends(schedule, s, owner)]


def stage_plan(schedule: Schedule, stage: int, *, lookahead: int = LOOKAHEAD) -> StagePlan:
    """Stage ``stage``'s actions with their blocks in and out, and when to post each receive.

    A receive is posted ``lookahead`` units before the unit that consumes it (at the start for the first
    ones), never after a later block from the same peer: the receives from one peer follow that peer's
    sending order.

    Raises:
        ScheduleError: ``stage`` out of range, or ``lookahead`` negative.

    Example:
        >>> from funcshard.pipeline import zbv
        >>> p = stage_plan(zbv(2, 2), 1)  # stage 1 holds virtual stages 1 and 2: the V turns here
        >>> [(str(s.action), str(s.send)) for u in p.units for s in u][:3]
        [('F0', 'F0>2'), ('F0c1', 'F0>3'), ('F1', 'F1>2')]
        >>> [str(x) for x in p.sends][:2]  # F0>2 stays on the stage (virtual stage 2 is here)
        ['F0>3', 'F1>3']
    """
    if not (isinstance(stage, int) and 0 <= stage < schedule.n_stages):
        raise ScheduleError(f"stage_plan: no stage {stage!r}; stages are 0..{schedule.n_stages - 1}.")
    if not (isinstance(lookahead, int) and lookahead >= 0):
        raise ScheduleError(f"stage_plan: lookahead must be an int >= 0, found {lookahead!r}.")
    owner = _owner(schedule)
    units = tuple(
        tuple(Step(a, *_io(schedule, stage, a, owner)) for a in unit) for unit in _units(schedule.actions[stage])
    )
    need = {s.recv: i for i, u in enumerate(units) for s in u if s.recv is not None and s.recv.src != stage}
    posts: list[list[Send]] = [[] for _ in units]
    for peer in range(schedule.n_stages):
        if peer == stage:
            continue
        stream = [x for x in _sends(schedule, peer, owner) if x.dst == stage]
        missing = [x for x in stream if x not in need]
        if missing:
            raise ScheduleError(
                f"stage_plan: stage {peer} sends {missing[0]} to stage {stage}, whose list has no action that "
                f"uses it; validate the schedule (Schedule.validate)."
            )
        at = len(units)
        for x in reversed(stream):  # no later than any later block of the same peer
            at = min(at, max(0, need[x] - lookahead))
            posts[at].append(x)
    for row in posts:  # within a unit, each peer's blocks in its sending order (they were added reversed)
        row.reverse()
    return StagePlan(stage, units, tuple(tuple(r) for r in posts))


def _sends(schedule: Schedule, stage: int, owner: dict[int, int]) -> list[Send]:
    """The blocks ``stage`` sends to other stages, in its list's order."""
    out = []
    for a in schedule.actions[stage]:
        x = _io(schedule, stage, a, owner)[2]
        if x is not None and x.dst != stage:
            out.append(x)
    return out


def loss_route(schedule: Schedule, stage_plans: tuple[StagePlan, ...] | None = None) -> frozenset[Send] | None:
    """The blocks that carry the step's loss to every stage, or None if the blocks cannot reach some stage.

    The loss is complete on the stage holding the last virtual stage once its last ``F`` there has run. From
    then on a block that stage sends can carry it, and a stage that has received such a block can pass it on
    in the blocks it sends afterwards. Each other stage gets it in one block: the first it consumes whose
    sender, by its own list's order, already has the loss when it sends it. So the loss reaches every stage
    with the activations and gradients it receives anyway (no extra message, no collective at the end of the
    step). Pure data: computed from the plans, the same on every stage.

    Example:
        >>> from funcshard.pipeline import one_f_one_b
        >>> sorted(str(x) for x in loss_route(one_f_one_b(3, 4)))  # the last gradients, down the stages
        ['B3>0', 'B3>1']
    """
    sp = stage_plans if stage_plans is not None else tuple(stage_plan(schedule, s) for s in range(schedule.n_stages))
    steps = [[st for unit in plan.units for st in unit] for plan in sp]
    last = schedule.n_virtual_stages - 1
    sent_at = {st.send: i for row in steps for i, st in enumerate(row) if st.send is not None}
    never = max((len(row) for row in steps), default=0) + 1
    known = [never] * len(steps)  # known[s]: the first step of s whose sends can carry the loss
    holder = _owner(schedule)[last]
    known[holder] = max(i for i, st in enumerate(steps[holder]) if st.action.kind == "F" and st.virtual_stage == last)
    carrier: dict[int, Send] = {}
    changed = True
    while changed:  # known[] only decreases: this ends
        changed = False
        for d, row in enumerate(steps):
            for k in range(min(known[d], len(row))):
                x = row[k].recv
                if x is not None and x.src != d and sent_at[x] >= known[x.src]:
                    known[d], carrier[d], changed = k, x, True
                    break
    if any(k == never for k in known):
        return None
    return frozenset(x for d, x in carrier.items() if d != holder)


_CACHE: dict[int, tuple[Schedule, Any, tuple[StagePlan, ...]]] = {}
_CACHE_SIZE = 32
_LOCK = threading.Lock()


def _contents(schedule: Schedule) -> Any:
    return (
        schedule.n_stages,
        schedule.n_microbatches,
        schedule.n_virtual,
        schedule.placement,
        tuple(tuple(acts) for acts in schedule.actions),
    )


def plans(schedule: Schedule) -> tuple[StagePlan, ...]:
    """Every stage's plan, the schedule validated first; kept for the next call with the same schedule (a
    training loop runs one schedule every step), rebuilt if its contents changed.

    Raises:
        ScheduleError: the schedule does not validate.

    Example:
        >>> from funcshard.pipeline import gpipe
        >>> sched = gpipe(2, 4)
        >>> plans(sched) is plans(sched), [len(p.sends) for p in plans(sched)]
        (True, [4, 4])
    """
    contents = _contents(schedule)
    with _LOCK:
        hit = _CACHE.get(id(schedule))
        if hit is not None and hit[0] is schedule and hit[1] == contents:
            return hit[2]
    schedule.validate()
    out = tuple(stage_plan(schedule, s) for s in range(schedule.n_stages))
    route = loss_route(schedule, out)
    if route is not None:
        out = tuple(
            replace(plan, notes=frozenset(x for x in route if plan.stage in (x.src, x.dst)), routed=True)
            for plan in out
        )
    with _LOCK:
        while len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[id(schedule)] = (schedule, contents, out)  # the schedule kept alive: its id is not reused
    return out
