"""One working copy of a module per device, its parameters on the meta device, and the module's state as a tree.

``torch.func.functional_call`` swaps the tensors it is given into the module for the duration of the call. Under
the ``"sim"`` backend every device of a mesh is a thread of this process, so the devices cannot share one module
object: each would swap its own shards into it while another runs. :class:`Instances` keeps one copy per device
(made once, on first use), whose parameters and buffers live on the meta device (no memory), so a call only ever
touches its own device's copy and the user's module is never changed.

A call is checked for Python-side state: an attribute of a plain type (a number, a string, a bool, ``None``)
that a module's ``forward`` sets or changes would differ between devices and calls, so it is refused with a
``ConfigError`` naming the module and the attribute.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..extend import ConfigError, maybe_current

__all__ = ["Instances", "module_state", "tied_names"]

_PLAIN = (int, float, str, bool, type(None))


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` of ``module``'s parameters then buffers, each shared tensor once (the first name
    ``named_parameters`` gives it), detached: the same storage as the module's, no copy.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> list(module_state(m))
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        out[name] = p.detach()
    for name, b in module.named_buffers():
        out[name] = b.detach()
    return out


def tied_names(module: nn.Module) -> dict[str, str]:
    """``{alias: name}``: every other name of a shared parameter or buffer, to the name :func:`module_state` keeps.

    Example:
        >>> m = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        >>> m[1].weight = m[0].weight
        >>> tied_names(m)
        {'1.weight': '0.weight'}
    """
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in _all_named(module):
        kept = first.setdefault(id(t), name)
        if kept != name:
            out[name] = kept
    return out


def _all_named(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors of the same shapes (ties kept)."""
    memo: dict[int, Any] = {}
    for _, t in _all_named(module):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _plain_attrs(module: nn.Module) -> dict[tuple[int, str], Any]:
    """``{(module index, attribute): value}`` of every plain-typed instance attribute of every submodule."""
    out: dict[tuple[int, str], Any] = {}
    for i, m in enumerate(module.modules()):
        for k, v in vars(m).items():
            if isinstance(v, _PLAIN):
                out[(i, k)] = v
    return out


class Instances:
    """The working copies of one module: one per device (``rank`` inside ``shard_map``; one more outside it).

    Args:
        module: the user's module (never changed).
        prepare: called once on each new copy (e.g. to install the tensor-parallel forwards on it).
        check_state: compare the copy's plain attributes before and after each call (:meth:`check`).

    Example:
        >>> inst = Instances(nn.Linear(2, 3))
        >>> inst.get().weight.device.type  # the copy's parameters hold no memory
        'meta'
    """

    def __init__(self, module: nn.Module, prepare: Any = None, *, check_state: bool = True) -> None:
        self.module = module
        self._prepare = prepare
        self._copies: dict[Any, nn.Module] = {}
        self._names: dict[int, list[str]] = {}
        self._lock = threading.Lock()
        self.check_state = check_state

    def get(self) -> nn.Module:
        """This device's copy (made on first use)."""
        ctx = maybe_current()
        key = None if ctx is None else ctx.device.rank
        inst = self._copies.get(key)
        if inst is None:
            with self._lock:
                inst = self._copies.get(key)
                if inst is None:
                    inst = _meta_copy(self.module)
                    if self._prepare is not None:
                        self._prepare(inst)
                    self._copies[key] = inst
        return inst

    def snapshot(self, inst: nn.Module) -> dict[tuple[int, str], Any] | None:
        """The copy's plain attributes before a call (None when not checked)."""
        return _plain_attrs(inst) if self.check_state else None

    def check(self, inst: nn.Module, before: dict[tuple[int, str], Any] | None, fn: str) -> None:
        """Raise ``ConfigError`` where the call set or changed a plain attribute of a submodule (Python-side state).

        Raises:
            ConfigError: naming the submodule's path, the attribute, and its values before and after.
        """
        if before is None:
            return
        after = _plain_attrs(inst)
        if after == before:
            return
        names = self._names.get(id(inst))
        if names is None:
            names = self._names[id(inst)] = [n for n, _ in inst.named_modules(remove_duplicate=False)]
        for key in sorted(set(before) | set(after)):
            old, new = before.get(key, "<unset>"), after.get(key, "<unset>")
            if old != new or type(old) is not type(new):
                path = names[key[0]] if key[0] < len(names) else "?"
                where = f"'{path}'" if path else "the root module"
                raise ConfigError(
                    f"{fn}: {where} ({type(list(inst.modules())[key[0]]).__name__}) changed its attribute "
                    f"{key[1]!r} from {old!r} to {new!r} during the call: Python-side state, which a pure function "
                    f"cannot carry (each device and each call would see its own). Keep such state in a buffer or "
                    f"pass it as an argument; or build the function with check_state=False if the change is harmless."
                )
