"""The styles' forwards, installed on a device's working copy of the module, and one call's state.

A planned ``torch.nn.Linear`` of the copy gets a forward that computes its style on the local shards its
parameters hold during the call (``colwise``: the input made varying over ``tp``, once per distinct input, so the
q / k / v projections of one hidden state, or an MLP's gate and up, share one all-reduce in the backward;
``rowwise``: the partial products summed over ``tp``, the bias added after the sum); a ``vocab`` embedding looks up
its rows and sums; ``sequence_parallel`` splits its input's sequence dim over ``tp`` and gathers its output back.
With an ``fsdp`` axis each FSDP unit (a decoder layer; the root for the parameters no layer holds) gets a forward
pre-hook that all-gathers its sharded parameters in one flat bucket just before it runs (FSDP2's ``fully_shard``
unit: one all-gather forward, one reduce-scatter backward per unit, not one per parameter or per linear) and
issues the gather of the unit that ran after it in the previous call (FSDP2's forward prefetch: under ``dist`` it
travels while this one computes).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import lax
from ..extend import ConfigError, P, split_invariant
from ..ops import row_parallel_linear, vocab_parallel_embedding
from ..ops.fsdp import fsdp_gather, reshard_after_forward

__all__ = ["CallState", "Gathers", "Holder", "Unit", "install"]


class Unit:
    """One FSDP unit of a copy: the sharded parameters gathered together (one flat bucket per set of replica axes)
    just before its module runs, each as ``(name, spec, replica axes, owners)`` where ``owners`` are the
    ``(submodule, attribute)`` places that hold it (a tied parameter: gathered once, put in every place)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: list[tuple[str, P, tuple[str, ...], list[tuple[nn.Module, str]]]] = []

    def add(self, name: str, spec: P, reps: tuple[str, ...], owner: nn.Module, attr: str) -> None:
        for n, _, _, owners in self.entries:
            if n == name:
                owners.append((owner, attr))
                return
        self.entries.append((name, spec, reps, [(owner, attr)]))


class Gathers:
    """A copy's FSDP units by the module whose forward pre-hook gathers them (a decoder layer; the root for its
    loose parameters), and the order the units ran in the last call (the prefetch order of the next)."""

    def __init__(self, fsdp: str, *, reshard: bool = False, root: nn.Module | None = None) -> None:
        self.fsdp = fsdp
        self.reshard = reshard  # free each unit's gathered weights after its forward, gather again in the backward
        self.root = root  # the root's unit is never resharded (its forward spans every other unit's)
        self.units: dict[nn.Module, Unit] = {}
        self.order: list[nn.Module] = []
        self.position: dict[nn.Module, int] = {}


class CallState:
    """One call of the sharded function on one device: the inputs already made varying over ``tp`` (by identity),
    and, with ``fsdp``, the gathers issued and the units done."""

    def __init__(self, gathers: Gathers | None) -> None:
        self.varied: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gathers = gathers
        self.pending: dict[nn.Module, Callable[[], dict[str, torch.Tensor]]] = {}
        self.done: set[nn.Module] = set()
        self.seen: list[nn.Module] = []
        # each unit's shards as this call gave them, by replica axes: {reps: {name: (shard, spec)}}
        self.groups: dict[nn.Module, dict[tuple[str, ...], dict[str, tuple[torch.Tensor, P]]]] = {}
        self.scopes: dict[nn.Module, reshard_after_forward] = {}  # the resharded units' scopes now open
        self.last: reshard_after_forward | None = None  # the last resharded unit's scope (the next one's ``after``)

    def vary(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """``pvary(x, axis)`` (identity forward, psum backward), the same result for the same ``x`` in this call."""
        hit = self.varied.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        y = lax.pvary(x, axis)  # [..., in] -> [..., in]
        self.varied[id(x)] = (x, y)
        return y

    def gather(self, mod: nn.Module) -> None:
        """Put unit ``mod``'s gathered parameters in place (issued now, or by the prefetch of the unit before it)."""
        if mod in self.done:
            return
        finish = self.pending.pop(mod, None) or self._issue(mod)
        g = self.gathers
        assert g is not None
        self.seen.append(mod)
        i = g.position.get(mod)
        if i is not None and i + 1 < len(g.order):
            nxt = g.order[i + 1]
            if nxt not in self.done and nxt not in self.pending:
                self.pending[nxt] = self._issue(nxt)  # FSDP2's prefetch: in flight while mod computes
        full = finish()
        self._place(mod, full)
        self.done.add(mod)
        if g.reshard and mod is not g.root:  # entered here, left by the unit's forward hook (:meth:`release`)
            regather = self._issue(mod, regather=True)
            self.last = self.scopes[mod] = reshard_after_forward(full, regather, after=self.last, derive=False)
            self.scopes[mod].__enter__()

    def _place(self, mod: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Put ``tensors`` (by name) in the places of unit ``mod``'s parameters, for this call only."""
        assert self.gathers is not None
        for name, _, _, owners in self.gathers.units[mod].entries:
            for owner, attr in owners:
                owner._parameters[attr] = tensors[name]

    def release(self, mod: nn.Module) -> None:
        """After a resharded unit's forward: leave its scope and put its shards back, so the gathered weights are
        freed (the backward gathers them again); a second call of the unit in this call gathers again."""
        scope = self.scopes.pop(mod, None)
        if scope is None:
            return
        scope.__exit__(None, None, None)
        self._place(mod, {n: t for group in self.groups[mod].values() for n, (t, _) in group.items()})
        self.done.discard(mod)

    def _issue(self, mod: nn.Module, regather: bool = False) -> Callable[[], Any]:
        """The all-gathers of unit ``mod``'s sharded parameters over ``fsdp``: one flat bucket per set of replica
        axes (and dtype), whose backward is one reduce-scatter. ``regather``: the function that issues them again
        on the same shards (for the backward of a resharded unit)."""
        assert self.gathers is not None
        if regather:
            return functools.partial(self._issue_groups, self.groups[mod])
        groups: dict[tuple[str, ...], dict[str, tuple[torch.Tensor, P]]] = {}
        for name, spec, reps, owners in self.gathers.units[mod].entries:
            owner, attr = owners[0]
            groups.setdefault(reps, {})[name] = (owner._parameters[attr], spec)  # the shard functional_call put there
        self.groups[mod] = groups
        return self._issue_groups(groups)

    def _issue_groups(
        self, groups: dict[tuple[str, ...], dict[str, tuple[torch.Tensor, P]]]
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """The bucketed all-gathers of ``{replica axes: {name: (shard, spec)}}``, issued now."""
        assert self.gathers is not None
        finishes = []
        for reps, items in groups.items():
            local = {n: t for n, (t, _) in items.items()}
            specs = {n: s for n, (_, s) in items.items()}
            # {name: [d0/fsdp, ...]} -> {name: [d0, ...]} (tp stays), one all-gather of [fsdp, sum numel];
            # backward: one reduce-scatter [sum numel * fsdp] -> [sum numel] (+ one psum over reps)
            finishes.append(
                fsdp_gather(local, specs, axis=self.gathers.fsdp, replicate_axis=reps or None, prefetch=True)
            )

        def finish() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for f in finishes:
                out.update(f())
            return out

        return finish

    def close(self) -> None:
        """Wait for gathers issued but not used (a call that ran fewer units), and record this call's order."""
        for mod in list(self.scopes):  # a unit whose forward raised
            self.release(mod)
        for finish in self.pending.values():
            finish()
        self.pending.clear()
        g = self.gathers
        if g is not None and self.seen and self.seen != g.order:
            g.order = list(self.seen)
            g.position = {m: i for i, m in enumerate(g.order)}


class Holder:
    """A copy's current call (``None`` between calls): what its installed forwards and hooks read."""

    def __init__(self, gathers: Gathers | None) -> None:
        self.state: CallState | None = None
        self.gathers = gathers

    def now(self) -> CallState:
        state = self.state
        if state is None:
            raise ConfigError("parallelize: the working copy of the module was called outside its function.")
        return state


def _linear_forward(style: str, tp: str, holder: Holder) -> Callable[[nn.Linear, torch.Tensor], torch.Tensor]:
    if style in ("colwise", "colwise_rep"):
        rep = style == "colwise_rep"

        def colwise(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            x = holder.now().vary(x, tp)  # identity forward; backward: psum over tp (one per distinct input)
            y = F.linear(x, self.weight, self.bias)  # [..., in] @ [in, out/tp] -> [..., out/tp]
            if rep:
                y = lax.all_gather_invariant(y, tp, dim=-1, tiled=True)  # [..., out/tp] -> [..., out]
            return y

        return colwise
    rep = style == "rowwise_rep"

    def rowwise(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if rep:
            x = split_invariant(x, tp, dim=-1)  # [..., in] -> [..., in/tp] (this device's block)
        return row_parallel_linear(x, self.weight, self.bias, axis=tp)  # [..., in/tp] @ [in/tp, out], psum

    return rowwise


def _vocab_forward(tp: str) -> Callable[[nn.Embedding, torch.Tensor], torch.Tensor]:
    def vocab(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        y = vocab_parallel_embedding(ids, self.weight, axis=tp)  # [...] -> [..., d], summed over tp
        if self.padding_idx is not None:  # no gradient into the padding row (F.embedding's padding_idx)
            y = torch.where((ids == self.padding_idx).unsqueeze(-1), y.detach(), y)
        return y

    return vocab


def _sequence_hooks(mod: nn.Module, tp: str) -> None:
    def split(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (split_invariant(args[0], tp, dim=1), *args[1:])  # [b, s, d] -> [b, s/tp, d]

    def gather(_: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return lax.all_gather_invariant(out, tp, dim=1, tiled=True)  # [b, s/tp, d] -> [b, s, d]
        return out

    mod.register_forward_pre_hook(split)
    mod.register_forward_hook(gather)


def install(inst: nn.Module, styles: dict[str, str], tp: str | None, holder: Holder) -> None:
    """Install the styles' forwards and the FSDP gather hooks on a working copy ``inst``.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> install(mlp, {"0": "colwise", "2": "rowwise"}, "tp", Holder(None))
        >>> mlp[0].forward.__name__, mlp[2].forward.__name__
        ('colwise', 'rowwise')
    """
    for path, style in styles.items():
        mod = inst.get_submodule(path)
        if isinstance(mod, nn.Linear) and style in ("colwise", "rowwise", "colwise_rep", "rowwise_rep"):
            mod.forward = types.MethodType(_linear_forward(style, tp, holder), mod)  # type: ignore[method-assign]
        elif isinstance(mod, nn.Embedding) and style == "vocab":
            mod.forward = types.MethodType(_vocab_forward(tp), mod)  # type: ignore[method-assign]
        elif style == "sequence_parallel":
            _sequence_hooks(mod, tp)
    gathers = holder.gathers
    if gathers is not None:
        for mod in list(inst.modules()):
            if mod in gathers.units:
                mod.register_forward_pre_hook(lambda m, args: holder.now().gather(m))
                if gathers.reshard and mod is not gathers.root:
                    mod.register_forward_hook(lambda m, args, out: holder.now().release(m), always_call=True)
