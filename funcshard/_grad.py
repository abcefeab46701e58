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
        ValueError: ``f`` is not callable, or ``argnums`` is not an int / tuple of distinct ints in range.

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
    single = isinstance(argnums, int)
    has_aux = bool(has_aux)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PyTree]:
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ConfigError(
                    f"value_and_grad({getattr(f, '__name__', 'f')}): argnums={argnums!r} names positional argument "
                    f"{i}, but the function was called with {len(args)} positional arguments."
                )
        seen: dict[str, list[frozenset[str] | None]] = {}
        box: dict[str, Any] = {}

        def inner(*a: Any, **kw: Any) -> Any:
            out = f(*a, **kw)
            # torch.func returns fresh tensors without our tags: remember the vma they had in here
            if has_aux:
                if not isinstance(out, tuple) or len(out) != 2:
                    raise ConfigError(
                        f"value_and_grad({getattr(f, '__name__', 'f')}): has_aux=True needs f to return a "
                        f"(value, aux) pair, found {type(out).__name__}."
                    )
                seen["value"] = tags_of(out[0])
                seen["aux"] = tags_of(out[1])
                # torch.func only passes tensors through aux (JAX passes anything): carry the rest aside
                leaves, treedef = optree.tree_flatten(out[1])
                box["aux"] = (treedef, leaves)
                return out[0], tuple(x for x in leaves if isinstance(x, torch.Tensor))
            seen["value"] = tags_of(out)
            return out

        grad_fn = torch.func.grad_and_value(inner, argnums=nums[0] if single else nums, has_aux=has_aux)
        grads, out = grad_fn(*args, **kwargs)
        if has_aux:
            value, aux_tensors = out
            treedef, leaves = box["aux"]
            it = iter(aux_tensors)
            aux = optree.tree_unflatten(treedef, [next(it) if isinstance(x, torch.Tensor) else x for x in leaves])
            tag_leaves(value, seen.get("value", []))
            tag_leaves(aux, seen.get("aux", []))
        else:
            value = out
            tag_leaves(value, seen.get("value", []))
        if single:
            tag_like(grads, args[nums[0]])
        else:
            for g, i in zip(grads, nums, strict=True):
                tag_like(g, args[i])
        return ((value, aux) if has_aux else value), grads

    return wrapped
