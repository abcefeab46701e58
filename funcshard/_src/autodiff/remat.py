"""``remat``: JAX's ``jax.checkpoint`` for funcshard. Activations recomputed in the backward, by policy.

``fs.remat(f, policy)(*args)`` computes ``f(*args)`` without keeping ``f``'s intermediates for the backward:
only the tensor arguments (and what ``policy`` names) are saved, and the backward runs ``f`` again on them to
rebuild its graph, then differentiates that. The numbers are those of ``f`` itself, bit for bit: the
recomputation runs the same ops on the same inputs (with the CPU / CUDA random state of the forward), and a
saved intermediate is the very tensor the forward computed.

How it is built (an ``autograd.Function``, so it works under ``torch.autograd``, ``fs.value_and_grad`` and
``torch.func.grad``, grad of grad included):

- forward: ``f`` runs on detached copies of the inputs (with their requires-grad flags and varying-axes
  tags) under a ``TorchDispatchMode`` that numbers every aten op and keeps the outputs of the ops ``policy``
  saves (``dots_saveable``: ``mm``, ``addmm``, ``bmm``, ...), and those marked by
  :func:`checkpoint_name` with a name the policy saves. The graph of this run is dropped at once.
- backward: ``f`` runs again on the saved inputs, under a mode that hands back the saved output of each op
  it numbered (no recomputation for them; the graph is still built, so their backward is exact) and computes
  the rest; then ``torch.autograd.grad`` of that graph gives the input gradients.

Memory: between the forward and the backward a region holds only its inputs and what the policy saves (the
forward's dropped graph saves nothing: see ``_save_nothing``; the call keeps no reference to its arguments); its
backward rebuilds one region at a time and frees it on return (its outputs are differentiated from their graph
edges, so the region's last result is not kept for it). Under ``dist`` with ``FUNCSHARD_OVERLAP`` a region's
backward waits for the previous region's in-flight gradient reductions once it has recomputed its own, so one
region's reduce-scatter inputs are in flight at a time (FSDP2's one), not every layer's.

Inside ``shard_map``: the recomputation runs in the device's context with its vma mode (``check_vma=True``:
the same ``pvary`` are inserted, so the gradients are those of the global function; the recomputed values
carry the same tags), and its collectives are **replayed**: every device recomputes the same region at the
same point of its backward, so they meet their peers under ``sim`` and ``dist`` alike, as JAX recomputes
them with ``nothing_saveable``. ``save_collectives=True`` keeps the results of ``f``'s collectives instead
(no communication in the recomputation, at the memory of those results): the choice for tensor-parallel
activations, not for FSDP's gathered weights (keeping those would undo ZeRO-3). ``fs.comm_stats`` counts the
collectives the recomputation runs or replays.

Under a ``torch.func`` transform (``grad``, ``vjp``) ``f`` is recomputed whole (policies only save memory, not
values), except inside ``shard_map``, where ``f`` is simply called (exact gradients, no memory saved;
``fs.value_and_grad`` runs on plain autograd, where remat works fully); under ``vmap`` / ``jvp`` / forward-mode AD,
and where no gradient can flow, ``f`` is simply called too. A tensor that requires grad must be an argument of
``f``: one closed over would get no gradient through the recomputation, so it raises :class:`~funcshard.ConfigError`
(under plain autograd).

Example:
    >>> import torch
    >>> from funcshard._src.autodiff.remat import remat, remat_policies
    >>> w = torch.randn(4, 4, requires_grad=True)
    >>> block = remat(lambda x, w: torch.tanh(x @ w) @ w, policy=remat_policies.dots_saveable)
    >>> block(torch.randn(2, 4), w).sum().backward()
    >>> w.grad.shape
    torch.Size([4, 4])
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..collectives.vma import VmaMode, find_vma, set_vma, settle, tag_leaves
from ..errors import ConfigError
from ..runtime.context import enter, maybe_current, named_like, transforms_active
from .grad import has_tangent, reaches_other_leaf

__all__ = ["Policy", "checkpoint_name", "remat", "remat_policies"]

_aten = torch.ops.aten
# matmul-like ops: their outputs are what ``dots_saveable`` keeps (F.linear / @ reach aten as these)
_DOTS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.convolution, _aten.dot})
# the same without a batch dim: the weight matmuls of a transformer, not attention's q @ k^T and p @ v
_DOTS_NO_BATCH = frozenset({_aten.mm, _aten.addmm, _aten.dot})
# not numbered by the forward's log nor by the replay: autograd itself dispatches a ``detach`` of an op's output
# that it saves for the backward (``rsqrt``, ``tanh``, ``exp``, ...), but only where no saved-tensor hook takes
# the tensor, which differs between the forward (its hook saves nothing) and the recomputation (no hook), so
# counting them put the replay off its numbering at the first such op and recomputed everything after it (the
# FLOPs and the memory of full remat, not the policy's). A detach makes a view: never saved, always recomputed.
_DETACH = _aten.detach.default


@dataclass(frozen=True)
class Policy:
    """What :func:`remat` keeps from the forward instead of recomputing it (see :data:`remat_policies`).

    Attributes:
        name: for messages and ``repr``.
        ops: aten op packets (``torch.ops.aten.mm``) whose outputs are saved; ``None``: every op's.
        names: names (of :func:`checkpoint_name`) whose values are saved.
        except_names: names whose values are recomputed even where ``ops`` would save them.
        everything: save everything: ``f`` runs as it is, nothing recomputed.

    Example:
        >>> remat_policies.save_only_these_names("attn_out")
        Policy(save_only_these_names('attn_out'))
    """

    name: str
    ops: frozenset[Any] | None = frozenset()
    names: frozenset[str] = frozenset()
    except_names: frozenset[str] = frozenset()
    everything: bool = False

    def __repr__(self) -> str:
        return f"Policy({self.name})"

    def saves_op(self, func: Any) -> bool:
        """Whether the output of aten op ``func`` (an ``OpOverload``) is saved."""
        return self.ops is None or func.overloadpacket in self.ops

    def saves_name(self, name: str) -> bool | None:
        """True: save the value named ``name``; False: recompute it; None: as its op decides."""
        if name in self.except_names:
            return False
        return True if name in self.names else None


def _names(fn: str, names: tuple[str, ...]) -> frozenset[str]:
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{fn}: give one or more non-empty string names, found {names!r}; e.g. {fn}('attn_out').")
    return frozenset(names)


class _Policies:
    """The remat policies, as ``jax.checkpoint_policies`` names them.

    - ``nothing_saveable``: save only the arguments; recompute everything (the default of :func:`remat`).
    - ``everything_saveable``: save everything; nothing is recomputed (``remat`` is then a plain call).
    - ``dots_saveable`` (alias ``checkpoint_dots``): save the outputs of matmuls (``mm``, ``addmm``, ``bmm``,
      ``baddbmm``, convolutions); recompute the cheap elementwise ops between them.
    - ``dots_with_no_batch_dims_saveable``: save the 2-D matmuls only (a transformer's weight matmuls), not
      the batched ones (attention's scores and its weighted sum): Megatron's "selective" recomputation.
    - ``save_only_these_names(*names)``: save the values marked ``checkpoint_name(x, name)`` with these names.
    - ``save_anything_except_these_names(*names)``: save every op's output but the values of these names.
    - ``save_from_both_policies(a, b)``: save what either policy saves.

    Example:
        >>> remat_policies.dots_saveable
        Policy(dots_saveable)
    """

    nothing_saveable = Policy("nothing_saveable")
    everything_saveable = Policy("everything_saveable", ops=None, everything=True)
    dots_saveable = Policy("dots_saveable", ops=_DOTS)
    checkpoint_dots = dots_saveable
    dots_with_no_batch_dims_saveable = Policy("dots_with_no_batch_dims_saveable", ops=_DOTS_NO_BATCH)

    @staticmethod
    def save_only_these_names(*names: str) -> Policy:
        """Save the values marked with these names (``checkpoint_name(x, name)``), recompute the rest.

        Example:
            >>> remat_policies.save_only_these_names("attn_out", "mlp_up").names == {"attn_out", "mlp_up"}
            True
        """
        found = _names("save_only_these_names", names)
        return Policy(f"save_only_these_names({', '.join(map(repr, sorted(found)))})", names=found)

    @staticmethod
    def save_anything_except_these_names(*names: str) -> Policy:
        """Save every op's output except the values marked with these names.

        Example:
            >>> remat_policies.save_anything_except_these_names("attn_out").except_names
            frozenset({'attn_out'})
        """
        found = _names("save_anything_except_these_names", names)
        return Policy(
            f"save_anything_except_these_names({', '.join(map(repr, sorted(found)))})", ops=None, except_names=found
        )

    @staticmethod
    def save_from_both_policies(a: Policy, b: Policy) -> Policy:
        """Save what ``a`` or ``b`` saves.

        Example:
            >>> p = remat_policies.save_from_both_policies(
            ...     remat_policies.dots_with_no_batch_dims_saveable, remat_policies.save_only_these_names("attn_out"))
            >>> p.names, torch.ops.aten.mm in p.ops
            (frozenset({'attn_out'}), True)
        """
        for p in (a, b):
            if not isinstance(p, Policy):
                raise ConfigError(f"save_from_both_policies: expected two remat policies, found {type(p).__name__}.")
        ops = None if a.ops is None or b.ops is None else a.ops | b.ops
        return Policy(
            f"save_from_both_policies({a.name}, {b.name})",
            ops=ops,
            names=a.names | b.names,
            except_names=(a.except_names | b.except_names) - (a.names | b.names),
            everything=a.everything or b.everything,
        )

    def __repr__(self) -> str:
        return "funcshard.remat_policies"


remat_policies = _Policies()


# ------------------------------------------------------------------------------------------ forward / replay
_TENSOR = object()  # stands for a tensor leaf of f's output
_local = threading.local()  # .recorder: the _Record of the remat forward this thread runs, if any


def _is_view_or_inplace(func: Any) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


class _Record(TorchDispatchMode):
    """The forward's op log: numbers every aten op (outside the collectives' own work) and keeps the outputs of
    those the policy saves, as detached aliases, unless they were written in place after they were saved.

    Until :meth:`result` the outputs are held themselves, not detached aliases: a tensor detached inside
    ``__torch_dispatch__`` (below autograd) gets a version counter of its own, which a later in-place write to
    the output does not move. Tensors sharing a storage under counters of their own (``_unsafe_view``: matmul's
    reshape of a batched product) are grouped: a write through any drops what was saved of all."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        self.count = 0
        self.funcs: list[Any] = []
        self.saved: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        self.producer: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        self.groups: list[list[tuple[torch.Tensor, int]]] = []  # (tensor, its version when grouped)
        self.group_of: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}  # id(tensor) -> (group, ref)
        self.key_group: dict[int, int] = {}  # op number -> the group of its output
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused or func is _DETACH:  # (not numbered: see _DETACH)
            return out
        k = self.count
        self.count += 1
        self.funcs.append(func)
        if isinstance(out, torch.Tensor) and not _is_view_or_inplace(func):
            self.producer[id(out)] = (k, weakref.ref(out))
            if func is _aten._unsafe_view.default:
                self.alias(args[0], out, k, self.policy.saves_op(func))
            if self.policy.saves_op(func):
                self.keep(k, out)
        return out

    def alias(self, src: torch.Tensor, out: torch.Tensor, k: int, saving: bool) -> None:
        """Group ``out`` (op ``k``) with ``src``, whose storage it shares under a version counter of its own,
        where either one's value is (or will be) saved: both are held until :meth:`result`, at no memory (the
        storage is saved)."""
        hit = self.group_of.get(id(src))
        if hit is not None and hit[1]() is src:
            g = hit[0]
        else:
            p = self.producer.get(id(src))
            kp = p[0] if p is not None and p[1]() is src else None
            if not saving and kp not in self.saved:
                return
            g = len(self.groups)
            self.groups.append([(src, src._version)])
            self.group_of[id(src)] = (g, weakref.ref(src))
            if kp is not None:
                self.key_group[kp] = g
        self.groups[g].append((out, out._version))
        self.group_of[id(out)] = (g, weakref.ref(out))
        self.key_group[k] = g

    def keep(self, k: int, out: torch.Tensor) -> None:
        self.saved[k] = out  # the tensor itself: its version moves with every in-place write (see the class)
        self.versions[k] = out._version

    def mark(self, x: torch.Tensor, name: str) -> None:
        """``checkpoint_name(x, name)``: save or drop the output of the op that produced ``x``."""
        decision = self.policy.saves_name(name)
        hit = self.producer.get(id(x))
        if decision is None or hit is None or hit[1]() is not x:
            return
        k = hit[0]
        if decision:
            self.keep(k, x)
        else:
            self.saved.pop(k, None)

    def result(self) -> tuple[list[int], list[torch.Tensor]]:
        """The op numbers and detached tensors to keep: those not written in place after they were saved (through
        no alias of their storage either). Lets go of the tensors held (and the forward graph they reach)."""
        written = {g for g, members in enumerate(self.groups) if any(t._version != v for t, v in members)}
        keys = [
            k
            for k in sorted(self.saved)
            if self.saved[k]._version == self.versions[k] and self.key_group.get(k) not in written
        ]
        with torch._C.DisableTorchFunction():
            kept = [self.saved[k].detach() for k in keys]
        self.release()
        return keys, kept

    def release(self) -> None:
        """Drop every tensor held (a graph node's context may hold the device handle, which holds this log)."""
        self.saved.clear()
        self.groups.clear()
        self.group_of.clear()
        self.key_group.clear()


class _Replay(TorchDispatchMode):
    """The recomputation: the op numbered ``k`` in the forward hands back its saved output (checked to be the
    same op of the same shape), every other op is computed."""

    def __init__(self, funcs: list[Any], saved: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.funcs, self.saved = funcs, saved
        self.count = 0
        self.paused = 0
        self.off = False  # the ops ran differently from the forward: compute everything from there on

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.paused or func is _DETACH:  # (not numbered: see _DETACH)
            return func(*args, **(kwargs or {}))
        k = self.count
        self.count += 1
        if not self.off and (k >= len(self.funcs) or self.funcs[k] is not func):
            self.off = True
        hit = None if self.off else self.saved.get(k)
        if hit is None:
            return func(*args, **(kwargs or {}))
        return hit.detach()


class _Devices:
    """The device handle ``f``'s collectives see during a remat forward or recomputation: the real one, except
    that it pauses the op log while the backend works and, with ``save_collectives``, records the results
    (forward) or hands them back without communicating (recomputation). Afterwards (``done``) it is the real
    device: the recomputed graph's backward collectives go through it."""

    _COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "ragged_all_to_all")

    def __init__(self, real: Any, log: Any, save: bool, results: list[torch.Tensor] | None = None) -> None:
        self._real, self._log, self._save = real, log, save
        self._replay = results is not None
        self.results: list[torch.Tensor] = list(results or [])
        self._next = 0
        self._done = False

    def done(self) -> None:
        self._done = True

    def __getattr__(self, name: str) -> Any:
        if name in ("inplace_sum", "pending_results") and not self._done:
            # inside the region, every sum is a plain all_reduce (below): one summed into its input's own buffer
            # (``psum_owned`` of a row-parallel matmul) would write into an output the policy saved, which the
            # recomputation then hands back already summed (and sums again); and the log is paused for it
            return False
        attr = getattr(self._real, name)
        if name not in self._COLLECTIVES:
            return attr

        def collective(x: torch.Tensor, *rest: Any) -> torch.Tensor:
            if self._done:
                return attr(x, *rest)
            if self._save and self._replay and self._next < len(self.results):
                y = self.results[self._next]
                self._next += 1
                return y.detach()
            self._log.paused += 1
            try:
                y = attr(x, *rest)
            finally:
                self._log.paused -= 1
            if self._save and not self._replay:
                self.results.append(y.detach())
            return y

        return named_like(collective, attr)  # (not functools.wraps: see named_like)


@contextmanager
def device_scope(dctx: Any, devices: _Devices | None, vma_mode: Any) -> Iterator[None]:
    """The device's context (its collectives through ``devices``) and its vma mode, where not already active."""
    ctx_cm = nullcontext() if dctx is None else enter(dataclasses.replace(dctx, device=devices or dctx.device))
    active = torch.overrides._get_current_function_mode_stack()
    need_mode = vma_mode is not None and not any(isinstance(m, VmaMode) for m in active)
    with ctx_cm, copy.copy(vma_mode) if need_mode else nullcontext():
        yield


def checkpoint_name(x: Any, name: str) -> Any:
    """Mark ``x`` (a tensor, or a pytree of them) with ``name`` for :func:`remat` policies; returns ``x``.

    Under ``remat(f, policy=remat_policies.save_only_these_names(name))`` the marked value is kept from the
    forward instead of recomputed; elsewhere this is the identity, as ``jax.ad_checkpoint.checkpoint_name``.

    Example:
        >>> h = checkpoint_name(torch.ones(2) * 3, "attn_out")
        >>> h
        tensor([3., 3.])
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"checkpoint_name: name must be a non-empty string, found {name!r}.")
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        for t in optree.tree_leaves(x):
            if isinstance(t, torch.Tensor):
                rec.mark(t, name)
    return x


# ------------------------------------------------------------------------------------------ the Function
@dataclass
class _Call:
    """What one remat call shares between its forward and backward."""

    f: Callable[..., Any]
    policy: Policy
    save_collectives: bool
    rebuild: Callable[[list[Any]], tuple[tuple[Any, ...], dict[str, Any]]]  # tensor leaves -> (args, kwargs)
    in_tags: list[frozenset[str] | None]
    cache: bool  # plain autograd (op log and saved outputs); False under torch.func: recompute whole
    dctx: Any
    vma_mode: Any
    out_def: Any = None
    out_leaves: list[Any] = dataclasses.field(default_factory=list)  # non-tensor outputs (tensors: None)
    out_tags: list[frozenset[str] | None] = dataclasses.field(default_factory=list)
    funcs: list[Any] = dataclasses.field(default_factory=list)
    keys: list[int] = dataclasses.field(default_factory=list)
    n_collectives: int = 0
    rng: Any = None


def _save_nothing() -> Any:
    """Saved-tensor hooks for the remat forward's graph, which is dropped unused: it saves nothing (so its
    activations are freed as soon as the forward no longer needs them) and runs no user hook (e.g. CPU offloading).

    The hook must not hand back the tensor itself: a tensor an op saves of its own output (``tanh``, ``exp``,
    softmax, attention's output and log-sum-exp) would then hold its ``grad_fn``, which holds it: a cycle through
    C++ that Python's collector cannot see, and every layer's activations would outlive the step.
    """
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never)


def _drop(t: torch.Tensor) -> None:
    return None


def _never(packed: None) -> torch.Tensor:
    raise RuntimeError("remat: the forward's graph is only walked, never differentiated")  # not reached


def _copies(xs: tuple[torch.Tensor, ...], tags: list[frozenset[str] | None], grad: list[bool]) -> list[torch.Tensor]:
    """Detached copies of ``xs`` that require grad where ``grad`` says, with the tags of the originals."""
    out = []
    with torch._C.DisableTorchFunction():
        for x, v, g in zip(xs, tags, grad, strict=True):
            c = x.detach().requires_grad_(g and (x.is_floating_point() or x.is_complex()))
            if v is not None:
                set_vma(c, v)
            out.append(c)
    return out


class _Remat(torch.autograd.Function):
    @staticmethod
    def forward(call: _Call, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        if not call.cache:  # under torch.func: its forward is no place for our modes; f runs as it is
            args, kwargs = call.rebuild(list(xs))
            with device_scope(call.dctx, None, call.vma_mode):  # torch.func runs this without the vma mode
                return tuple(_flatten_out(call, call.f(*args, **kwargs)))
        call.rng = torch.get_rng_state()
        ins = _copies(xs, call.in_tags, [x.requires_grad for x in xs])
        args, kwargs = call.rebuild(ins)
        rec = _Record(call.policy)
        devices = _Devices(call.dctx.device, rec, call.save_collectives) if call.dctx is not None else None
        prev = getattr(_local, "recorder", None)
        _local.recorder = rec
        try:
            # under grad, as the recomputation will run: the same ops reach aten (matmul folds by requires_grad)
            # (a graph dropped at once: a user's saved-tensor hooks, such as CPU offloading, are not run for it)
            with torch.enable_grad(), device_scope(call.dctx, devices, call.vma_mode), _save_nothing(), rec:
                out = call.f(*args, **kwargs)
        except BaseException:
            rec.release()
            raise
        finally:
            _local.recorder = prev
        if devices is not None:
            devices.done()
        flat = _flatten_out(call, out)
        if reaches_other_leaf([t for t in flat if t.requires_grad], ins):
            raise ConfigError(
                f"remat({getattr(call.f, '__name__', 'f')}): f uses a tensor that requires grad but is not one of "
                f"its arguments (a closed-over parameter); its gradient would be lost in the recomputation. Pass "
                f"it as an argument: fs.remat(lambda x, w: ...)(x, w)."
            )
        call.funcs = rec.funcs
        call.keys, saved = rec.result()
        collectives = devices.results if devices is not None else []
        call.n_collectives = len(collectives)
        with torch._C.DisableTorchFunction():
            outs = tuple(t.detach() for t in flat)
        return (*outs, *saved, *collectives)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        call = inputs[0]
        xs = inputs[1:]
        n_out = len(output) - len(call.keys) - call.n_collectives
        extra = output[n_out:]
        ctx.call, ctx.n_in, ctx.n_out = call, len(xs), n_out
        if extra:
            ctx.mark_non_differentiable(*extra)
        ctx.save_for_backward(*xs, *extra)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        xs, extra = saved[: ctx.n_in], saved[ctx.n_in :]
        needs = list(ctx.needs_input_grad[1:])
        create_graph = torch.is_grad_enabled()  # a higher derivative: keep the recomputed graph's own graph
        with torch.enable_grad():
            if create_graph:  # the saved inputs themselves (their history is wanted), tagged as they were
                with torch._C.DisableTorchFunction():
                    ins = [x.view_as(x) for x in xs]
                tag_leaves(ins, call.in_tags)
            else:
                ins = _copies(xs, call.in_tags, needs)
            args, kwargs = call.rebuild(ins)
            n_keys = len(call.keys)
            log: Any = _Replay(call.funcs, dict(zip(call.keys, extra[:n_keys], strict=True)))
            if not call.cache:
                log = _Replay([], {})
            results = list(extra[n_keys:])
            devices = None
            if call.dctx is not None:
                devices = _Devices(call.dctx.device, log, call.save_collectives, results)
            with torch.random.fork_rng(devices=[]):
                if call.rng is not None:
                    torch.set_rng_state(call.rng)
                with (
                    device_scope(call.dctx, devices, call.vma_mode),
                    log if call.cache else nullcontext(),
                ):
                    out = call.f(*args, **kwargs)
            if devices is not None:
                devices.done()
            # the previous region's reductions travelled while this one was recomputed; wait for them before
            # this one's backward makes its own gradients (so one region's buckets are in flight, not all)
            _settle_previous()
            flat = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            del out
            # the recomputed outputs' own memory is not needed for their backward: differentiate from their
            # graph edges, so an output no op saved (a block's last residual add) is freed before the backward
            pairs = [
                (_edge(o), g if g is not None else torch.zeros_like(o))
                for o, g in zip(flat, grads[: ctx.n_out], strict=True)
                if o.requires_grad
            ]
            del flat
            wrt = [x for x, n in zip(ins, needs, strict=True) if n and x.requires_grad]
            found: tuple[torch.Tensor | None, ...] = ()
            if pairs and wrt:
                with device_scope(call.dctx, None, call.vma_mode):
                    found = torch.autograd.grad(
                        [o for o, _ in pairs],
                        wrt,
                        [g for _, g in pairs],
                        allow_unused=True,
                        create_graph=create_graph,
                    )
        _hold_pending(found)
        it = iter(found)
        result: list[torch.Tensor | None] = [None]
        for x, n in zip(ins, needs, strict=True):
            result.append(next(it, None) if n and x.requires_grad else None)
        return tuple(result)


def _hold_pending(grads: tuple[torch.Tensor | None, ...]) -> None:
    """Note the gradients of this backward that are still in flight (dist's overlapped reduce-scatters, e.g.
    FSDP's, issued inside the recomputed region), for the next remat backward to settle."""
    pending = [weakref.ref(g) for g in grads if g is not None and type(g).__name__ == "AsyncCollectiveTensor"]
    _local.pending = pending or None


def _settle_previous() -> None:
    """Wait for the reductions the previous remat backward of this thread left in flight: one region's
    gradient reductions travel while the next region is recomputed, as FSDP2 keeps one reduce-scatter in flight,
    not all of them; each holds its full-size input (a layer's gradient bucket) until it is waited for."""
    pending, _local.pending = getattr(_local, "pending", None), None
    for ref in pending or ():
        g = ref()
        if g is not None:
            settle(g)


def _edge(t: torch.Tensor) -> Any:
    """Where ``t``'s gradient enters its graph (the tensor itself for a leaf, e.g. an argument handed back)."""
    return t if t.grad_fn is None else torch.autograd.graph.get_gradient_edge(t)


def _flatten_out(call: _Call, out: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``f``'s output; its structure, non-tensor leaves and tags go on ``call``."""
    leaves, treedef = optree.tree_flatten(out, none_is_leaf=True)
    call.out_def = treedef
    call.out_leaves = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
    call.out_tags = [find_vma(t) for t in leaves if isinstance(t, torch.Tensor)]
    return [t for t in leaves if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------------------------------ the transform
def only_grad_transforms() -> bool | None:
    """None: no torch.func transform; True: only ``grad`` levels; False: another (vmap, jvp, functionalize)."""
    if not transforms_active():
        return None
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return all(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters())


def current_vma_mode() -> Any:
    for m in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(m, VmaMode):
            return m
    return None


def remat(
    f: Callable[..., Any],
    policy: Policy | None = None,
    *,
    prevent_cse: bool = True,
    save_collectives: bool = False,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable[..., Any]:
    """``f`` with its activations recomputed in the backward instead of kept: JAX's ``jax.checkpoint``.

    The result is a function of the same arguments returning the same values; its gradients (through
    ``torch.autograd``, ``fs.value_and_grad`` or ``torch.func.grad``) equal those of ``f``, bitwise where the
    ops are the same. Between the forward and the backward it keeps only ``f``'s tensor arguments and what
    ``policy`` saves. Usable inside ``shard_map`` with collectives in ``f`` (replayed in the recomputation on
    every device alike, or kept with ``save_collectives``), with ``check_vma`` on or off.

    Args:
        f: the function to recompute; every tensor it needs a gradient for must be an argument (pytrees of
            tensors are fine: ``remat(layer)(x, layer_params)``).
        policy: what to keep from the forward: one of :data:`remat_policies` (default ``nothing_saveable``).
        prevent_cse: accepted for JAX compatibility; eager PyTorch does no common-subexpression elimination.
        save_collectives: keep the results of ``f``'s collectives, so the recomputation does not communicate.
        static_argnums: accepted for JAX compatibility: the positional arguments that are Python values (every
            non-tensor argument is passed through as it is, static already); one of them being a tensor raises.

    Returns:
        The rematerialising function (usable as a decorator through ``functools.partial``).

    Raises:
        ConfigError: ``f`` not callable, a policy that is not a :class:`Policy`; at run time, a tensor that
            requires grad reached by closure instead of as an argument.

    Example:
        >>> x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
        >>> mlp = lambda x, w: torch.relu(x @ w) @ w.T
        >>> y = remat(mlp, policy=remat_policies.nothing_saveable)(x, w)
        >>> torch.equal(y, mlp(x, w))
        True
    """
    if not callable(f):
        raise ConfigError(f"remat: expected a function as first argument, found {type(f).__name__}.")
    policy = remat_policies.nothing_saveable if policy is None else policy
    if not isinstance(policy, Policy):
        raise ConfigError(
            f"remat: policy must be one of fs.remat_policies (e.g. fs.remat_policies.dots_saveable), found {policy!r}."
        )
    if not isinstance(prevent_cse, bool) or not isinstance(save_collectives, bool):
        raise ConfigError("remat: prevent_cse and save_collectives must be True or False.")
    static = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
    if not isinstance(static, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in static):
        raise ConfigError(f"remat: static_argnums must be an int or a tuple of ints, found {static_argnums!r}.")

    return _rematerialising(f, policy, save_collectives, static)


def _rematerialising(
    f: Callable[..., Any], policy: Policy, save_collectives: bool, static: tuple[int, ...]
) -> Callable[..., Any]:
    """The function :func:`remat` returns, for its checked arguments: each call checks its static arguments, runs
    ``f`` as it is where nothing is to be saved (no gradient wanted, ``policy`` saves everything, vmap / jvp
    around), else through :class:`_Remat` on the tensors among its arguments."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for i in static:
            if not -len(args) <= i < len(args) or isinstance(args[i], torch.Tensor):
                what = "a tensor" if -len(args) <= i < len(args) else f"missing ({len(args)} positional arguments)"
                raise ConfigError(
                    f"remat({getattr(f, '__name__', 'f')}): static_argnums names argument {i}, which is {what}; "
                    f"static arguments are Python values (as JAX's must be hashable), tensors are differentiated."
                )
        if policy.everything or not torch.is_grad_enabled() or has_tangent((args, kwargs)):
            return f(*args, **kwargs)
        transforms = only_grad_transforms()
        if transforms is False:  # vmap / jvp around: nothing to save memory for at this level
            return f(*args, **kwargs)
        if transforms and maybe_current() is not None:
            # torch.func.grad inside shard_map: the recomputation's collectives and pvary under torch.func's
            # backward are not exact yet (a known gap): f runs as it is, the gradients stay exact
            return f(*args, **kwargs)
        leaves, treedef = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        pos = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        xs = tuple(leaves[i] for i in pos)
        if not any(x.requires_grad for x in xs):
            return f(*args, **kwargs)

        # the call outlives its backward (autograd keeps every node until the whole backward is done), so it
        # must not hold the arguments: only their places (the tensors are saved for the backward, and released
        # by autograd once this node's backward has run)
        skeleton = [None if isinstance(t, torch.Tensor) else t for t in leaves]

        def rebuild(tensors: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            new = list(skeleton)
            for i, t in zip(pos, tensors, strict=True):
                new[i] = t
            return optree.tree_unflatten(treedef, new)

        call = _Call(
            f=f,
            policy=policy,
            save_collectives=save_collectives,
            rebuild=rebuild,
            in_tags=[find_vma(x) for x in xs],
            cache=transforms is None,
            dctx=maybe_current(),
            vma_mode=current_vma_mode(),
        )
        outs = _Remat.apply(call, *xs)
        n = len(call.out_tags)
        outs = outs[:n]
        tag_leaves(list(outs), call.out_tags)
        it = iter(outs)
        return optree.tree_unflatten(call.out_def, [next(it) if t is _TENSOR else t for t in call.out_leaves])

    # not functools.wraps: every device thread wraps the same f at once, and reading f's annotations from several
    # threads can crash CPython 3.11 (named_like)
    return named_like(wrapped, f)
