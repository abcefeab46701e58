"""The per-device context that ``shard_map`` sets while a device runs the user's function, and this thread's
mode flags (overlap, prefetch, trace scopes) that the backends read."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.eager_transforms as _eager

from ..errors import ShardingError

__all__ = [
    "DeviceContext",
    "Overlap",
    "axes_of",
    "current",
    "dynamo_tracing",
    "enter",
    "env",
    "is_donated",
    "maybe_current",
    "note_uneven",
    "noted_uneven",
    "observe_scope",
    "observer",
    "overlap_allowed",
    "overlap_last",
    "overlapped_node",
    "prefetch_scope",
    "prefetching",
    "swap_context",
    "swap_overlap",
    "take_uneven",
    "trace_scope",
    "tracing",
    "transforms_active",
    "user_call",
    "user_call_name",
]

_local = threading.local()


@dataclass(frozen=True)
class DeviceContext:
    """Which device of which mesh is running, and whether varying axes are tracked."""

    mesh: Any
    device: Any  # a _backend.DeviceHandle
    check_vma: bool
    donated: frozenset[int] = frozenset()  # id() of the argument blocks donated to this call (written in place)
    #: an argument of this call is split unevenly (torch.tensor_split's blocks): the devices' blocks may differ in
    #: shape, so a collective that concatenates blocks first learns their sizes (even calls assume equal blocks)
    uneven: bool = False


def is_donated(*ts: Any) -> bool:
    """True when every one of ``ts`` is a block donated to the running ``shard_map`` call (``donate=``), so
    the call may write into it in place (the optimisers do). False outside shard_map.

    Example:
        >>> is_donated()  # outside shard_map
        False
    """
    ctx = getattr(_local, "ctx", None)
    if ctx is None or not ctx.donated or not ts:
        return False
    donated = ctx.donated
    for t in ts:  # (a loop: no generator's frame; asked for every leaf an optimiser updates)
        if id(t) not in donated:
            return False
    return True


def maybe_current() -> DeviceContext | None:
    """The context of the device this thread runs, or None outside shard_map."""
    return getattr(_local, "ctx", None)


def current(fn: str) -> DeviceContext:
    """The context of the running device.

    Raises:
        ShardingError: outside shard_map.
    """
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise ShardingError(
            f"{fn}: called outside shard_map; collectives name mesh axes and only exist while a device runs "
            f"a function under fs.shard_map(f, mesh=..., in_specs=..., out_specs=...). Call {fn} inside f."
        )
    return ctx


class enter(AbstractContextManager):  # used as a function: ``with enter(ctx):``
    """Make ``ctx`` current in this thread for the duration of the block (a plain class: entered on every
    ``shard_map`` call, where a generator-based context manager costs several frames)."""

    __slots__ = ("ctx", "prev")

    def __init__(self, ctx: DeviceContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> DeviceContext:
        self.prev = getattr(_local, "ctx", None)
        _local.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _local.ctx = self.prev


_ENV_DATA = getattr(os.environ, "_data", None)  # os.environ's own mapping (encoded keys and values), where it has one
_ENV_KEYS: dict[str, Any] = {}  # a variable's name -> its key in that mapping


def env(name: str) -> str | None:
    """``os.environ.get(name)``, read on every call as it would be, in one frame where the variable is unset (the
    usual case; ``os.environ.get`` costs three: its ``Mapping.get``, ``__getitem__`` and the key's encoding).

    Example:
        >>> env("FUNCSHARD_SURELY_UNSET") is None
        True
    """
    if _ENV_DATA is None or not hasattr(os.environ, "encodekey"):
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)  # type: ignore[attr-defined]
    value = _ENV_DATA.get(key)
    return None if value is None else os.environ.decodevalue(value)  # type: ignore[attr-defined]


def swap_context(ctx: DeviceContext | None) -> DeviceContext | None:
    """Make ``ctx`` current in this thread (None: none) and return the context it replaces: :class:`enter` as two
    calls, ``prev = swap_context(ctx)`` then ``swap_context(prev)`` in a ``finally`` (no context object made)."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    return prev


def axes_of(axis: Any, mesh: Any, fn: str) -> tuple[str, ...]:
    """Normalise ``axis`` (a name or a tuple of names) to a tuple, checked against the mesh.

    Raises:
        ShardingError: an axis the mesh lacks, an axis named twice, or an empty tuple.
    """
    # keyed by the mesh object (a Mesh's own hash is a Python call); the entry holds the mesh, so its id is not
    # reused while the entry is there
    key = (axis, id(mesh)) if isinstance(axis, (str, tuple)) else None
    try:
        hit = _AXES.get(key) if key is not None else None
    except TypeError:  # a tuple holding something unhashable: checked (and refused) below
        key = hit = None
    if hit is not None and hit[1] is mesh:  # checked before: the same name(s) on the same mesh
        return hit[0]
    axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ShardingError(
            f"{fn}: axis must be a mesh axis name or a non-empty tuple of names, found {axis!r}; "
            f"the mesh has {list(mesh.axis_names)}."
        )
    for a in axes:
        if a not in mesh.shape:
            raise ShardingError(
                f"{fn}: axis '{a}' is not an axis of the mesh {mesh.shape}; use one of {list(mesh.axis_names)}."
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(f"{fn}: axis tuple {axes} names an axis twice; name each axis once.")
    if key is not None:
        if len(_AXES) > 256:
            _AXES.clear()
        _AXES[key] = (axes, mesh)
    return axes


_AXES: dict[tuple[Any, int], tuple[tuple[str, ...], Any]] = {}  # (axis, id(mesh)) -> its checked axes, the mesh


# ---------------------------------------------------------------------- this thread's mode flags (scopes)

_scope = threading.local()


class _Flag(contextlib.AbstractContextManager):
    """Set this thread's scope flag ``name`` to ``on`` for the block, then restore it (a plain class: entered
    on every ``fs.value_and_grad`` call, where a generator-based context manager costs several frames)."""

    __slots__ = ("name", "on", "prev")

    def __init__(self, name: str, on: bool) -> None:
        self.name, self.on = name, on

    def __enter__(self) -> None:
        self.prev = getattr(_scope, self.name, False)
        setattr(_scope, self.name, self.on)

    def __exit__(self, *exc: object) -> None:
        setattr(_scope, self.name, self.prev)


class Overlap(contextlib.AbstractContextManager):
    """This thread's overlap flag on, and the backward node that runs last, for the block.

    Within it (``fs.value_and_grad``'s own ``torch.autograd.grad``), the dist backend may issue the backward's
    gradient reductions asynchronously: every gradient leaves through that call and is settled there (its pending
    result waited for), and inside the graph a pending result waits at its first use. A plain ``.backward()``,
    which stores gradients in ``.grad`` where nothing settles them, stays synchronous.

    ``last``: the graph's node that the backward runs last, when known (the engine runs ready nodes latest-made
    first, so the node made first in the forward runs after every other); a reduction it makes has nothing
    left to overlap with, and is made synchronously (cheaper: no pending result to wrap and wait for).

    Example:
        >>> with Overlap(None):
        ...     overlap_allowed()
        True
    """

    __slots__ = ("last", "prev")

    def __init__(self, last: Any) -> None:
        self.last = last

    def __enter__(self) -> None:
        self.prev = (getattr(_scope, "on", False), getattr(_scope, "last", None))
        _scope.on, _scope.last = True, self.last

    def __exit__(self, *exc: object) -> None:
        _scope.on, _scope.last = self.prev


#: the forward-mode AD level the runtime itself opened around a call's device threads (the sim backend: one level
#: for all the devices, see ``backends.sim``), -1 while none is: no tangent lives on it unless a ``torch.func.jvp``
#: runs inside it
_RUNTIME_LEVEL = [-1]


def swap_runtime_level(level: int) -> int:
    """Record ``level`` as the forward-mode AD level the runtime opened (-1: none) and return the one it replaces."""
    prev, _RUNTIME_LEVEL[0] = _RUNTIME_LEVEL[0], level
    return prev


def tangents_possible() -> bool:
    """Whether a tensor may carry a forward-mode tangent now: a forward AD level is open, and it is not only the
    runtime's own level with no ``torch.func.jvp`` running in it (where no tangent can exist, and asking each
    tensor for one, from every device thread at once, is work for nothing).

    Example:
        >>> tangents_possible()
        False
    """
    level = torch.autograd.forward_ad._current_level
    if level < 0:
        return False
    return level != _RUNTIME_LEVEL[0] or _eager.JVP_NESTING > 1


def swap_overlap(state: tuple[bool, Any]) -> tuple[bool, Any]:
    """Set this thread's overlap scope to ``state`` (``(on, last)``, as :class:`Overlap` sets it) and return the one
    it replaces: :class:`Overlap` as two calls, ``prev = swap_overlap((True, last))`` then ``swap_overlap(prev)``
    in a ``finally`` (no scope object made)."""
    prev = (getattr(_scope, "on", False), getattr(_scope, "last", None))
    _scope.on, _scope.last = state
    return prev


def overlap_allowed() -> bool:
    """Whether this thread is inside :class:`Overlap`."""
    return getattr(_scope, "on", False)


def overlap_last() -> Any:
    """The backward node :class:`Overlap` was told runs last (None: not known)."""
    return getattr(_scope, "last", None)


def overlapped_node() -> bool:
    """Whether this thread runs a backward node inside :class:`Overlap` that is not the one it was told runs last:
    a collective there may be issued and waited for later (:func:`overlap_allowed` and :func:`overlap_last`, asked
    in one call)."""
    if not getattr(_scope, "on", False):
        return False
    node = torch._C._current_autograd_node()
    return node is not None and node is not getattr(_scope, "last", None)


def prefetch_scope(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within it (``ops.fsdp_gather(..., prefetch=True)``), the dist backend's all-gathers return at once and are
    waited for where their result is first read (the gathered weights of the next layer travel while this
    layer computes)."""
    return _Flag("prefetch", on)


def prefetching() -> bool:
    """Whether this thread is inside :func:`prefetch_scope`."""
    return getattr(_scope, "prefetch", False)


def trace_scope() -> contextlib.AbstractContextManager[None]:
    """Within it (``shard_map(..., compile=...)`` recording a device's body into a graph), the dist backend's
    collectives are torch's functional collectives, which the graph records as ops (so the compiler sees them,
    and no pending result escapes), and the optimisers keep their step count a tensor (a Python number read
    from a tensor would be frozen into the graph)."""
    return _Flag("trace", True)


def tracing() -> bool:
    """Whether this thread records a body into a graph (:func:`trace_scope`)."""
    return getattr(_scope, "trace", False)


def observe_scope(obs: Any) -> contextlib.AbstractContextManager[None]:
    """Within it, :func:`observer` is ``obs``: an ahead-of-time analysis (``shard_map``'s ``lower``) watching a
    device's run, which the executor, ``fs.value_and_grad`` and the pipeline runtime tell what they do
    (``obs.device(dev, args)``: a device's run starts; ``obs.note(kind, tensors)``: these are ``"params"`` /
    ``"grads"``)."""
    return _Flag("observer", obs)


def observer() -> Any:
    """The analysis of :func:`observe_scope` watching this thread, or None."""
    return getattr(_scope, "observer", None) or None


class user_call(contextlib.AbstractContextManager):  # used as a function: ``with user_call("x"):``
    """Within it, this thread runs the public call ``name`` (``device_get``, ``checkpoint.save``): a collective
    inside that fails for want of its peers names that call, which the user wrote, besides its own (an
    ``all_gather`` the user never wrote). The outermost call wins.

    Example:
        >>> with user_call("device_get"):
        ...     with user_call("reshard"):
        ...         user_call_name()
        'device_get'
    """

    __slots__ = ("name", "prev")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.prev = getattr(_scope, "call", None)
        if self.prev is None:
            _scope.call = self.name

    def __exit__(self, *exc: object) -> None:
        _scope.call = self.prev


def user_call_name() -> str | None:
    """The public call this thread runs (:class:`user_call`), or None."""
    return getattr(_scope, "call", None)


#: whether ``torch.compile``'s dynamo is tracing the calling code (then a value read or an in-place write into
#: a buffer made outside the graph is not what it can hold: the functional paths are taken)
dynamo_tracing: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)

#: THE predicate for "may the fast path run?": whether a ``torch.func`` transform (grad, vjp, jvp, vmap) is active on
#: this thread. Its tensors are wrappers: no storage to read or write in place, no hand-made autograd node, no kept
#: buffer. Where a fast path has further conditions (:func:`tracing`, grad mode, an operand's flags) they are
#: spelled beside it at the call site. torch's own function, bound once (no Python frame added).
transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active


def note_uneven() -> None:
    """Note that the device this thread runs made a value whose blocks differ in shape between devices (an uneven
    ``psum_scatter``, a random draw of an uneven block): under ``"dist"``, where no process sees the others'
    blocks, the call's outputs are then assembled from the exchanged shapes (every process makes the same
    collectives and draws, so every process notes it)."""
    _scope.uneven = True


def noted_uneven() -> bool:
    """Whether :func:`note_uneven` was called on this thread in the running call (the flag stays)."""
    return getattr(_scope, "uneven", False)


def take_uneven() -> bool:
    """Whether :func:`note_uneven` was called on this thread since the last time this was asked (and forget it).

    Example:
        >>> take_uneven()
        False
    """
    if getattr(_scope, "uneven", False):
        _scope.uneven = False
        return True
    return False


_WRAPPED_NAMES = ("__module__", "__name__", "__qualname__", "__doc__")


def named_like(wrapper: Callable[..., Any], f: Any) -> Callable[..., Any]:
    """``wrapper`` given ``f``'s module, name, qualified name and docstring, and ``__wrapped__ = f``: what
    ``functools.wraps(f)`` gives, without reading ``f.__annotations__`` or copying ``f.__dict__``.

    Device threads wrap the same function at once (``fs.remat(block)`` in a body runs on every sim device), and
    CPython 3.11 builds a function's ``__annotations__`` dict on its first read from a tuple it does not hold a
    reference to: a thread that reads it while another one does can find the tuple freed and crash the process
    (seen as a segfault in ``functools.update_wrapper``). ``inspect.signature(wrapper)`` still follows
    ``__wrapped__`` to ``f``'s annotations, read where the caller asks for them.

    Example:
        >>> def block(x: int) -> int:
        ...     "Doubles."
        ...     return 2 * x
        >>> w = named_like(lambda x: block(x), block)
        >>> w.__name__, w.__doc__, w.__wrapped__ is block
        ('block', 'Doubles.', True)
    """
    for name in _WRAPPED_NAMES:
        try:
            value = getattr(f, name)
        except AttributeError:
            continue
        setattr(wrapper, name, value)
    wrapper.__wrapped__ = f  # type: ignore[attr-defined]
    return wrapper


_SETTLED: set[str] = set()  # the modules whose functions' annotations settle_annotations made dicts
_MODULES_SEEN = [0]  # len(sys.modules) at its last walk


def settle_annotations() -> None:
    """Make the ``__annotations__`` of the functions and methods of every loaded funcshard module dicts now, on
    the calling thread (each module walked once; nothing to do while no module was loaded since the last call).

    CPython 3.11 keeps a function's annotations as a tuple until their first read, and the thread that first
    reads them builds the dict from a tuple it holds no reference to: two device threads reading them at once
    (``functools.wraps``, ``inspect.signature``) can find it freed and crash the process. The sim backend calls
    this before it starts a call's device threads, so that no first read happens on them (see also
    :func:`settle_module`, :func:`named_like`).

    Example:
        >>> settle_annotations()
        >>> "funcshard._src.runtime.context" in _SETTLED
        True
    """
    if len(sys.modules) == _MODULES_SEEN[0]:
        return
    _MODULES_SEEN[0] = len(sys.modules)
    for name, found in list(sys.modules.items()):
        if name not in _SETTLED and found is not None and (name == "funcshard" or name.startswith("funcshard.")):
            _SETTLED.add(name)
            _settle_module(found, name)


def settle_module(f: Any) -> None:
    """:func:`settle_annotations` for the module of ``f`` (a user's function that ``shard_map`` maps: its helpers
    run on every sim device thread), walked every time (a notebook's ``__main__`` gains functions).

    Example:
        >>> settle_module(settle_module)
    """
    name = getattr(f, "__module__", None)
    found = sys.modules.get(name) if isinstance(name, str) else None
    if found is not None:
        _settle_module(found, name)


def _settle_module(module: types.ModuleType, name: str) -> None:
    """Read the annotations of the functions defined in ``module`` (named ``name``) and of its classes' methods."""
    for obj in list(vars(module).values()):
        if isinstance(obj, types.FunctionType):
            if obj.__module__ == name:
                obj.__annotations__  # noqa: B018 - the read builds the dict
        elif isinstance(obj, type) and vars(obj).get("__module__") == name:
            for member in list(vars(obj).values()):
                if isinstance(member, property):
                    methods = (member.fget, member.fset, member.fdel)
                elif isinstance(member, (staticmethod, classmethod)):
                    methods = (member.__func__,)
                else:
                    methods = (member,)
                for f in methods:
                    if isinstance(f, types.FunctionType):
                        f.__annotations__  # noqa: B018
