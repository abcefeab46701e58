"""``value_and_grad``: JAX's ``(value, grads)`` on top of ``torch.func.grad_and_value``, keeping vma tags.

Inside ``shard_map`` every value carries the set of mesh axes it varies over (see ``_vma``). The tensors
``torch.func`` hands back are fresh, untagged ones, so this wrapper tags them again: each gradient leaf with
the axes of its input leaf (the gradient of a global function is laid out like its input), the value and
any ``aux`` tensors with the axes they had inside ``f``. Optimisers read those tags to tell sharded
gradients from replicated ones; ``shard_map`` reads them to check ``out_specs``.

Example:
    >>> import torch
    >>> from funcshard._grad import value_and_grad
    >>> loss, g = value_and_grad(lambda w: (w**2).sum())(torch.tensor([1.0, 2.0]))
    >>> loss, g
    (tensor(5.), tensor([2., 4.]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._errors import ConfigError
from ._vma import tag_leaves, tag_like, tags_of

__all__ = ["value_and_grad"]

PyTree = Any


def _check_argnums(argnums: Any) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
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

    Built on ``torch.func.grad_and_value`` but in JAX's order: ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux=True``. ``grads`` has the structure of ``args[argnums]`` (a tuple
    of such trees when ``argnums`` is a tuple). Inside ``shard_map`` the gradients are those of the global
    function (the collectives' backwards do the reductions), and each gradient leaf is tagged as varying over
    the same mesh axes as its input leaf, so ``fs.optim`` can tell sharded from replicated gradients.

    Args:
        f: a function returning a scalar tensor (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional argument(s) to differentiate; an int or a tuple of ints.
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
    nums = _check_argnums(argnums)
    has_aux = bool(has_aux)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PyTree]:
        return _GradCall(f, argnums, nums, has_aux)(args, kwargs)

    return wrapped


class _GradCall:
    """One call of a :func:`value_and_grad` function: ``torch.func.grad_and_value`` of ``f``, with the vma
    tags the value, ``aux`` and gradients had inside put back on the fresh tensors torch.func returns."""

    def __init__(self, f: Callable[..., Any], argnums: Any, nums: tuple[int, ...], has_aux: bool) -> None:
        self.f, self.argnums, self.nums, self.has_aux = f, argnums, nums, has_aux
        self.name = f"value_and_grad({getattr(f, '__name__', 'f')})"
        self.tags: dict[str, list[frozenset[str] | None]] = {}
        self.aux: tuple[Any, list[Any]] | None = None

    def inner(self, *a: Any, **kw: Any) -> Any:
        out = self.f(*a, **kw)
        # torch.func returns fresh tensors without our tags: remember the vma they had in here
        if not self.has_aux:
            self.tags["value"] = tags_of(out)
            return out
        if not isinstance(out, tuple) or len(out) != 2:
            raise ConfigError(
                f"{self.name}: has_aux=True needs f to return a (value, aux) pair, found {type(out).__name__}."
            )
        self.tags["value"], self.tags["aux"] = tags_of(out[0]), tags_of(out[1])
        # torch.func only passes tensors through aux (JAX passes anything): carry the rest aside
        leaves, treedef = optree.tree_flatten(out[1])
        self.aux = (treedef, leaves)
        return out[0], tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, PyTree]:
        for i in self.nums:
            if not -len(args) <= i < len(args):
                raise ConfigError(
                    f"{self.name}: argnums={self.argnums!r} names positional argument {i}, but the function was "
                    f"called with {len(args)} positional arguments."
                )
        single = isinstance(self.argnums, int)
        grad_fn = torch.func.grad_and_value(
            self.inner, argnums=self.nums[0] if single else self.nums, has_aux=self.has_aux
        )
        grads, out = grad_fn(*args, **kwargs)
        value = out[0] if self.has_aux else out
        tag_leaves(value, self.tags.get("value", []))
        if single:
            tag_like(grads, args[self.nums[0]])
        else:
            for g, i in zip(grads, self.nums, strict=True):
                tag_like(g, args[i])
        if not self.has_aux:
            return value, grads
        assert self.aux is not None  # set by inner, which grad_and_value has called
        treedef, leaves = self.aux
        it = iter(out[1])
        aux = optree.tree_unflatten(treedef, [next(it) if isinstance(x, torch.Tensor) else x for x in leaves])
        tag_leaves(aux, self.tags.get("aux", []))
        return (value, aux), grads
