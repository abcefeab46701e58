"""``value_and_grad``: JAX's ``(value, grads)``, keeping vma tags, with no memory spent on a graph nobody asks for.

Two paths compute the same numbers:

- **Plain autograd** (the common case: the train step): the differentiated inputs are detached leaves that
  require grad, ``f`` runs once and ``torch.autograd.grad`` (no ``create_graph``) frees each saved tensor as
  soon as the backward has used it. ``torch.func.grad_and_value`` always differentiates with
  ``create_graph=True`` (to compose with other transforms), which keeps the backward's own intermediates alive
  until it returns: about 2.5x the activation memory of the step (``bench/memory.py``).
- **torch.func** (the fallback, exactly as before): when a higher derivative may be asked for, that is when
  a torch.func transform is active (``grad``, ``vjp``, ``jvp``, ``vmap`` around this call), a forward-mode AD
  level is open, or an argument requires grad under an enabled outer autograd. A value closed over by ``f``
  that requires grad is found by walking ``f``'s graph after the forward: then the gradients are computed
  with ``create_graph=True`` and the value keeps its graph, so an outer ``backward`` sees through them as it
  does through ``torch.func``.

Inside ``shard_map`` every value carries the set of mesh axes it varies over (see ``_vma``). The tensors
``torch.func`` hands back are fresh, untagged ones, so this wrapper tags them again: each gradient leaf with
the axes of its input leaf (the gradient of a global function is laid out like its input), the value and
any ``aux`` tensors with the axes they had inside ``f``. Optimisers read those tags to tell sharded
gradients from replicated ones; ``shard_map`` reads them to check ``out_specs``.

Example:
    >>> import torch
    >>> from funcshard._src.autodiff.grad import value_and_grad
    >>> loss, g = value_and_grad(lambda w: (w**2).sum())(torch.tensor([1.0, 2.0]))
    >>> loss, g
    (tensor(5.), tensor([2., 4.]))
"""

from __future__ import annotations

import logging
import operator
import types
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.autograd.graph import _engine_run_backward

from ..collectives.vma import (
    active_mode,
    copy_vmas,
    get_vma,
    set_vma,
    set_vmas,
    settle,
    tag_leaves,
    tag_like,
    tag_through,
    tags_of,
)
from ..errors import ConfigError
from ..runtime.context import dynamo_tracing, observer, swap_overlap, tangents_possible, transforms_active

__all__ = ["graph_walk", "has_tangent", "reaches_other_leaf", "value_and_grad"]

PyTree = Any


def _check_argnums(argnums: Any) -> tuple[int, ...]:
    # a step that makes its value_and_grad on every call passes the same object each time (a literal tuple is a
    # constant of the code, a small int is cached): checked once per object. By identity, not equality: True == 1
    # and (1.0,) == (1,), which the check refuses.
    hit = _ARGNUMS.get(id(argnums))
    if hit is not None and hit[0] is argnums:
        return hit[1]
    nums = _checked_argnums(argnums)
    if type(argnums) is int or type(argnums) is tuple:  # immutable: its check holds for as long as it lives
        if len(_ARGNUMS) >= 256:
            _ARGNUMS.clear()
        _ARGNUMS[id(argnums)] = (argnums, nums)  # (held, so that its id is not reused while it is here)
    return nums


#: id of an argnums object that passed the check -> (that object, its tuple of ints)
_ARGNUMS: dict[int, tuple[Any, tuple[int, ...]]] = {}
#: argnums naming the first arguments in order, ``(0,)`` to ``(0, ..., 15)`` (then every argument may be taken as is)
_IN_ORDER = frozenset(tuple(range(k)) for k in range(1, 17))


def _checked_argnums(argnums: Any) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else _as_ints(argnums)
    if (
        not isinstance(nums, tuple)
        or not nums
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums)
        or len(set(nums)) != len(nums)
    ):
        raise ConfigError(
            f"value_and_grad: argnums must be an int or a non-empty tuple of distinct ints, found {argnums!r}; "
            f"write argnums=0 or argnums=(0, 1)."
        )
    return nums


def value_and_grad(
    f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, PyTree]]:
    """The function computing ``f``'s value and its gradient with respect to the arguments ``argnums``.

    ``torch.func.grad_and_value`` in JAX's order: ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux=True``. ``grads`` has the structure of ``args[argnums]`` (a tuple
    of such trees when ``argnums`` is a tuple). Inside ``shard_map`` the gradients are those of the global
    function (the collectives' backwards do the reductions), and each gradient leaf is tagged as varying over
    the same mesh axes as its input leaf, so ``fs.optim`` can tell sharded from replicated gradients.

    Outside other transforms the gradients come from ``torch.autograd.grad`` without ``create_graph`` (each
    activation freed as soon as the backward has used it, as ``loss.backward()`` does); nested in a torch.func
    transform, under forward-mode AD, or with an argument that requires grad, ``torch.func.grad_and_value``
    (higher derivatives work). The numbers are the same either way.

    Args:
        f: a function returning a scalar tensor (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional argument(s) to differentiate; an int or a tuple of ints (numpy integers
            too), negative ones counting from the last argument.
        has_aux: ``f`` returns ``(value, aux)``; ``aux`` (any pytree) is passed through, not differentiated.

    Returns:
        A function of the same arguments as ``f`` returning ``(value, grads)``.

    Raises:
        ConfigError: ``f`` is not callable, or ``argnums`` is not an int / tuple of distinct ints in range.

    Example:
        >>> f = lambda w, x: ((x @ w) ** 2).sum()
        >>> w, x = torch.ones(2, 1), torch.ones(3, 2)
        >>> value, (gw, gx) = value_and_grad(f, argnums=(0, 1))(w, x)
        >>> value.item(), gw.shape, gx.shape
        (12.0, torch.Size([2, 1]), torch.Size([3, 2]))
    """
    if not callable(f):
        raise ConfigError(f"value_and_grad: expected a function as first argument, found {type(f).__name__}.")
    if type(argnums) is not int and type(argnums) is not tuple:  # (the common forms pass as they are)
        argnums = _as_ints(argnums)
    return _ValueAndGrad(f, argnums, _check_argnums(argnums), bool(has_aux))


def _as_ints(argnums: Any) -> Any:
    """numpy integers (``np.int64(1)``, JAX takes them) as ints, alone or in a tuple; anything else (bools,
    floats) unchanged, for the check to refuse; a list as a tuple."""

    def one(i: Any) -> Any:
        if isinstance(i, (bool, int, torch.Tensor)) or not hasattr(i, "__index__"):
            return i
        return operator.index(i)

    if type(argnums) in (tuple, list):  # a list too, as JAX takes it
        return tuple(one(i) for i in argnums)
    return one(argnums)


class _ValueAndGrad:
    # The function value_and_grad returns: a callable object carrying ``f``'s name and docstring (and
    # ``__wrapped__``) as ``functools.wraps`` would, at a tenth of its cost; the README's step makes one on
    # every call (``fs.value_and_grad(loss_fn)(params, batch)`` inside the shard_map'd function). A call on the
    # plain autograd path (the step's) keeps its state in locals, no object made per call (threads may share the
    # object: sim devices); one through torch.func makes a ``_GradCall``, whose ``inner`` records the tags.

    def __init__(self, f: Callable[..., Any], argnums: Any, nums: tuple[int, ...], has_aux: bool) -> None:
        self.__wrapped__ = f
        self._argnums, self._nums, self._has_aux = argnums, nums, has_aux

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, PyTree]:
        nums, n = self._nums, len(args)
        if min(nums) < 0 or max(nums) >= n:
            for i in nums:
                if not -n <= i < n:
                    raise ConfigError(
                        f"{_name(self.__wrapped__)}: argnums={self._argnums!r} names positional argument {i}, but "
                        f"the function was called with {n} positional arguments."
                    )
            if len({i % n for i in nums}) != len(nums):  # (0, -2) with two arguments: argument 0 twice
                raise ConfigError(
                    f"{_name(self.__wrapped__)}: argnums={self._argnums!r} names one positional argument twice "
                    f"(called with {n} positional arguments, so {[i % n for i in nums]}); name each once."
                )
        if dynamo_tracing():  # torch.compile traces this call: torch.func's transform, which dynamo traces whole
            _check_differentiable(self.__wrapped__, args, nums)
            return _GradCall(self.__wrapped__, self._argnums, nums, self._has_aux)._func(args, kwargs)
        xs = list(args) if n == len(nums) and nums in _IN_ORDER else [args[i] for i in nums]
        # each differentiated argument flattened once, for the check and for the plain path; None: every one is
        # a tensor (the common step's arguments), its own leaf
        flat = None
        for x in xs:
            if not isinstance(x, torch.Tensor):
                flat = [_flatten(x) for x in xs]
                break
        # this wrapper's own reads (requires_grad, dtypes, detach, zeros) skip the vma mode: it re-tags what it
        # returns itself, and each read through the mode costs a Python dispatch
        with torch._C.DisableTorchFunction():
            plain = _plain_autograd_ok(args, kwargs, nums, (xs,) if flat is None else [lv for lv, _ in flat])
            if plain:  # (the leaf copies made under the same switch)
                copies = _leaf_copies(xs if flat is None else [x for lv, _ in flat for x in lv])
        if plain:
            return self._plain(args, kwargs, copies, flat)
        _check_differentiable(self.__wrapped__, args, nums)
        return _GradCall(self.__wrapped__, self._argnums, nums, self._has_aux)._func(args, kwargs)

    def _plain(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        copies: tuple[list[torch.Tensor], list[frozenset[str] | None]],
        flat: list[tuple[list[Any], Any]] | None,
    ) -> tuple[Any, PyTree]:
        """Gradients by ``torch.autograd.grad`` on detached leaf copies of the differentiated arguments (``copies``:
        :func:`_leaf_copies` of their leaves in order; ``flat``: each one's leaves and structure, or None where each
        is one tensor); the value and ``aux`` tagged as they were inside ``f``, each gradient like its input."""
        nums, has_aux = self._nums, self._has_aux
        leaves, tags = copies
        args = _substituted(args, nums, leaves, flat)
        outer = torch.is_grad_enabled()
        aux_tags = None
        if not outer:  # like torch.func.grad, an outer no_grad does not stop the differentiation
            _set_grad(True)
        try:  # (written out, no context object: already on is the common case, nothing to switch)
            out = self.__wrapped__(*args, **kwargs)
            if has_aux:
                value, aux = _aux_pair(out, self.__wrapped__)
                aux_tags = tags_of(aux)  # (the fresh detached tensors returned get them back)
            else:
                value, aux = out, None
            with torch._C.DisableTorchFunction():
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    _check_scalar(_name(self.__wrapped__), value)
                value_tag = get_vma(value)  # (read here: a view's base, which needs no vma mode)
                differentiable = value.requires_grad
                # a value f closed over that requires grad: keep the graph to it (an outer backward may follow)
                keep, last = graph_walk([value], leaves) if outer and differentiable else (False, None)
            if differentiable:
                # dist: the gradient reductions travel while the backward goes on (the last node's: synchronous)
                prev = swap_overlap((True, None if keep else last))  # (as ``with Overlap(...)``, no scope object)
                try:
                    found = _autograd_grad(value, leaves, keep)
                finally:
                    swap_overlap(prev)
            else:  # f does not depend on its inputs: zero gradients, as torch.func gives
                found = (None,) * len(leaves)
        finally:
            if not outer or not torch.is_grad_enabled():  # (f may have switched it off and not back)
                _set_grad(outer)
        # a gradient summed over the data axes may still be travelling (dist overlaps them with the backward);
        # each gradient varies over what its input varies over (untagged input: invariant)
        grads_flat = []
        with torch._C.DisableTorchFunction():  # tagged here, no torch.func wrapper on this path
            for g, x in zip(found, leaves, strict=True):
                if g is None:
                    g = torch.zeros_like(x)
                elif type(g) is not torch.Tensor:
                    g = settle(g)
                grads_flat.append(g)
            set_vmas(grads_flat, tags)
            if not keep:  # (a pending loss sum, whose backward was seeded without it, is waited for here)
                value = (value if type(value) is torch.Tensor else settle(value)).detach()
                if aux is not None:
                    aux = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)
            set_vma(value, value_tag)  # the value varies over what it did inside f
        obs = observer()
        if obs is not None:  # an ahead-of-time analysis (shard_map's lower) counts these as params and grads
            obs.note("params", leaves)
            obs.note("grads", grads_flat)
        if flat is None:  # each gradient is one tensor
            grads = grads_flat[0] if isinstance(self._argnums, int) else tuple(grads_flat)
        else:
            per_arg = _unflatten_args(grads_flat, flat)
            grads = per_arg[0] if isinstance(self._argnums, int) else tuple(per_arg)
        if not has_aux:
            return value, grads
        assert aux_tags is not None  # (set with aux above)
        tag_leaves(aux, aux_tags)
        return (value, aux), grads

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # a method, as a function would be
        return self if obj is None else types.MethodType(self, obj)

    @property
    def __name__(self) -> str:  # type: ignore[override]
        return getattr(self.__wrapped__, "__name__", type(self.__wrapped__).__name__)

    def __getattr__(self, attr: str) -> Any:  # __qualname__ (which a class cannot hold as a property)
        if attr == "__qualname__":
            return getattr(self.__wrapped__, "__qualname__", self.__name__)
        raise AttributeError(attr)

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return getattr(self.__wrapped__, "__doc__", None)

    def __repr__(self) -> str:
        return f"<value_and_grad of {self.__wrapped__!r}>"


def _leaf_copies(xs: list[Any]) -> tuple[list[torch.Tensor], list[frozenset[str] | None]]:
    """Detached copies of ``xs`` that require grad, each tagged as its tensor is (called with torch functions
    disabled, no torch.func transform active), and each one's tag (None: untagged), for its gradient."""
    leaves: list[torch.Tensor] = []
    for x in xs:  # (a loop: no comprehension's frame)
        leaves.append(x.detach().requires_grad_())
    # the tag each argument had (its own, else a view's base's; untagged stays untagged: check_vma=False)
    return leaves, copy_vmas(leaves, xs)


def _name(f: Callable[..., Any]) -> str:
    """``value_and_grad(<f's name>)``, for messages."""
    return f"value_and_grad({getattr(f, '__name__', 'f')})"


def _aux_pair(out: Any, f: Callable[..., Any]) -> tuple[Any, Any]:
    """``out``, what ``f`` returned with ``has_aux=True``, as its (value, aux) pair.

    Raises:
        ConfigError: ``out`` is not a pair.
    """
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError(
            f"{_name(f)}: has_aux=True needs f to return a (value, aux) pair, found {type(out).__name__}."
        )
    return out


class _GradCall:
    """One call of a :func:`value_and_grad` function through ``torch.func.grad_and_value`` of ``f``, with the vma
    tags the value, ``aux`` and gradients had inside put back on the fresh tensors torch.func returns."""

    def __init__(self, f: Callable[..., Any], argnums: Any, nums: tuple[int, ...], has_aux: bool) -> None:
        self.f, self.argnums, self.nums, self.has_aux = f, argnums, nums, has_aux
        self.tags: dict[str, list[frozenset[str] | None]] = {}
        self.aux: tuple[Any, list[Any]] | None = None
        self.traced = dynamo_tracing()  # dynamo traces the call: outside any shard_map (opaque to it), no tags to keep

    @property
    def name(self) -> str:
        """``value_and_grad(<f's name>)``, for messages."""
        return _name(self.f)

    def inner(self, *a: Any, **kw: Any) -> Any:
        out = self.f(*a, **kw)
        # torch.func returns fresh tensors without our tags: remember the vma they had in here
        if self.traced and not self.has_aux:
            return out
        if not self.has_aux:
            with torch._C.DisableTorchFunction():  # reads (a view's base) that need no vma mode
                self.tags["value"] = [get_vma(out)] if isinstance(out, torch.Tensor) else tags_of(out)
            return out
        _aux_pair(out, self.f)
        if not self.traced:
            self.tags["value"], self.tags["aux"] = tags_of(out[0]), tags_of(out[1])
        # torch.func only passes tensors through aux (JAX passes anything): carry the rest aside
        leaves, treedef = optree.tree_flatten(out[1])
        self.aux = (treedef, leaves)
        return out[0], tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def _func(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, PyTree]:
        """Gradients by ``torch.func.grad_and_value`` (composes with an enclosing transform)."""
        single = isinstance(self.argnums, int)
        grad_fn = torch.func.grad_and_value(
            self.inner, argnums=self.nums[0] if single else self.nums, has_aux=self.has_aux
        )
        grads, out = grad_fn(*args, **kwargs)
        value = out[0] if self.has_aux else out
        aux = None
        if self.has_aux:
            assert self.aux is not None  # set by inner, which grad_and_value has called
            treedef, leaves = self.aux
            it = iter(out[1])
            aux = optree.tree_unflatten(treedef, [next(it) if isinstance(x, torch.Tensor) else x for x in leaves])
        return self._finish(args, value, aux, grads)

    def _finish(self, args: Any, value: Any, aux: Any, grads: PyTree) -> tuple[Any, PyTree]:
        """The tags put back (value and aux as inside ``f``, gradients like their inputs); JAX's order."""
        if self.traced:
            return ((value, aux), grads) if self.has_aux else (value, grads)
        tags = self.tags.get("value", [])
        if isinstance(value, torch.Tensor) and len(tags) == 1:  # the common value: one tensor
            if tags[0] is not None:
                tag_through(value, tags[0])
        else:
            tag_leaves(value, tags)
        if isinstance(self.argnums, int):
            tag_like(grads, args[self.nums[0]])
        else:
            for g, i in zip(grads, self.nums, strict=True):
                tag_like(g, args[i])
        obs = observer()
        if obs is not None:  # an ahead-of-time analysis (shard_map's lower) counts these as params and grads
            obs.note("params", [args[i] for i in self.nums])
            obs.note("grads", grads)
        if not self.has_aux:
            return value, grads
        tag_leaves(aux, self.tags.get("aux", []))
        return (value, aux), grads


def _autograd_grad(value: torch.Tensor, leaves: list[torch.Tensor], keep: bool) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(value, leaves, allow_unused=True, create_graph=keep)``: for a plain real scalar
    ``value`` with no torch function mode around but this thread's vma mode, the engine's own call, as
    ``torch.autograd.grad`` ends in (its argument handling and, inside shard_map, a dispatch through the vma
    mode skipped: the gradients are tagged by the caller). The backward runs with the vma mode off the stack,
    as it does when ``torch.autograd.grad`` is dispatched through the mode (which pops itself to handle it). A
    pending ``value`` (an asynchronous collective's result) is not waited for: the backward is seeded with 1."""
    if type(value).__name__ == "AsyncCollectiveTensor":
        # a pending result (a loss summed asynchronously under dist): the backward is seeded with an explicit 1,
        # so that nothing reads the value (ones_like would wait for it) and the sum travels on through the backward
        seed = torch.ones((), dtype=value.dtype, device=value.device)  # [] : d value / d value
        return torch.autograd.grad(value, leaves, grad_outputs=(seed,), allow_unused=True, create_graph=keep)
    depth = torch._C._len_torch_function_stack()
    if (
        depth > 1
        or type(value) is not torch.Tensor
        or (depth == 1 and torch._C._get_function_stack_at(0) is not active_mode())  # someone else's mode sees it
    ):
        return torch.autograd.grad(value, leaves, allow_unused=True, create_graph=keep)
    mode = torch._C._pop_torch_function_stack() if depth else None
    try:
        if not value.is_floating_point():  # (a complex value: torch.autograd.grad's error)
            return torch.autograd.grad(value, leaves, allow_unused=True, create_graph=keep)
        ones = torch.ones_like(value, memory_format=torch.preserve_format)  # [] : d value / d value
        if (_HOST_ONLY[0] if _HOST_ONLY else _host_only()) and not _graph_log.isEnabledFor(logging.DEBUG):
            # what _engine_run_backward does around the engine is for the engine's device threads (the caller's
            # contextvars, stashed for them) and for autograd's debug log: no device, no log, the engine itself
            return _run_backward((value,), (ones,), keep, keep, tuple(leaves), True, accumulate_grad=False)
        return _engine_run_backward((value,), (ones,), keep, keep, tuple(leaves), True, accumulate_grad=False)
    finally:
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)


_run_backward = torch.autograd.Variable._execution_engine.run_backward  # (what _engine_run_backward calls)
_graph_log = logging.getLogger("torch.autograd.graph")  # (the logger _engine_run_backward asks)
_HOST_ONLY: list[bool] = []


def _host_only() -> bool:
    """Whether this process has no accelerator (asked once): the autograd engine then starts no device thread, and
    every backward runs on the thread that asks for it."""
    if not _HOST_ONLY:
        accelerator = getattr(torch, "accelerator", None)
        found = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
        _HOST_ONLY.append(not found)
    return _HOST_ONLY[0]


_LEAF = optree.tree_flatten(0, none_is_leaf=True)[1]  # the structure of a bare leaf (one tensor argument)


def _flatten(x: Any) -> tuple[list[Any], Any]:
    """``optree.tree_flatten(x)`` (``None`` an empty subtree, whose gradient is ``None``, as in JAX); a tensor (the
    common argument) without the pytree walk."""
    if isinstance(x, torch.Tensor):
        return [x], _LEAF
    return optree.tree_flatten(x)


def _substituted(
    args: tuple[Any, ...], nums: tuple[int, ...], leaves: list[torch.Tensor], flat: list[tuple[list[Any], Any]] | None
) -> Any:
    """``args`` with the differentiated ones (positions ``nums``) replaced by their leaf copies ``leaves`` (``flat``:
    each one's leaves and structure, or None where each is one tensor)."""
    if flat is None and len(args) == len(nums) and nums in _IN_ORDER:
        return leaves  # (every argument differentiated, in order)
    out = list(args)
    if flat is None:
        for i, c in zip(nums, leaves, strict=True):
            out[i] = c
    else:
        for i, tree in zip(nums, _unflatten_args(leaves, flat), strict=True):
            out[i] = tree
    return out


def _unflatten_args(leaves: list[Any], flat: list[tuple[list[Any], Any]]) -> list[Any]:
    """``leaves`` (the differentiated arguments' leaves, or their gradients, in order) cut back into one tree per
    argument by ``flat`` (:func:`_flatten` of each argument): a bare leaf is itself, no tree rebuilt."""
    trees = []
    start = 0
    for lv, treedef in flat:
        part = leaves[start : start + len(lv)]
        trees.append(part[0] if treedef is _LEAF else optree.tree_unflatten(treedef, part))
        start += len(lv)
    return trees


def _check_differentiable(f: Callable[..., Any], args: tuple[Any, ...], nums: tuple[int, ...]) -> None:
    """Raise where a leaf of a differentiated argument is no floating-point (or complex) tensor, naming it, as
    JAX's ``grad`` refuses integer inputs (torch.func's own errors name neither the argument nor the leaf).

    Raises:
        ConfigError: such a leaf.
    """
    for i in nums:
        for path, x in zip(*optree.tree_flatten_with_path(args[i])[:2], strict=True):
            if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
                continue
            found = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"a value of type {type(x).__name__}"
            where = "/".join(map(str, path))
            raise ConfigError(
                f"{_name(f)}: positional argument {i}{f' leaf {where!r}' if where else ''} is {found}; only "
                f"floating-point (or complex) tensors can be differentiated. Pass it in an argument not in argnums "
                f"(argnums={nums!r}), or leave it out of the differentiated tree."
            )


def _set_grad(on: bool) -> None:
    """``torch.set_grad_enabled(on)`` without passing through a torch function mode (the vma mode would dispatch
    the switch in Python)."""
    with torch._C.DisableTorchFunction():
        torch._C._set_grad_enabled(on)


def _plain_autograd_ok(args: tuple[Any, ...], kwargs: dict[str, Any], nums: tuple[int, ...], groups: Any) -> bool:
    """Whether plain ``torch.autograd.grad`` gives what ``torch.func.grad_and_value`` would, at less memory:
    no torch.func transform around the call, no forward-mode AD tangent on an argument, floating-point
    tensors to differentiate, and no argument that requires grad under an enabled outer autograd (which may
    want the gradients' graph). ``groups``: lists of the differentiated arguments' leaves (None a leaf)."""
    if transforms_active() or (tangents_possible() and has_tangent((args, kwargs))):
        return False
    outer = torch.is_grad_enabled()
    for xs in groups:
        for x in xs:
            if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
                return False  # torch.func raises its own error for these
            if outer and x.requires_grad:
                return False
    if outer and (kwargs or len(args) > len(nums)):  # the other arguments (the differentiated ones were read above)
        rest = [a for i, a in enumerate(args) if i not in nums and i - len(args) not in nums]
        for x in optree.tree_leaves((rest, kwargs)):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                return False
    return True


def has_tangent(tree: Any) -> bool:
    """Whether a tensor leaf of ``tree`` is a forward-mode AD dual tensor (``torch.autograd.forward_ad``; the
    sim backend keeps a level open around its devices, so the level alone says nothing)."""
    if torch.autograd.forward_ad._current_level < 0:
        return False
    return any(
        isinstance(x, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(x).tangent is not None
        for x in optree.tree_leaves(tree)
    )


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _check_scalar(name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        found = (
            type(value).__name__ if not isinstance(value, torch.Tensor) else f"a tensor of shape {tuple(value.shape)}"
        )
        raise ConfigError(
            f"{name}: f must return a scalar (0-dim) tensor to be differentiated, found {found}; reduce it first "
            f"(e.g. loss.mean()), or return (value, aux) with has_aux=True."
        )


def reaches_other_leaf(outs: list[torch.Tensor], own: list[torch.Tensor]) -> bool:
    """Whether the graph of ``outs`` reaches a leaf that requires grad other than ``own`` (a value the function
    closed over): a walk over the graph's nodes, stopping at the first such leaf."""
    return graph_walk(outs, own)[0]


def graph_walk(outs: list[torch.Tensor], own: list[torch.Tensor]) -> tuple[bool, Any]:
    """One walk over the graph of ``outs``: whether it reaches a leaf that requires grad other than ``own``
    (stopping there), and else the node a backward from ``outs`` runs last: the one made first in the forward
    (lowest sequence number; the engine runs ready nodes highest first, and whatever consumes a node's output
    was made before it), or None.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x.exp()
        >>> graph_walk([y.sum()], [x]) == (False, y.grad_fn)
        True
    """
    ids = set(map(id, own))
    for o in outs:
        if o.grad_fn is None and o.requires_grad and id(o) not in ids:  # an output is such a leaf
            return True, None
    acc = _ACC[0] if _ACC else _accumulate_grad()
    # every node met stays referenced (in ``seen``, which compares node objects by identity: torch hands out one
    # Python object per node while it lives), so none is met as a new one; ``seen`` starts with None (an input
    # that needs no gradient), so one lookup skips both. A leaf's node is checked where it is first met, never
    # stacked (it has no inputs, and no sequence number of the forward's). The lowest sequence number is a sink's
    # (a node none of whose inputs is another node's output): every other node has an input made before it in the
    # forward, with a lower number (a thread's numbers only grow)
    seen: set[Any] = {None}
    stack = []
    for o in outs:
        fn = o.grad_fn
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.append(fn)
    last, first_nr = None, _NO_NR
    pop, push, add = stack.pop, stack.append, seen.add
    while stack:
        node = pop()
        nr = node._sequence_nr()
        if nr < first_nr:
            last, first_nr = node, nr
        for n, _ in node.next_functions:
            if n in seen:
                continue
            add(n)
            if type(n) is acc:  # a leaf's node: only these have a .variable
                if id(n.variable) not in ids:
                    return True, None
            else:
                push(n)
    return False, last


_NO_NR = 1 << 64  # above every node's sequence number (a uint64 in torch)


_ACC: list[type] = []


def _accumulate_grad() -> type:
    """The type of the autograd node of a leaf that requires grad (``AccumulateGrad``)."""
    if not _ACC:
        with torch.enable_grad():
            leaf = torch.zeros(1, requires_grad=True)
            _ACC.append(type(leaf.view_as(leaf).grad_fn.next_functions[0][0]))
    return _ACC[0]
