"""Live tensor bytes, counted exactly in-process: the memory tests' measure (RSS is noisy, tracemalloc blind).

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every aten op's outputs and counts each new storage's
bytes until the storage is freed (a weakref finaliser on it): ``live`` now, ``peak`` since the last
:meth:`LiveBytes.reset`. Only new storages count: views, in-place and ``out=`` results (whose schema says they
alias an input) are skipped, so storages made before the mode was entered are never counted; a wrapper subclass
(a pending collective's ``AsyncCollectiveTensor``) counts as the tensors it wraps. Everything torch
computes in this thread while the mode is on is seen: the forward, the autograd engine's backward on CPU (it
runs in the calling thread), and the ops a ``TorchDispatchMode`` nested inside (``fs.remat``'s) passes on.
Under ``sim`` each simulated device is a thread: :class:`PerThread` gives every thread its own count.

Example:
    >>> import torch
    >>> with LiveBytes() as m:
    ...     y = torch.ones(256).sin()  # two new storages of 1 KiB
    ...     del y
    >>> m.peak, m.live
    (2048, 0)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from funcshard._src.runtime.context import maybe_current

__all__ = ["LiveBytes", "PerThread"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that aten ops create while the mode is on, until each is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Start a new peak from what is live now."""
        with self._lock:
            self.peak = self.live

    def _freed(self, key: int, n: int) -> None:
        with self._lock:
            self.live -= n
            self._seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view, an in-place or out= result: the storage of an input, not a new one
        for t in _plain_tensors(optree.tree_leaves(out)):
            storage = t.untyped_storage()
            key, n = id(storage), storage.nbytes()
            with self._lock:
                if key in self._seen:
                    continue
                self._seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, n)
        return out


def _plain_tensors(leaves: list[Any]) -> list[torch.Tensor]:
    """The tensors among ``leaves`` that hold memory: a wrapper subclass (the ``AsyncCollectiveTensor`` of a
    pending collective) stands for the tensors inside it; its own storage is a placeholder with a size and no
    memory, which would count once more what the inner tensor already holds."""
    out = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            out += _plain_tensors([getattr(t, a) for a in attrs])
        else:
            out.append(t)
    return out


class PerThread:
    """One :class:`LiveBytes` per thread that runs a function wrapped by :meth:`wrap` (a device under ``sim``),
    listed by the rank of the device the thread runs (inside ``shard_map``; else by thread-start order), so that two
    runs' lists pair the same devices whichever thread got to the count first.

    Example:
        >>> counts = PerThread()
        >>> counts.wrap(lambda: torch.ones(4).sin())().shape
        torch.Size([4])
        >>> [m.peak for m in counts.modes.values()]
        [32]
    """

    def __init__(self) -> None:
        self.modes: dict[int, LiveBytes] = {}
        self.ranks: dict[int, int] = {}  # thread -> the rank of the device it runs
        self._lock = threading.Lock()

    def wrap(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """``f`` run under this thread's count."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            me, ctx = threading.get_ident(), maybe_current()
            with self._lock:
                mode = self.modes.setdefault(me, LiveBytes())
                self.ranks[me] = len(self.ranks) if ctx is None else ctx.device.rank
            with mode:
                return f(*args, **kwargs)

        return counted

    def threads(self) -> list[int]:
        """The threads counted, in the order of their devices' ranks."""
        return sorted(self.modes, key=self.ranks.__getitem__)

    def peaks(self) -> list[int]:
        """Each thread's peak, in the order of its device's rank."""
        return [self.modes[k].peak for k in self.threads()]
