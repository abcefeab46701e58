"""The collectives as autograd Functions over a device handle, each with its transpose, tangent and batching rule.

Each works on the leading-group-dim form of the backends (see ``_backend``): all-reduce and ppermute
``[*s] -> [*s]``, all-gather ``[*s] -> [n, *s]``, reduce-scatter ``[n, *s] -> [*s]``, all-to-all
``[n, *s] -> [n, *s]``. ``lax`` builds the public collectives (dims, tiling, pytrees, varying-axes tags) on
top of these.

Every Function has the four rules torch needs to compose with every transform, and the varying-axes rule
funcshard needs (``vma``, with ``operand_varies``: see ``_vma.bind``), so a new collective cannot forget one:

- ``forward``: the communication itself (counted by ``fs.comm_stats``).
- ``backward`` (``torch.autograd``, ``torch.func.grad`` / ``vjp`` / ``jacrev``): the transpose, as JAX's
  ``lax/parallel.py`` defines it. It calls the Functions again, so higher derivatives work.
- ``jvp`` (``torch.autograd.forward_ad``, ``torch.func.jvp`` / ``jacfwd`` / ``hessian``): the tangent rule
  JAX uses. The collectives are linear, so the tangent goes through the same collective; ``pmax`` / ``pmin``
  take the tangent of the device(s) holding the extreme, averaged over ties (the backward's even split).
- ``vmap`` (``torch.vmap``, ``torch.func.jacfwd`` / ``jacrev``, per-sample gradients): the batch dim is moved
  right after the group dim (or to the front) and the collective runs ONCE on the whole batch; every device
  of the group runs the same program, so every device makes the same batched call. An operand that is not
  batched at this level never reaches the rule (torch calls the plain Function).

All use the ``setup_context`` form, so the ``torch.func`` transforms see them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch._functorch.autograd_function import custom_function_call as _custom_function_call
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead

from ..runtime.context import observer, tracing, transforms_active
from ..runtime.stats import record

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

if TYPE_CHECKING:
    from torch._functorch.autograd_function import VmapInfo

__all__ = [
    "AllGather",
    "AllGatherInvariant",
    "AllReduce",
    "AllReduceOwned",
    "AllReducePending",
    "AllToAll",
    "BucketPool",
    "Ppermute",
    "Prim",
    "Pvary",
    "PvaryBucket",
    "ReduceScatter",
    "SplitInvariant",
    "call",
    "call_on",
    "group_size",
]

_Dims = tuple[int | None, ...]


def call(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` without its per-call ``inspect.signature`` (all our arguments are positional, so there
    are no defaults to bind): ~3 us instead of ~13 us outside torch.func, and under a torch.func transform
    straight to the ``custom_function_call`` that ``Function.apply`` ends in there.

    The C++ ``apply`` it calls outside torch.func is the one ``Function.apply`` ends in: it records the backward
    and, when a ``torch.autograd.forward_ad`` level is active and an input is a dual tensor, calls the ``jvp``
    rule.
    """
    if transforms_active():
        return _custom_function_call(fn, *args)
    for a in args:  # a dead torch.func wrapper (escaped from a finished transform) is unwrapped, as apply does
        if isinstance(a, torch.Tensor) and _is_wrapped(a):
            args = _unwrap_dead(args)
            break
    apply = _APPLY.get(fn)
    if apply is None:
        apply = _APPLY[fn] = super(torch.autograd.Function, fn).apply  # type: ignore[misc]
    return apply(*args)


def call_on(fn: type[torch.autograd.Function], x: torch.Tensor, *rest: Any) -> Any:
    """:func:`call` of ``fn`` on one tensor operand ``x`` and arguments ``rest`` that hold no tensor (a device, axes,
    names): only ``x`` is looked at for a dead torch.func wrapper."""
    if transforms_active():
        return _custom_function_call(fn, x, *rest)
    if _is_wrapped(x):  # a dead torch.func wrapper (escaped from a finished transform) is unwrapped, as apply does
        (x,) = _unwrap_dead((x,))
    apply = _APPLY.get(fn)
    if apply is None:
        apply = _APPLY[fn] = super(torch.autograd.Function, fn).apply  # type: ignore[misc]
    return apply(x, *rest)


#: per Function class, the C++ ``apply`` bound to it (``super(Function, cls).apply``: a super object and a bound
#: method made on every call otherwise); classes are few and live as long as the module that defines them
_APPLY: dict[type, Any] = {}


def _no_graph() -> bool:
    """Whether a Function applied now records nothing: grad mode off, no torch.func transform and no forward-mode
    AD level (whose dual tensors the C++ ``apply`` would hand to the ``jvp`` rule). A backward that is not
    differentiated (``create_graph=False``, the train step's) runs so; a collective there may call its forward
    directly: the same result, without the ``apply`` (its context object, ``setup_context``)."""
    return not _grad_enabled() and _fwd_ad._current_level < 0 and not transforms_active()


_grad_enabled = torch.is_grad_enabled
_fwd_ad = torch.autograd.forward_ad


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _to(x: torch.Tensor, bd: int | None, dim: int) -> torch.Tensor:
    """``x`` with its vmapped batch dim ``bd`` moved to ``dim`` (a view).

    torch calls a ``vmap`` rule only when some operand is batched at its level, and ``x`` is the only tensor
    operand of the rules that call this, so ``bd`` is never None here.
    """
    assert bd is not None, "a vmap rule was called with its only tensor operand unbatched"
    return x if bd == dim else x.movedim(bd, dim)


def group_size(dev: Any, axes: tuple[str, ...]) -> int:
    """How many devices the group of ``dev`` over ``axes`` has."""
    shape = dev.mesh.shape
    n = 1
    for a in axes:
        n *= shape[a]
    return n


class Prim(torch.autograd.Function):
    """Base of the collectives' Functions: ``apply`` is :func:`call` (no ``inspect.signature`` per call).

    Under a torch.func transform, torch's ``custom_function_call`` ends each level by calling the Function's
    ``apply`` on the unwrapped operands; ``Function.apply`` would bind the arguments to ``forward``'s
    signature there, every call. Ours are all positional, with no defaults: nothing to bind.
    """

    @classmethod
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        """``cls``'s forward on ``args``, recorded for autograd (and torch.func) as ``Function.apply`` does."""
        return call(cls, *args)


# for the other modules of collectives (``_prims_cast``): the same helpers under public names
Dims = _Dims
nbytes = _nbytes
move_batch = _to


class AllReduce(Prim):
    """All-reduce ``[*s] -> [*s]`` with ``op`` in ``"sum"``, ``"max"``, ``"min"`` (``name`` is the public
    collective it stands for, for the communication counts).

    - forward: ``y = reduce_op over the group of x``.
    - backward: sum: ``g`` (identity per device: the transpose ``pvary``); max / min: ``pvary(g) * m / psum(m)``
      with ``m = (x == y)``, the cotangent split evenly between the devices holding the extreme.
    - jvp: sum: ``psum(t)``; max / min: ``psum(t * m) / psum(m)``, the tangent of the arg-extreme averaged
      over ties (one all-reduce of both stacked).
    - vmap: elementwise, so the batch moves to the front and one all-reduce reduces the whole batch.
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: the result is the same on every member: invariant over ``axes``."""
        return have - axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], op: str, name: str) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, name, axes, x.nbytes)
        return dev.all_reduce(x, axes, op)  # [*s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, dev, axes, op, name = inputs
        ctx.dev, ctx.axes, ctx.op, ctx.name = dev, axes, op, name
        if op != "sum":
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.op == "sum":  # the transpose is pvary: identity here, and a psum when this backward is differentiated
            if not torch.is_grad_enabled() and not transforms_active():
                return g, None, None, None, None  # not differentiated (no graph recorded): the identity itself
            return call_on(Pvary, g, ctx.dev, ctx.axes), None, None, None, None  # [*s] -> [*s]
        x, y = ctx.saved_tensors
        mask = (x == y).to(g.dtype)
        count = call(AllReduce, mask, ctx.dev, ctx.axes, "sum", "psum")  # [*s] -> [*s]: devices at the extreme
        # g is invariant and meets the varying mask: pvary'd (identity here), so that differentiating this
        # backward sums the partial cotangents of g's copies (without it a second derivative is 1/n of the truth)
        g = call(Pvary, g, ctx.dev, ctx.axes)  # [*s] -> [*s]
        return g * mask / count, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        if ctx.op == "sum":
            return call(AllReduce, t, ctx.dev, ctx.axes, "sum", ctx.name)  # [*s] -> [*s]
        x, y = ctx.saved_tensors
        mask = (x == y).to(t.dtype)
        both = call(AllReduce, torch.stack((t * mask, mask)), ctx.dev, ctx.axes, "sum", "psum")  # [2, *s] -> [2, *s]
        return both[0] / both[1]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...], op: str, name: str
    ) -> tuple[torch.Tensor, int]:
        y = call(AllReduce, _to(x, in_dims[0], 0), dev, axes, op, name)  # [B, *s] -> [B, *s]
        return y, 0


class AllReduceOwned(AllReduce):
    """:class:`AllReduce` sum of a temporary its caller gives up (a row-parallel matmul's partial sums, which no
    one else holds and no backward saves): summed in place where the backend can (``all_reduce_inplace``), with
    no copy of it. The rules are :class:`AllReduce`'s (its backward, tangent and batching make plain all-reduces).

    - forward: ``y = sum over the group of x``, written into ``x``'s buffer.
    """

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], op: str, name: str) -> torch.Tensor:  # type: ignore[override]
        if not dev.inplace_sum or op != "sum" or not x.is_contiguous():
            return AllReduce.forward(x, dev, axes, op, name)
        record(dev.rank, name, axes, _nbytes(x))
        return dev.all_reduce_inplace(x, axes)  # [*s] -> [*s], in x's buffer


class AllReducePending(AllReduce):
    """:class:`AllReduce` sum whose result may come back pending (``all_reduce_pending``: under ``dist`` issued
    now and waited for at its first use), for a sum whose value is read later than it can be issued (the
    Llama loss's token count and its mean). The rules are :class:`AllReduce`'s.

    - forward: ``y = sum over the group of x`` (a pending result where the backend has one).
    """

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], op: str, name: str) -> torch.Tensor:  # type: ignore[override]
        if not dev.pending_results or op != "sum":
            return AllReduce.forward(x, dev, axes, op, name)
        record(dev.rank, name, axes, _nbytes(x))
        return dev.all_reduce_pending(x, axes)  # [*s] -> [*s] (pending)


class Pvary(Prim):
    """Mark a value varying over ``axes``.

    - forward: ``y = x`` (a view; the value becomes varying over ``axes``).
    - backward: ``psum(g)`` over ``axes``.
    - jvp: ``pvary(t)`` (identity in value; a later reverse pass through the tangent sums it).
    - vmap: ``pvary`` of the batched value, its batch dim where it was.
    """

    #: vma: the operand is taken as it is (no ``Pvary`` first)
    operand_varies = False

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: the result varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # (_no_graph(), written out) this backward is not differentiated: the sum itself, no Function to record
        if not _grad_enabled() and _fwd_ad._current_level < 0 and not transforms_active():
            dev = ctx.dev
            if dev.inplace_sum and _given_up(g):  # Megatron's backward all-reduce: in the cotangent's own buffer
                record(dev.rank, "psum", ctx.axes, g.nbytes)
                return dev.all_reduce_inplace(g, ctx.axes), None, None  # [*s] -> [*s], in g's buffer
            return AllReduce.forward(g, dev, ctx.axes, "sum", "psum"), None, None  # [*s] -> [*s]
        return call(AllReduce, g, ctx.dev, ctx.axes, "sum", "psum"), None, None  # [*s] -> [*s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(Pvary, t, ctx.dev, ctx.axes)  # [*s] -> [*s]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...]
    ) -> tuple[torch.Tensor, int | None]:
        return call(Pvary, x, dev, axes), in_dims[0]  # [.., B, ..] -> [.., B, ..]


def _given_up(g: torch.Tensor) -> bool:
    """Whether the cotangent ``g`` a ``backward`` was handed (and passes on as it came) is seen by that backward
    alone, so that it may be summed in place: its Python object held as a fresh cotangent's is (no hook kept it),
    its C++ tensor by that object only (no other node's input, nothing saved it), its memory by ``g`` only (no view,
    no copy sharing it; the storage object made to ask is the second holder), as :func:`_cotangent_refs` found at
    import. Called from the backward itself, before ``g`` is passed anywhere else."""
    if _getrefcount(g) != _BWD_REFS or type(g) is not torch.Tensor or transforms_active() or _is_wrapped(g):
        return False
    if g._use_count() != 1 or g._base is not None or not g.is_contiguous():
        return False  # (a ZeroTensor passes: all_reduce_inplace sums it out of place)
    return torch._C._storage_Use_Count(g.untyped_storage()._cdata) == 2


_getrefcount = sys.getrefcount


def _refs(g: torch.Tensor) -> int:
    """The references ``g`` has inside a function a backward passes it to (as :func:`_given_up`'s ``g``)."""
    return _getrefcount(g)


def _cotangent_refs() -> int:
    """The count :func:`_refs` finds for a fresh cotangent in a ``backward`` (asked once, on a small graph), or 0
    (never in place) where a cotangent a hook holds as well shows the same count (a Python that lends its
    references: nothing to tell the two apart by)."""
    seen: list[int] = []

    class Probe(Prim):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.view_as(x)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            seen.append(_refs(g))
            return g

    try:
        with torch.enable_grad():
            held: list[torch.Tensor] = []
            for hold in (False, True):
                x = torch.zeros(2, requires_grad=True)
                y = call(Probe, x)
                if hold:  # a hook that keeps the cotangent it is shown
                    y.register_hook(held.append)
                torch.autograd.grad((y * 2).sum(), x)  # [2]: y's cotangent a fresh product
    except Exception:  # noqa: BLE001 - a torch that cannot run the probe here: never in place
        return 0
    fresh, kept = seen
    return fresh if fresh != kept else 0


#: :func:`_cotangent_refs`, asked once
_BWD_REFS = _cotangent_refs()


def _uses(t: torch.Tensor) -> int:
    """How many holders ``t``'s storage has (tensors and views on it, pending collectives, ...)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BucketPool:
    """Flat gradient-bucket buffers kept from one backward to the next, as DDP keeps its buckets: a bucket takes
    a kept buffer of its size that nothing holds any more (the gradients handed out as views of it are gone, its
    all-reduce is done), else a new one, kept for later (at most :attr:`KEEP` per size, dtype and device).

    Writing into memory already mapped skips the page faults of fresh memory (for a 6.5 MiB bucket they cost
    several times the copy itself); a buffer still held anywhere (a gradient kept by the caller) is never reused.

    Example:
        >>> pool = BucketPool()
        >>> a = pool.take(4, torch.float32, torch.device("cpu"))
        >>> pool.take(4, torch.float32, torch.device("cpu")) is a  # nothing holds a but the pool: reused
        True
        >>> g = a[:2]  # a view handed out
        >>> pool.take(4, torch.float32, torch.device("cpu")) is a
        False
    """

    KEEP = 64

    def __init__(self) -> None:
        self.kept: dict[tuple[int, torch.dtype, torch.device], list[tuple[torch.Tensor, int]]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat ``[numel]`` buffer nothing else holds (its contents undefined)."""
        kept = self.kept.setdefault((numel, dtype, device), [])
        for buf, alone in kept:
            if _uses(buf) == alone:
                return buf
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(kept) < self.KEEP:
            kept.append((buf, _uses(buf)))
        return buf

    def clear(self) -> None:
        """Drop every kept buffer."""
        self.kept.clear()


#: the dist backend's gradient buckets (one process, one device)
BUCKETS = BucketPool()


class _LayerMajor:
    """One gradient buffer for the buckets of the same rows of stacked ``[n, ...]`` leaves (a stacked model's
    layers, one bucket per layer): ``[n, row]`` layer-major, bucket ``i`` in row ``i``, taken from :data:`BUCKETS`
    by the first bucket's backward. Each leaf's ``n`` row gradients then lie at one stride in it: the unstacking
    node hands them back as one strided ``[n, *s]`` view instead of copying them into a stack."""

    __slots__ = ("buf", "n", "row")

    def __init__(self, n: int, row: int) -> None:
        self.buf: torch.Tensor | None = None
        self.n, self.row = n, row


def _row_of(x: torch.Tensor) -> int | None:
    """``i`` when ``x`` is row ``i`` of a contiguous stacked ``[n, *s]`` tensor, as an unstacking node (a Function
    whose ctx has ``stacked_rows``, e.g. ``models.stacked.Unstack``) made it, else None."""
    node, base = x.grad_fn, x._base
    if node is None or base is None or not getattr(node, "stacked_rows", False) or not base.is_contiguous():
        return None
    if base.shape[1:] != x.shape or not x.is_contiguous():
        return None
    i, rem = divmod(x.storage_offset() - base.storage_offset(), max(x.numel(), 1))
    return i if rem == 0 and 0 <= i < base.shape[0] else None


def _layer_major(xs: tuple[torch.Tensor, ...]) -> tuple[_LayerMajor, int] | None:
    """The shared layer-major buffer of a bucket whose operands are all row ``i`` of stacked leaves of one length
    ``n`` (unstacked by a ``stacked_rows`` node), and ``i``; None for any other bucket. Buckets of the same leaves,
    in the same order, share one (kept on the first leaf's unstacking node, so it lives as long as the graph)."""
    if not xs or not all(x.dtype == xs[0].dtype for x in xs):
        return None
    i = _row_of(xs[0])
    if i is None:
        return None
    n = xs[0]._base.shape[0]  # type: ignore[union-attr]
    for x in xs[1:]:
        if _row_of(x) != i or x._base.shape[0] != n:  # type: ignore[union-attr]
            return None
    key = tuple(id(x.grad_fn) for x in xs)
    node = xs[0].grad_fn
    groups = getattr(node, "layer_major", None)
    if groups is None:
        groups = node.layer_major = {}  # type: ignore[union-attr]
    group = groups.get(key)
    if group is None:
        group = groups[key] = _LayerMajor(n, sum(x.numel() for x in xs))
    return group, i


class PvaryBucket(Prim):
    """:class:`Pvary` of several tensors of one dtype, with one collective for all of them.

    - forward: ``ys = xs`` (views).
    - backward: the cotangents are written once into one flat buffer (the bucket), all-reduced once in place
      where the backend can (``all_reduce_inplace``: no second copy; the buffer then comes from
      :data:`BUCKETS`, reused from step to step once nothing holds it) and handed back as views of it (under
      ``dist``'s overlap each its own pending view, ``all_reduce_inplace_parts``). A bucket of the rows ``i`` of
      stacked leaves (a stacked model's layer) is row ``i`` of one buffer shared by all the layers' buckets
      (:class:`_LayerMajor`), so the unstacking node hands each leaf's gradient back as a strided view of it.
    - jvp: ``PvaryBucket`` of the tangents present (outputs whose input has none get none).
    - vmap: ``PvaryBucket`` of the operands as they come (batched or not), each batch dim where it was.
    """

    #: vma: the operand is taken as it is (no ``Pvary`` first)
    operand_varies = False

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each result varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(dev: Any, axes: tuple[str, ...], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dev, ctx.axes = inputs[0], inputs[1]
        ctx.shapes = [x.shape for x in inputs[2:]]
        # rows of stacked leaves (a stacked model's layer): the bucket is a row of one buffer for all the layers
        dev = ctx.dev
        ok = (
            dev.pending_results
            and dev.inplace_sum
            and not transforms_active()
            and not tracing()
            and dev.pending_sums_share_storage()
        )
        ctx.rows = _layer_major(inputs[2:]) if ok else None

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if group_size(ctx.dev, ctx.axes) == 1:  # the sum over one member: the cotangents as they are
            record(ctx.dev.rank, "psum", ctx.axes, sum(_nbytes(g) for g in gs))  # counted as the all-reduce
            return (None, None, *gs)
        # one copy: every cotangent written once into one flat buffer (the bucket)
        flat_gs = [g.reshape(-1) for g in gs]
        dev = ctx.dev
        if not dev.inplace_sum or torch.is_grad_enabled() or transforms_active() or tracing():
            # (differentiated again, a backend with no in-place sum, or recorded into a compiled graph, where a
            # write into a kept buffer would become a copy of all of it: the AllReduce Function, which copies)
            flat = torch.cat(flat_gs)  # k x [*s_i] -> [sum |s_i|]
            total = call(AllReduce, flat, ctx.dev, ctx.axes, "sum", "psum")  # [sum |s_i|] -> [sum |s_i|]
            obs = observer()
            if obs is not None:  # an ahead-of-time analysis: a backend that keeps its buckets would keep this one
                obs.note("buckets", total)
        else:  # the bucket is this backward's own: summed in place, as DDP's flat buckets (no second copy)
            n = sum(g.numel() for g in flat_gs)
            rows, dtype, device = ctx.rows, gs[0].dtype, gs[0].device
            if rows is not None and rows[0].row == n:  # row i of the layers' shared [n_layers, n] buffer
                group, i = rows
                if group.buf is None or group.buf.dtype != dtype:
                    group.buf = BUCKETS.take(group.n * n, dtype, device)
                out = group.buf[i * n : (i + 1) * n]  # [n_layers * n] -> [n]
            else:
                out = BUCKETS.take(n, dtype, device)
            flat = torch.cat(flat_gs, out=out)  # k x [*s_i] -> [sum |s_i|]
            record(ctx.dev.rank, "psum", ctx.axes, _nbytes(flat))
            # the backend cuts the (pending) sum into the gradients' views itself
            return (None, None, *ctx.dev.all_reduce_inplace_parts(flat, ctx.axes, ctx.shapes))  # -> k x [*s_i]
        parts = total.split([s.numel() for s in ctx.shapes])
        return (None, None, *(p.view(s) for p, s in zip(parts, ctx.shapes, strict=True)))

    @staticmethod
    def jvp(ctx: Any, _dev: None, _axes: None, *ts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        have = [i for i, t in enumerate(ts) if t is not None]
        out: list[torch.Tensor | None] = [None] * len(ts)
        if len(have) == 1:
            out[have[0]] = call(Pvary, ts[have[0]], ctx.dev, ctx.axes)  # [*s] -> [*s]
        elif have:
            ys = call(PvaryBucket, ctx.dev, ctx.axes, *(ts[i] for i in have))  # k x [*s_i] -> same
            for i, y in zip(have, ys, strict=True):
                out[i] = y
        return tuple(out)

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, dev: Any, axes: tuple[str, ...], *xs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], _Dims]:
        return call(PvaryBucket, dev, axes, *xs), tuple(in_dims[2:])  # k x [*s_i] -> same


class AllGather(Prim):
    """All-gather ``[*s] -> [n, *s]`` (row i from group member i).

    - forward: ``y[i] = x on member i``; the result varies over ``axes``.
    - backward: reduce-scatter ``[n, *s] -> [*s]`` of the cotangent.
    - jvp: all-gather of the tangent.
    - vmap: ``[B, *s] -> [n, B, *s]`` in one all-gather (out dim 1).
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: the result varies over ``axes``, as in JAX (each member goes on with its own copy)."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "all_gather", axes, _nbytes(x))
        return dev.all_gather(x, axes)  # [*s] -> [n, *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(ReduceScatter, g, ctx.dev, ctx.axes), None, None  # [n, *s] -> [*s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(AllGather, t, ctx.dev, ctx.axes)  # [*s] -> [n, *s]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...]
    ) -> tuple[torch.Tensor, int]:
        return call(AllGather, _to(x, in_dims[0], 0), dev, axes), 1  # [B, *s] -> [n, B, *s]


class ReduceScatter(Prim):
    """Reduce-scatter ``[n, *s] -> [*s]``: member i keeps row i of the sum over the group.

    - forward: ``y = sum over members m of x_m[i]`` on member i.
    - backward: all-gather ``[*s] -> [n, *s]`` of the cotangent.
    - jvp: reduce-scatter of the tangent.
    - vmap: ``[n, B, *s] -> [B, *s]`` in one reduce-scatter (out dim 0).
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each member keeps its own block: varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "psum_scatter", axes, _nbytes(x))
        return dev.reduce_scatter(x, axes)  # [n, *s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllGather, g, ctx.dev, ctx.axes), None, None  # [*s] -> [n, *s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(ReduceScatter, t, ctx.dev, ctx.axes)  # [n, *s] -> [*s]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...]
    ) -> tuple[torch.Tensor, int]:
        return call(ReduceScatter, _to(x, in_dims[0], 1), dev, axes), 0  # [n, B, *s] -> [B, *s]


class AllToAll(Prim):
    """All-to-all ``[n, *s] -> [n, *s]``: row j goes to member j, row i of the result came from member i.

    - forward: ``y[i] = x_i[me]``.
    - backward: the same all-to-all of the cotangent (it is its own transpose).
    - jvp: the same all-to-all of the tangent.
    - vmap: ``[n, B, *s] -> [n, B, *s]`` in one all-to-all (out dim 1).
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each member receives its own blocks: varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "all_to_all", axes, _nbytes(x))
        return dev.all_to_all(x, axes)  # [n, *s] -> [n, *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllToAll, g, ctx.dev, ctx.axes), None, None  # [n, *s] -> [n, *s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(AllToAll, t, ctx.dev, ctx.axes)  # [n, *s] -> [n, *s]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...]
    ) -> tuple[torch.Tensor, int]:
        return call(AllToAll, _to(x, in_dims[0], 1), dev, axes), 1  # [n, B, *s] -> [n, B, *s]


class Ppermute(Prim):
    """Send ``[*s] -> [*s]`` along the ``(src, dst)`` pairs of ``perm``; members that receive nothing get zeros.

    - forward: ``y = x on src`` for the pair ``(src, me)``, else zeros.
    - backward: the same send along the inverse pairs ``(dst, src)``.
    - jvp: the same send of the tangent.
    - vmap: ``[B, *s] -> [B, *s]`` in one send (out dim 0).
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each member receives its own value: varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "ppermute", axes, _nbytes(x))
        return dev.ppermute(x, axes, perm)  # [*s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes, ctx.perm = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        inverse = tuple((dst, src) for src, dst in ctx.perm)
        return call(Ppermute, g, ctx.dev, ctx.axes, inverse), None, None, None  # [*s] -> [*s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(Ppermute, t, ctx.dev, ctx.axes, ctx.perm)  # [*s] -> [*s]

    @staticmethod
    def vmap(
        info: VmapInfo,
        in_dims: _Dims,
        x: torch.Tensor,
        dev: Any,
        axes: tuple[str, ...],
        perm: tuple[tuple[int, int], ...],
    ) -> tuple[torch.Tensor, int]:
        return call(Ppermute, _to(x, in_dims[0], 0), dev, axes, perm), 0  # [B, *s] -> [B, *s]


class AllGatherInvariant(Prim):
    """All-gather ``[*s] -> [n, *s]`` whose result is the same on every member (invariant over ``axes``).

    - forward: ``y[i] = x on member i``.
    - backward: this member's row ``g[index]`` of the cotangent (no communication: the cotangent of an
      invariant value is invariant).
    - jvp: the same all-gather of the tangent.
    - vmap: ``[B, *s] -> [n, B, *s]`` in one all-gather (out dim 1).
    """

    #: vma: the operand is first made varying over ``axes`` (a ``Pvary`` where it is not), as JAX requires
    operand_varies = True

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: the result is the same on every member: invariant over ``axes``."""
        return have - axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], index: int) -> torch.Tensor:  # type: ignore[override]
        record(dev.rank, "all_gather", axes, _nbytes(x))
        return dev.all_gather(x, axes)  # [*s] -> [n, *s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes, ctx.index = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(SplitInvariant, g, ctx.dev, ctx.axes, ctx.index), None, None, None  # [n, *s] -> [*s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(AllGatherInvariant, t, ctx.dev, ctx.axes, ctx.index)  # [*s] -> [n, *s]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...], index: int
    ) -> tuple[torch.Tensor, int]:
        return call(AllGatherInvariant, _to(x, in_dims[0], 0), dev, axes, index), 1  # [B, *s] -> [n, B, *s]


class SplitInvariant(Prim):
    """Take this member's row ``[n, *s] -> [*s]`` of a value invariant over ``axes`` (no communication); the
    transpose of :class:`AllGatherInvariant`.

    - forward: ``y = x[index]``.
    - backward: all-gather ``[*s] -> [n, *s]`` of the cotangent rows (invariant).
    - jvp: this member's row of the tangent.
    - vmap: ``[n, B, *s] -> [B, *s]`` (out dim 0).
    """

    #: vma: the operand is taken as it is (no ``Pvary`` first)
    operand_varies = False

    @staticmethod
    def vma(have: frozenset[str], axes: frozenset[str]) -> frozenset[str]:
        """vma rule: each member takes its own row: varies over ``axes``."""
        return have | axes

    @staticmethod
    def forward(x: torch.Tensor, dev: Any, axes: tuple[str, ...], index: int) -> torch.Tensor:  # type: ignore[override]
        return x[index].clone()  # [n, *s] -> [*s]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.dev, ctx.axes, ctx.index = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return call(AllGatherInvariant, g, ctx.dev, ctx.axes, ctx.index), None, None, None  # [*s] -> [n, *s]

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: None) -> torch.Tensor:
        return call(SplitInvariant, t, ctx.dev, ctx.axes, ctx.index)  # [n, *s] -> [*s]

    @staticmethod
    def vmap(
        info: VmapInfo, in_dims: _Dims, x: torch.Tensor, dev: Any, axes: tuple[str, ...], index: int
    ) -> tuple[torch.Tensor, int]:
        return call(SplitInvariant, _to(x, in_dims[0], 1), dev, axes, index), 0  # [n, B, *s] -> [B, *s]
