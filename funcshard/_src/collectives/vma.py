"""Varying manual axes ("vma"): which mesh axes a value inside shard_map may differ over.

Every tensor inside ``shard_map(check_vma=True)`` carries a set of axis names (attribute ``_fs_vma``; absent
means "invariant over every axis"). A ``TorchFunctionMode`` tags each op's outputs with the union of its
tensor inputs' sets, and wraps an operand whose set is smaller in ``Pvary`` (identity forward, psum
backward over the missing axes). So a parameter replicated over ``dp`` that meets a ``dp``-sharded batch
gets the full-batch gradient with no hand-written all-reduce.

Autograd entry points (``torch.autograd.grad``, ``Tensor.backward``) pass through untouched; the gradients
``torch.autograd.grad`` returns are tagged like their inputs. Under ``torch.func`` the tensors are wrappers:
the tag is looked up through them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree
import torch
import torch._functorch.eager_transforms as _eager
import torch._functorch.vmap as _vmap_impl
from torch.overrides import TorchFunctionMode

from ..errors import ShardingError
from ..runtime.comm import wait_pending
from ..runtime.context import axes_of, current, tangents_possible, transforms_active
from .prims import Prim, Pvary, call

__all__ = [
    "EMPTY",
    "TAG_ATTR",
    "Audited",
    "Op",
    "VmaMode",
    "active_mode",
    "auditing",
    "bind",
    "bind_operand",
    "bind_result",
    "bind_results",
    "copy_vmas",
    "find_vma",
    "get_vma",
    "keep_tags",
    "known_vma",
    "known_vmas",
    "official_vma",
    "one_op",
    "pvary_to",
    "set_vma",
    "set_vmas",
    "settle",
    "tag_leaves",
    "tag_like",
    "tag_tensors",
    "tag_through",
    "tags_agree",
    "tags_of",
    "take_vma",
    "take_vmas",
    "vary_output",
]

EMPTY: frozenset[str] = frozenset()
_ATTR = "_fs_vma"
TAG_ATTR = _ATTR  # the attribute holding a tensor's tag, read and written inline in this floor only (no call)
_unwrap = torch._C._functorch.get_unwrapped
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class Audited(frozenset):
    """Axes known only to the audit of a ``check_vma=False`` call under sim: the vma mode runs there as well,
    tagging every value, but without changing what the program computes. Such a tag is never acted on (no
    ``pvary`` is inserted for it, as dist, which tracks nothing, would not); it serves to raise where the
    program's gradient would be wrong without tracking."""

    __slots__ = ()


def find_vma(t: torch.Tensor) -> frozenset[str] | None:
    """The tag of ``t`` (looking through torch.func wrappers, and from a view to the tensor it views: a
    transform such as ``torch.vmap(..., out_dims=1)`` hands back a fresh view of a tagged result), or None
    when it carries none."""
    while True:
        v = getattr(t, _ATTR, None)
        if v is not None:
            return v
        base = t._base
        if base is not None:
            v = getattr(base, _ATTR, None)
            if v is not None:
                return v
        if not _is_wrapped(t):
            return None
        t = _unwrap(t)


def get_vma(t: torch.Tensor) -> frozenset[str]:
    """The axes ``t`` varies over (looking through torch.func wrappers); untagged means invariant."""
    v = getattr(t, _ATTR, None)  # (find_vma's first read, inline: the common operand carries its own tag)
    if v is not None:
        return v
    v = find_vma(t)
    return EMPTY if v is None else v


def set_vma(t: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
    """Tag ``t`` as varying over ``axes``; return ``t``."""
    setattr(t, _ATTR, axes)
    return t


def _tag_through(t: torch.Tensor, axes: frozenset[str]) -> None:
    """Tag ``t`` and, under torch.func, the tensors it wraps: the transform hands the innermost one back
    to the caller (torch keeps a tensor's Python object, tag included, for as long as the tensor lives)."""
    while True:
        setattr(t, _ATTR, axes)
        if not _is_wrapped(t):
            return
        t = _unwrap(t)


tag_through = _tag_through  # for the other modules (``_grad``): the same helper under a public name


def clear_vma(tensors: Iterable[Any]) -> None:
    """Remove the tags of ``tensors`` (non-tensors are skipped)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            d = t.__dict__
            if _ATTR in d:
                del d[_ATTR]


def tag_tensors(leaves: Iterable[Any], tags: Iterable[frozenset[str]], tagged: list[torch.Tensor]) -> None:
    """Tag each tensor of ``leaves`` with its entry of ``tags`` (as :func:`set_vma`; non-tensors skipped) and append
    it to ``tagged``: shard_map's arguments, one loop a call (no call a leaf)."""
    T, push = torch.Tensor, tagged.append
    for t, v in zip(leaves, tags, strict=True):
        if isinstance(t, T):
            setattr(t, _ATTR, v)
            push(t)


def copy_vmas(dsts: Iterable[torch.Tensor], srcs: Iterable[torch.Tensor]) -> list[frozenset[str] | None]:
    """Tag each of ``dsts`` as :func:`find_vma` finds its entry of ``srcs`` tagged (left untagged where that is not)
    and return those tags (None: untagged): detached copies' tags, one call for all."""
    out: list[frozenset[str] | None] = []
    push = out.append
    for dst, src in zip(dsts, srcs, strict=True):
        v = getattr(src, _ATTR, None)
        if v is None:
            v = find_vma(src)  # (a view's base's, or through torch.func wrappers)
        if v is not None:
            setattr(dst, _ATTR, v)
        push(v)
    return out


def set_vmas(ts: Iterable[torch.Tensor], tags: Iterable[frozenset[str] | None]) -> None:
    """:func:`set_vma` of each of ``ts`` with its entry of ``tags`` (None: invariant, :data:`EMPTY`), one call for
    all: a function's gradients, each tagged like its input."""
    for t, v in zip(ts, tags, strict=True):
        setattr(t, _ATTR, EMPTY if v is None else v)


def take_vmas(ts: Iterable[Any]) -> list[frozenset[str] | None]:
    """:func:`take_vma` of each tensor of ``ts`` (None for anything else), one call for all: a call's outputs."""
    T, out = torch.Tensor, []
    push = out.append
    for t in ts:  # (a loop: no comprehension's frame)
        push(t.__dict__.pop(_ATTR, None) if isinstance(t, T) else None)
    return out


def take_vma(t: torch.Tensor) -> frozenset[str] | None:
    """Remove ``t``'s own tag (not a view's base's, not one through torch.func wrappers) and return it; None where
    it had none."""
    return t.__dict__.pop(_ATTR, None)


def keep_tags(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst`` given the tags of ``src`` (every Python attribute of it), for a value made from a pending one: its
    waited-for or restrided result; return ``dst``."""
    dst.__dict__.update(src.__dict__)
    return dst


def settle(t: Any) -> Any:
    """``t`` itself, or, for the pending result of an asynchronous collective (torch's ``AsyncCollectiveTensor``:
    the dist backend's gradient reductions during a backward), that result once it is done, as a plain tensor
    with ``t``'s tags. Cheap for anything else (no torch.distributed import).

    Example:
        >>> import torch
        >>> x = torch.ones(2)
        >>> settle(x) is x
        True
    """
    if type(t).__name__ != "AsyncCollectiveTensor":
        return t
    return keep_tags(wait_pending(t), t)  # its tags (the varying axes) go with it


def pvary_to(x: torch.Tensor, want: frozenset[str], dev: Any) -> torch.Tensor:
    """``x`` made varying over ``want`` (a superset of its own axes): pvary over the missing ones."""
    have = get_vma(x)
    missing = want - have
    if not missing:
        return x
    with torch._C.DisableTorchFunction():
        if _constant(x):  # no gradient or tangent can reach it: the pvary is the identity, and no Function is made
            y = x.view_as(x)  # (a view, as Pvary's forward gives: the caller's tensor keeps its own tag)
        else:
            y = call(Pvary, x, dev, tuple(a for a in dev.mesh.axis_names if a in missing))
    return set_vma(y, have | missing)


def _constant(x: torch.Tensor) -> bool:
    """Whether no derivative can flow through ``x``: it does not require grad, no torch.func transform is
    active, and it carries no forward-mode tangent (a constant: a mask, positions, a table)."""
    if x.requires_grad or transforms_active() or _is_wrapped(x):
        return False
    return not tangents_possible() or torch.autograd.forward_ad.unpack_dual(x).tangent is None


def official_vma(t: torch.Tensor) -> frozenset[str] | None:
    """The axes of ``t`` where shard_map itself knows them, in both vma modes and both backends (an argument,
    a collective's result, a tracked value): None for none, or for axes that only the audit knows."""
    v = find_vma(t)
    return None if isinstance(v, Audited) else v


def tags_agree(groups: Iterable[Sequence[Any]], shared: Sequence[Any] = ()) -> bool:
    """Whether the tensors of each of ``groups`` are plain tensors that need no gradient, all varying over one set of
    axes (groups possibly over different ones: under tp the sharded weights vary, the norms do not), and the tensors
    among ``shared`` (non-tensors skipped) likewise, over axes within every group's.

    Then ops that each mix the tensors of one group with the shared ones (an optimiser's update of one leaf: its
    gradient, moments and parameter, with the learning rate), writing into that group's tensors or into temporaries
    that never leave them, change no tag: the vma mode would only tag those temporaries (nothing to widen that is not
    in the group's axes, no error to raise) and they may run with torch functions off, for the same numbers. Ask it
    beside the fast-path predicate: ``not transforms_active() and not tracing() and tags_agree(...)``.

    Example:
        >>> import torch
        >>> tags_agree([(torch.ones(2), torch.zeros(2))], (0.5,))  # untagged: invariant alike
        True
        >>> tags_agree([(torch.ones(2, requires_grad=True),)])
        False
    """
    ok, axes = _one_tag(shared)
    if not ok:
        return False
    for group in groups:
        ok, first = _one_tag(group)
        if not ok:
            return False
        if axes and (first is None or not axes <= first):  # a varying shared value meets a group outside its axes
            return False
    return True


def _one_tag(values: Sequence[Any]) -> tuple[bool, frozenset[str] | None]:
    """Whether the tensors among ``values`` are plain tensors that do not require grad, all varying over the same
    axes (untagged: none), and those axes (None: no tensor among ``values``)."""
    tag = None
    for t in values:
        if not isinstance(t, torch.Tensor):
            continue
        if type(t) is not torch.Tensor or t.requires_grad:
            return False, None
        v = get_vma(t)
        if tag is None:
            tag = v
        elif v != tag:
            return False, None
    return True, tag


def active_mode() -> VmaMode | None:
    """The vma mode this thread runs under (inside ``shard_map(check_vma=True)``, or an audited call), or None."""
    return getattr(_active, "mode", None)


def auditing() -> bool:
    """Whether this thread runs a ``check_vma=False`` body under the audit (see :class:`Audited`)."""
    mode = getattr(_active, "mode", None)
    return mode is not None and mode.audit


def known_vma(t: torch.Tensor, tracked: bool) -> frozenset[str] | None:
    """The axes ``t`` varies over; None where nothing is known. With tracking (``check_vma=True``) every value
    has its axes (untagged means invariant: a constant); without it only the arguments of shard_map and the
    results of collectives carry tags, and the audit (sim) knows the rest as :class:`Audited` axes."""
    if tracked:
        return get_vma(t)
    v = getattr(t, _ATTR, None)  # (find_vma's first read, inline: an argument carries its own tag)
    if v is None:
        v = find_vma(t)
    if v is not None and not isinstance(v, Audited):
        return v
    mode = getattr(_active, "mode", None)
    if mode is not None and mode.audit:  # (auditing(), inline) every value is tagged: untagged means invariant
        return v if v is not None else Audited()
    return None


def known_vmas(ts: Iterable[Any], tracked: bool) -> list[frozenset[str] | None]:
    """:func:`known_vma` of each tensor of ``ts`` (None for anything else), one call for all: a tree's leaves."""
    mode = getattr(_active, "mode", None)
    audit = mode is not None and mode.audit
    T, out = torch.Tensor, []
    push = out.append
    for t in ts:  # (known_vma of each, written out)
        if not isinstance(t, T):
            push(None)
            continue
        v = getattr(t, _ATTR, None)
        if v is None:
            v = find_vma(t)
        if tracked:
            push(EMPTY if v is None else v)
        elif v is not None and not isinstance(v, Audited):
            push(v)
        else:
            push((v if v is not None else Audited()) if audit else None)
    return out


def _grad_flows(t: torch.Tensor) -> bool:
    """Whether a gradient flows into ``t`` at any autograd level (through torch.func wrappers)."""
    while True:
        if t.requires_grad:
            return True
        if not _is_wrapped(t):
            return False
        t = _unwrap(t)


def _unvaried(name: str, missing: list[str], what: str) -> ShardingError:
    axes = ", ".join(repr(a) for a in missing)
    arg = repr(missing[0]) if len(missing) == 1 else repr(tuple(missing))
    return ShardingError(
        f"{name} (check_vma=False): {what} is the same on every device of {axes} (it is computed only from "
        f"values that do not vary over {axes}) and a gradient flows through it. Untracked, its gradient would "
        f"miss the sum over its copies on {axes}: a wrong number under dist (this sim run checks for it). "
        f"Write fs.pvary(x, {arg}) on it first, or use check_vma=True."
    )


def bind_operand(
    prim: Any, x: torch.Tensor, axes: tuple[str, ...], dev: Any, tracked: bool, name: str = ""
) -> tuple[torch.Tensor, frozenset[str] | None]:
    """The operand of collective ``prim`` over ``axes``, and the axes it then varies over (None: unknown).

    Where ``prim.operand_varies``, an operand invariant over some of ``axes`` stands for equal copies on
    their members and is made varying first (``Pvary``: its cotangent is summed over them), as JAX does.
    An operand whose axes are unknown (``check_vma=False``, an op's result) is taken as it is; under sim the
    audit raises where that would give a wrong gradient.
    """
    have = known_vma(x, tracked)
    if have is None or not prim.operand_varies:
        return x, have
    return _vary_operand(x, have, axes, dev, name or prim.__name__)


def _vary_operand(
    x: torch.Tensor, have: frozenset[str], axes: tuple[str, ...], dev: Any, name: str
) -> tuple[torch.Tensor, frozenset[str]]:
    """A collective's operand ``x`` (varying over the known ``have``) made varying over ``axes`` too, and the axes
    it then varies over; under the audit (``have`` :class:`Audited`) taken as it is, raising where a gradient flows
    through an operand invariant over some of ``axes`` (dist would be silently wrong)."""
    if isinstance(have, Audited):
        missing = [a for a in axes if a not in have]
        if missing and _grad_flows(x):
            raise _unvaried(name, missing, "its operand")
        return x, have
    want = have | frozenset(axes)
    return pvary_to(x, want, dev), want


def bind_result(prim: Any, y: torch.Tensor, have: frozenset[str] | None, axes: tuple[str, ...]) -> torch.Tensor:
    """``y``, the result of ``prim`` over ``axes`` of an operand varying over ``have``, tagged by ``prim``'s
    vma rule (left untagged where ``have`` is unknown)."""
    if have is None:
        return y
    v = prim.vma(have, frozenset(axes))
    setattr(y, _ATTR, Audited(v) if isinstance(have, Audited) else v)  # (set_vma, inline)
    return y


def bind_results(
    prim: Any, ys: Iterable[torch.Tensor], have: frozenset[str] | None, axes: tuple[str, ...]
) -> list[torch.Tensor]:
    """:func:`bind_result` of each of ``ys``, the results of one ``prim`` over ``axes`` of operands that all vary over
    ``have``: the tag made once and set on each, one call for all (a bucket's results)."""
    ys = list(ys)
    if have is None:
        return ys
    v = prim.vma(have, frozenset(axes))
    if isinstance(have, Audited):
        v = Audited(v)
    for y in ys:
        setattr(y, _ATTR, v)
    return ys


class Op(Prim):
    """An op declared once, with its varying-axes rule: ``forward(dev, axes, *operands, *params)`` (a tuple of
    results), ``setup_context`` and ``backward`` as for any :class:`~.prims.Prim`, and :meth:`vma`. Applied with
    :func:`bind`.

    An op that sends operands through its own collectives over ``axes`` (ring attention's k and v) declares them in
    :attr:`varying_operands`, and with :attr:`agree` has its operands made to agree first, as the vma mode does for
    any torch op's: :func:`bind` then prepares them (``Pvary``) and always runs the op, as a collective is bound.
    """

    #: positions of the operands that enter the op's collectives over its axes: :func:`bind` makes each vary over
    #: them first, as a collective's operand (``Pvary`` where it is invariant over some: its cotangent summed over
    #: them; under ``check_vma=False`` only where its axes are known, and where only the audit knows them it raises
    #: if a gradient flows)
    varying_operands: tuple[int, ...] = ()
    #: under ``check_vma=True``, :func:`bind` makes every operand vary over the union of all the operands' axes (and
    #: of the op's axes, with :attr:`varying_operands`), as the vma mode does for the operands of any torch op
    agree: bool = False

    @staticmethod
    def vma(axes: frozenset[str], *have: frozenset[str]) -> frozenset[str] | None:
        """The axes every result varies over, given the op's mesh ``axes`` and the axes each operand varies over
        (each an :class:`Audited` set where only the audit of a ``check_vma=False`` call knows them); None where the
        op does not apply to such operands (its caller runs the plain ops instead)."""
        raise NotImplementedError


def bind(
    op: type[Op],
    *operands: torch.Tensor,
    axis: Any,
    name: str,
    need_grad: bool = False,
    params: tuple[Any, ...] = (),
) -> tuple[torch.Tensor, ...] | None:
    """``op`` applied to ``operands`` over the mesh axes ``axis`` (its ``forward(dev, axes, *operands, *params)``),
    each result tagged by ``op.vma`` from the operands' tags; None where ``op`` declines: its rule returns None, some
    operands' axes are known and others not, or, with ``need_grad``, no operand requires grad. Operands whose axes
    nobody knows (``check_vma=False``: not an argument, not a collective's result) give untagged results.

    An op with :attr:`Op.varying_operands` or :attr:`Op.agree` is bound as a collective is: its operands made
    varying first (``Pvary``), its rule asked with the axes they then vary over, and it always runs (results
    untagged where some operand's axes are unknown); its rule does not decline.

    Call it inside ``shard_map`` where ``op`` may run: for a hand-written fast path, ``not transforms_active()`` and
    whatever it needs besides; under a ``torch.func`` transform only an op that has its rules (the results are
    tagged as they are, not the tensors they wrap).

    Raises:
        ShardingError: outside shard_map, or ``axis`` not in the mesh (the message names ``name``); for an op bound
            as a collective under the audit of a ``check_vma=False`` call, an operand of :attr:`Op.varying_operands`
            that is invariant over some of ``axis`` while a gradient flows through it.
    """
    with torch._C.DisableTorchFunction():  # (attribute reads and the call: the results' tags are set here)
        if need_grad:
            for t in operands:  # (loops, not generators: one frame less each, on every call)
                if t.requires_grad:
                    break
            else:
                return None
        ctx = current(name)
        axes = axes_of(axis, ctx.mesh, name)
        tracked = ctx.check_vma
        have = []
        for t in operands:
            have.append(known_vma(t, tracked))
        if op.varying_operands or op.agree:  # bound as a collective: operands made varying, the op always runs
            operands = _vary_operands(op, operands, have, axes, ctx.device, tracked, name)  # type: ignore[assignment]
            tag = None if None in have else op.vma(frozenset(axes), *have)  # type: ignore[arg-type]
        else:
            unknown = have.count(None)
            if unknown == 0:
                tag = op.vma(frozenset(axes), *have)  # type: ignore[arg-type]
                if tag is None:
                    return None
            elif unknown == len(have):
                tag = None
            else:
                return None
        ys = call(op, ctx.device, axes, *operands, *params)
        if tag is not None:
            for y in ys:
                setattr(y, _ATTR, tag)  # (set_vma, inline)
    return ys


def _vary_operands(
    op: type[Op],
    operands: tuple[torch.Tensor, ...],
    have: list[frozenset[str] | None],
    axes: tuple[str, ...],
    dev: Any,
    tracked: bool,
    name: str,
) -> list[torch.Tensor]:
    """The operands of ``op`` (bound as a collective over ``axes``) made varying as it declares (``Pvary``, in the
    operands' order), ``have`` updated in place to the axes each then varies over."""
    out = list(operands)
    extra = frozenset(axes)
    if tracked and op.agree:  # every operand over the union (and the op's axes where its collectives take some)
        want = extra if op.varying_operands else EMPTY
        for h in have:
            want = want | h  # type: ignore[operator]
        for j, t in enumerate(out):
            out[j] = pvary_to(t, want, dev)
            have[j] = want
        return out
    for j in op.varying_operands:  # each over its own axes and the op's, as a collective's operand
        h = have[j]
        if h is not None:  # (None: check_vma=False, axes nobody knows: taken as it is)
            out[j], have[j] = _vary_operand(out[j], h, axes, dev, name)
    return out


def vary_output(t: torch.Tensor, axes: frozenset[str], dev: Any, tracked: bool, path: str) -> torch.Tensor:
    """An output whose out_spec names ``axes``: made varying over those it is invariant over (``pvary``), as
    it stands for a different block on each device of them (its copies, tiled), so the cotangents of those
    blocks are summed into its gradient, as JAX does. Under ``check_vma=False`` only where its axes are known
    (an argument, a collective's result); where only the audit knows them, raise if a gradient flows."""
    have = known_vma(t, tracked)
    if have is None or axes <= have:
        return t
    if isinstance(have, Audited):
        if _grad_flows(t):
            raise _unvaried("shard_map", sorted(axes - have), f"the output at '{path}', whose out_spec names them,")
        return t
    return pvary_to(t, have | axes, dev)


_PASS = {
    torch.Tensor.backward,
    torch.autograd.backward,
}
_GRAD = {torch.autograd.grad}
_INPLACE_EXTRA = {
    torch.Tensor.__setitem__,
    torch.Tensor.__iadd__,
    torch.Tensor.__isub__,
    torch.Tensor.__imul__,
    torch.Tensor.__itruediv__,
}


_INPLACE_CACHE: dict[Any, bool] = {}


def _is_inplace(func: Any) -> bool:
    hit = _INPLACE_CACHE.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        hit = _INPLACE_CACHE[func] = func in _INPLACE_EXTRA or (name.endswith("_") and not name.endswith("__"))
    return hit


def _is_tensor(a: Any) -> bool:
    return isinstance(a, torch.Tensor)


_active = threading.local()  # .mode: the VmaMode this thread runs under, if any
_SCALARS = frozenset({int, float, bool, complex, str, type(None)})  # operands with no tensor inside


def _tag_audited(t: torch.Tensor, axes: frozenset[str]) -> None:
    _tag_through(t, axes if isinstance(axes, Audited) else Audited(axes))


class VmaMode(TorchFunctionMode):
    """Tags op outputs with the union of their inputs' varying axes; inserts ``Pvary`` where they differ.

    With ``audit`` (``check_vma=False`` under sim) it tags as :class:`Audited` and inserts nothing: the program
    computes what it would under dist, and the collectives and outputs raise where that is wrong.
    """

    def __init__(self, dev: Any, audit: bool = False) -> None:
        # (TorchFunctionMode.__init__ sets nothing; made on every call of a tracked shard_map)
        self.dev = dev
        self.audit = audit
        self._tag = _tag_audited if audit else _tag_through
        self._prev: VmaMode | None = None

    def __enter__(self) -> VmaMode:
        self._prev = getattr(_active, "mode", None)
        _active.mode = self
        torch._C._push_on_torch_function_stack(self)  # TorchFunctionMode.__enter__, without its two Python calls
        return self

    def __exit__(self, *exc: object) -> None:
        _active.mode = self._prev
        torch._C._pop_torch_function_stack()  # TorchFunctionMode.__exit__

    def _agree(
        self,
        tree: Any,
        union: frozenset[str],
        skip: torch.Tensor | None = None,
        passed: list[torch.Tensor] | None = None,
    ) -> Any:
        """``tree`` with every tensor (but ``skip``) made varying over ``union`` (``Pvary`` where it lacks axes).

        With ``passed``, an invariant constant (no gradient or tangent can reach it: its pvary is the identity)
        is left as it is and appended to ``passed`` (the op's result is tagged with ``union`` anyway; the caller
        makes sure that result is not the constant itself, whose own tag must stay); else it is widened by a
        tagged view."""

        def fix(a: Any) -> Any:
            if not isinstance(a, torch.Tensor) or a is skip:
                return a
            if passed is not None:
                have = getattr(a, _ATTR, None)
                if have is None:
                    have = get_vma(a)
                if not union <= have:
                    with torch._C.DisableTorchFunction():
                        if _constant(a):
                            passed.append(a)
                            return a
                    return pvary_to(a, union, self.dev)
                return a
            return pvary_to(a, union, self.dev)

        args, kwargs = tree
        if not kwargs and all(isinstance(a, torch.Tensor) or type(a) in _SCALARS for a in args):
            return tuple(map(fix, args)), kwargs  # the common op: tensors and numbers (no pytree walk)
        return optree.tree_map(fix, tree, is_leaf=_is_tensor)

    def _agree_flat(
        self, args: tuple[Any, ...], union: frozenset[str], skip: torch.Tensor | None, passed: list[torch.Tensor]
    ) -> tuple[Any, ...]:
        """:meth:`_agree` with ``passed`` for operands that are tensors and numbers only (no list, no kwargs),
        in one loop: each tensor (but ``skip``) lacking axes of ``union`` is made varying over them (``Pvary``),
        or, an invariant constant, left as it is and appended to ``passed``."""
        new: list[Any] | None = None
        for i, a in enumerate(args):
            if a is skip or not isinstance(a, torch.Tensor):
                continue
            have = getattr(a, _ATTR, None)
            if have is None:  # (find_vma inline for a plain untagged tensor: invariant)
                have = EMPTY if a._base is None and not _is_wrapped(a) else get_vma(a)
            if union <= have:
                continue
            if not a.requires_grad:
                with torch._C.DisableTorchFunction():
                    if _constant(a):
                        passed.append(a)
                        continue
            if new is None:
                new = list(args)
            new[i] = pvary_to(a, union, self.dev)
        return args if new is None else tuple(new)

    def custom_function(self, apply: Callable[..., Any], cls: type, args: tuple[Any, ...], kwargs: Any) -> Any:
        """``cls.apply(*args, **kwargs)`` of a user's ``torch.autograd.Function``: its operands made to agree
        (``Pvary`` over the axes some of them lack, so the backward sums what the user's backward returns for
        an invariant operand), its outputs tagged (as computed inside, else with the operands' union)."""
        union = EMPTY
        for t in optree.tree_leaves((args, kwargs), is_leaf=_is_tensor):
            if isinstance(t, torch.Tensor):
                union = union | get_vma(t)
        if union and not self.audit:
            args, kwargs = self._agree((args, kwargs), union)
        out = apply(cls, *args, **kwargs)
        for o in optree.tree_leaves(out, is_leaf=_is_tensor):
            if isinstance(o, torch.Tensor):
                inner = find_vma(o)
                self._tag(o, union if inner is None else inner)
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        # runs for every torch op inside shard_map: one pass over the operands, the tag read inline (the common
        # operand carries its own tag; views, torch.func wrappers and untagged constants take the slow path)
        special = _SPECIAL.get(func)
        if special is not None:
            if special is _read:  # x.shape, x.dim(), x.size(1), ...: no tensor comes out, nothing to tag
                return func(*args, **kwargs) if kwargs else func(*args)
            return special(self, func, args, kwargs or {})
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            # one tensor operand (a unary op, a read such as x.T): nothing can mix
            a = args[0]
            v = getattr(a, _ATTR, None)
            if v is None:  # untagged: invariant, unless a view or a torch.func wrapper carries the tag elsewhere
                v = EMPTY if a._base is None and not _is_wrapped(a) else get_vma(a)
            out = func(a)
            if v:
                if type(out) is torch.Tensor and not self.audit and not _is_wrapped(out):
                    out.__dict__[_ATTR] = v  # the common result: a plain tensor (_tag_through, inline)
                else:
                    self._tag_out(out, v)
            return out
        if kwargs is None:
            kwargs = {}
        union: frozenset[str] = EMPTY
        first: frozenset[str] | None = None
        mixed = False
        flat = True  # no list operand
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                v = getattr(a, _ATTR, None)
                if v is None:  # (find_vma inline for the common untagged operand: a plain invariant tensor)
                    v = EMPTY if a._base is None and not _is_wrapped(a) else get_vma(a)
                if first is None:
                    first = union = v
                elif v is not first and v != first:
                    mixed = True
                    union = union | v
            elif isinstance(a, (list, tuple)):  # an op's list operand (torch.cat's): one level deep
                flat = False
                for b in a:
                    if isinstance(b, torch.Tensor):
                        v = get_vma(b)
                        if first is None:
                            first = union = v
                        elif v is not first and v != first:
                            mixed = True
                            union = union | v
        if not union:  # every operand invariant: nothing to tag (the common case for constants)
            return func(*args, **kwargs)
        if mixed:
            target = args[0] if _is_inplace(func) and args and isinstance(args[0], torch.Tensor) else None
            if target is not None and get_vma(target) != union:
                self._widen_inplace(func, target, union)
            if not self.audit:
                passed: list[torch.Tensor] = []  # invariant constants handed to func as they are
                if flat and not kwargs:  # tensors and numbers only (x * cos): one loop, no pytree walk
                    args = self._agree_flat(args, union, target, passed)
                else:
                    args, kwargs = self._agree((args, kwargs), union, skip=target, passed=passed)
                if passed:
                    out = func(*args, **kwargs)
                    if type(out) is torch.Tensor and not _is_wrapped(out):
                        if out is passed[0] or (len(passed) > 1 and any(out is c for c in passed)):
                            out = _not_one_of(out, passed)
                        out.__dict__[_ATTR] = union  # (the common result, as below)
                        return out
                    out = _not_one_of(out, passed)
                    self._tag_out(out, union)
                    return out
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor and not self.audit and not _is_wrapped(out):
            out.__dict__[_ATTR] = union  # the common result: a plain tensor (_tag_through, inline)
        else:
            self._tag_out(out, union)
        return out

    def _tag_out(self, out: Any, union: frozenset[str]) -> None:
        """Tag an op's result (a tensor, or the tensors of a tuple / list) with ``union``."""
        if isinstance(out, torch.Tensor):
            self._tag(out, union)
        elif isinstance(out, (tuple, list)) and type(out) is not torch.Size:  # (a shape read: no tensor inside)
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._tag(o, union)

    def _widen_inplace(self, func: Any, target: torch.Tensor, union: frozenset[str]) -> None:
        if self.audit:
            missing = sorted(union - get_vma(target))
            if _grad_flows(target):
                raise _unvaried(getattr(func, "__name__", str(func)), missing, "the tensor it writes in place")
            self._tag(target, union)
            return
        if target.requires_grad:
            missing = sorted(union - get_vma(target))
            raise ShardingError(
                f"{getattr(func, '__name__', func)}: an in-place op would make a tensor that is invariant over "
                f"{missing} (and requires grad) vary over them; its gradient would miss the psum over "
                f"{missing}. Write it out of place (y = x + v), or make it varying first: "
                f"x = fs.pvary(x, {tuple(missing)})."
            )
        setattr(target, _ATTR, union)

    def _pass(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def _grad(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if inputs is not None:  # torch.func.grad / vjp hand back the tensors these wrap: tag_like tags those too
            tag_like(tuple(out), tuple(inputs), audited=self.audit)
        return out


def one_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` seen by the vma tracking as one op: its results vary over the union of its tensor operands' axes
    (each operand that lacks some made varying first, with ``Pvary``, as for any torch op; an invariant constant
    passed as it is), and the ops inside run with the vma mode off the stack: not dispatched through it, not
    tagged. One dispatch instead of one per op inside (~2 us each: ``rms_norm``'s 8, ``rope``'s 10).

    For library functions of plain local math whose every result depends on every operand that varies (so the
    union is each result's vma): elementwise chains, a norm, rope, attention on local blocks. Not for a function
    that calls a collective or ``fs.pvary`` (they read the tags this skips), or whose results differ in their
    axes (``(x * 2, w)``). Its tensor operands are positional or keyword arguments, or in a list / tuple argument
    (one level deep, as ``torch.cat``'s). Outside ``shard_map(check_vma=True)``, in an audited call, under
    ``torch._C.DisableTorchFunction`` or with another torch function mode on the stack: ``fn`` itself, its ops
    seen one by one as before.

    Example:
        >>> @one_op
        ... def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ...     return (x * 2 + 1) * w  # inside shard_map: one dispatch through the vma mode, not three
        >>> scale(torch.ones(2), torch.ones(2))
        tensor([3., 3.])
    """

    def op(*args: Any, **kwargs: Any) -> Any:
        mode = getattr(_active, "mode", None)
        if (
            mode is None
            or mode.audit
            or not torch._C._is_torch_function_enabled()
            or torch._C._len_torch_function_stack() != 1
            or torch._C._get_function_stack_at(0) is not mode
        ):
            return fn(*args, **kwargs)
        torch._C._pop_torch_function_stack()  # as torch does around a mode's __torch_function__
        _active.mode = None  # (and no custom Function inside is taken for a user's: its operands are untagged)
        try:
            return mode.__torch_function__(fn, (), args, kwargs)
        finally:
            _active.mode = mode
            torch._C._push_on_torch_function_stack(mode)

    _INPLACE_CACHE[fn] = False  # (whatever its name: its operands are not written)
    op.__wrapped__ = fn  # type: ignore[attr-defined]
    op.__name__ = getattr(fn, "__name__", "op")
    op.__qualname__ = getattr(fn, "__qualname__", op.__name__)
    op.__doc__ = fn.__doc__
    op.__module__ = getattr(fn, "__module__", __name__)
    return op


def _not_one_of(out: Any, passed: list[torch.Tensor]) -> Any:
    """``out``, with a result that is one of the constants ``passed`` to the op as they are (``c.to(x)``,
    ``c.type_as(x)`` hand ``c`` itself back) replaced by a view of it, which takes the op's tag in its stead."""
    if isinstance(out, torch.Tensor):
        if any(out is c for c in passed):
            with torch._C.DisableTorchFunction():
                return out.view_as(out)
        return out
    if isinstance(out, (tuple, list)) and type(out) is not torch.Size:
        if any(o is c for o in out for c in passed):
            with torch._C.DisableTorchFunction():
                fresh = [o.view_as(o) if any(o is c for c in passed) else o for o in out]
            return type(out)(fresh) if type(out) in (tuple, list) else out
    return out


def _read(self: VmaMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Marks the reads of a tensor's metadata in ``_SPECIAL``: handled inline (their result holds no tensor)."""
    return func(*args, **kwargs)


#: reads of a tensor's metadata: what comes out is no tensor (a size, a dtype, a flag), so there is nothing to tag;
#: and ``_base``, the tensor a view views (tagging it with the view's axes would retag that tensor)
_READS = (
    *(
        getattr(torch.Tensor, n).__get__
        for n in (
            "shape",
            "dtype",
            "device",
            "ndim",
            "requires_grad",
            "is_cuda",
            "is_leaf",
            "layout",
            "is_sparse",
            "grad_fn",
            "_version",
            "is_meta",
            "is_quantized",
            "is_nested",
            "_base",  # (a tensor, but no result of an op: the viewed tensor as it is, its own tag kept)
        )
    ),
    *(
        getattr(torch.Tensor, n)
        for n in (
            "dim",
            "size",
            "numel",
            "nelement",
            "stride",
            "is_floating_point",
            "is_complex",
            "is_contiguous",
            "element_size",
            "data_ptr",
            "storage_offset",
            "__len__",
            "get_device",
            "ndimension",
        )
    ),
)

#: the autograd entry points the mode lets through (its method for each): backward untouched, grad re-tagging;
#: and the metadata reads, handed straight to torch
_SPECIAL: dict[Any, Callable[..., Any]] = {
    **{f: _read for f in _READS},
    **{f: VmaMode._pass for f in _PASS},
    **{f: VmaMode._grad for f in _GRAD},
}


# -- tags across a transform boundary ------------------------------------------------------------------------
def tags_of(tree: Any) -> list[frozenset[str] | None]:
    """The axes of each leaf of ``tree`` (None for a non-tensor leaf), to put back on fresh tensors later."""
    return [get_vma(t) if isinstance(t, torch.Tensor) else None for t in optree.tree_leaves(tree)]


def tag_leaves(tree: Any, tags: list[frozenset[str] | None]) -> None:
    """Put ``tags`` (from :func:`tags_of`) back on the tensor leaves of ``tree``."""
    for t, vma in zip(optree.tree_leaves(tree), tags, strict=False):
        if isinstance(t, torch.Tensor) and vma is not None:
            _tag_through(t, vma)


def tag_like(grads: Any, inputs: Any, audited: bool = False) -> None:
    """Tag each tensor leaf of ``grads`` with the axes of the matching leaf of ``inputs`` (a cotangent varies
    over what its primal varies over); as :class:`Audited` with ``audited``."""
    tag = _tag_audited if audited else _tag_through
    # None leaves kept, so an unused input's None gradient keeps the others aligned with their inputs
    g_leaves = optree.tree_leaves(grads, none_is_leaf=True)
    for g, x in zip(g_leaves, optree.tree_leaves(inputs, none_is_leaf=True), strict=False):
        if isinstance(g, torch.Tensor) and isinstance(x, torch.Tensor):
            tag(g, get_vma(x))


# -- user autograd Functions -------------------------------------------------------------------------------
# ``Function.apply`` is no torch function, so the mode never sees it: without this hook an invariant operand
# of a user's custom Function (a fused kernel) would get one device's share of its gradient instead of the
# sum. The hook costs one thread-local lookup per ``apply`` outside shard_map; funcshard's own Functions
# (whose operands lax prepares itself) pass straight through.
_original_apply = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]
_OWN: dict[type, bool] = {}


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    mode = getattr(_active, "mode", None)
    if mode is None or not torch._C._is_torch_function_enabled():
        return _original_apply(cls, *args, **kwargs)
    own = _OWN.get(cls)
    if own is None:
        own = _OWN[cls] = cls.__module__.split(".")[0] == "funcshard"
    if own:
        return _original_apply(cls, *args, **kwargs)
    return mode.custom_function(_original_apply, cls, args, kwargs)


if not getattr(torch.autograd.Function.apply, "_funcshard", False):
    _apply._funcshard = True  # type: ignore[attr-defined]
    torch.autograd.Function.apply = classmethod(_apply)  # type: ignore[method-assign, assignment]


# -- torch.func transform boundaries -------------------------------------------------------------------------
# A transform hands its results back unwrapped from its level: ``torch.vmap`` as a fresh view of the batched
# value (whose ``_base`` is the root of the storage, perhaps a differently tagged argument), ``vjp`` / ``jvp`` /
# ``grad_and_value`` their primal outputs unwrapped from the grad level. These two functions are where that
# happens, inside torch itself; each result takes the axes of the value it unwraps, so no transform's output is
# left untagged (and so taken as invariant) inside shard_map.


def _keeping_tag(unwrap: Any) -> Any:
    def unwrap_tagged(x: Any, *args: Any) -> Any:
        y = unwrap(x, *args)
        if getattr(_active, "mode", None) is not None and isinstance(x, torch.Tensor) and y is not x:
            v = find_vma(x)
            if v is not None:
                set_vma(y, v)
        return y

    unwrap_tagged._funcshard = True  # type: ignore[attr-defined]
    return unwrap_tagged


for _mod, _name in ((_vmap_impl, "_remove_batch_dim"), (_eager, "_unwrap_for_grad")):
    if not getattr(getattr(_mod, _name), "_funcshard", False):
        setattr(_mod, _name, _keeping_tag(getattr(_mod, _name)))
