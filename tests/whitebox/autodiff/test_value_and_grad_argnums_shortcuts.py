"""``fs.value_and_grad``'s per-call shortcuts give what the general path gives: argnums checked once per object
(never mistaking ``True`` for ``1`` or ``(1.0,)`` for ``(1,)``), arguments that are single tensors handed over
without a pytree walk in any order of ``argnums``, and the graph walk (closed-over leaves, the node run last)
equal to a plain reference walk."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.autodiff.grad import graph_walk


def _f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a * b.exp() + c**2).sum()


def test_argnums_checked_by_identity_not_equality() -> None:
    x = torch.ones(2)
    fs.value_and_grad(_f, argnums=1)(x, x, x)  # 1 passes and is remembered
    fs.value_and_grad(_f, argnums=(1,))(x, x, x)
    with pytest.raises(fs.ConfigError, match="argnums"):
        fs.value_and_grad(_f, argnums=True)  # == 1 and hashes as 1, but a bool
    with pytest.raises(fs.ConfigError, match="argnums"):
        fs.value_and_grad(_f, argnums=(1.0,))  # == (1,)
    with pytest.raises(fs.ConfigError, match="argnums"):
        fs.value_and_grad(_f, argnums=(True, 0))  # == (1, 0)
    v, g = fs.value_and_grad(_f, argnums=[0, 1])(x, x, x)  # a list, as JAX takes it: grads as for (0, 1)
    v2, g2 = fs.value_and_grad(_f, argnums=(0, 1))(x, x, x)
    assert type(g) is tuple and torch.equal(v, v2) and all(torch.equal(a, b) for a, b in zip(g, g2, strict=True))
    with pytest.raises(fs.ConfigError, match="positional argument 5"):
        fs.value_and_grad(_f, argnums=(0, 5))(x, x, x)


@pytest.mark.parametrize("argnums", [(0, 1, 2), (2, 0, 1), (1, 0), (2,), 1, (-1, 0), (0, -2)])
def test_tensor_arguments_in_any_order(argnums: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(3, generator=gen) for _ in range(3)]
    value, grads = fs.value_and_grad(_f, argnums=argnums)(*args)
    ref_args = [a.clone().requires_grad_() for a in args]
    ref = _f(*ref_args)
    nums = (argnums,) if isinstance(argnums, int) else argnums
    ref_grads = torch.autograd.grad(ref, [ref_args[i] for i in nums])
    torch.testing.assert_close(value, ref.detach())
    got = (grads,) if isinstance(argnums, int) else grads
    assert len(got) == len(ref_grads)
    for g, r in zip(got, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_mixed_tree_and_tensor_arguments() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(3, generator=gen) for _ in range(3))

    def f(p: dict[str, torch.Tensor], c: torch.Tensor) -> torch.Tensor:
        return _f(p["a"], p["b"], c)

    value, (gp, gc) = fs.value_and_grad(f, argnums=(0, 1))({"a": a, "b": b}, c)
    ra, rb, rc = (t.clone().requires_grad_() for t in (a, b, c))
    ref = _f(ra, rb, rc)
    for g, r in zip((gp["a"], gp["b"], gc), torch.autograd.grad(ref, (ra, rb, rc)), strict=True):
        torch.testing.assert_close(g, r)
    torch.testing.assert_close(value, ref.detach())


def _reference_walk(outs: list[torch.Tensor], own: list[torch.Tensor]) -> tuple[bool, Any]:
    """Every node visited, a set of nodes (no ids): whether a leaf outside ``own`` is reached; the node of
    lowest sequence number otherwise."""
    own_ids = {id(x) for x in own}
    if any(o.grad_fn is None and o.requires_grad and id(o) not in own_ids for o in outs):
        return True, None
    nodes: list[Any] = []
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        n = stack.pop()
        if any(n is m for m in nodes):
            continue
        nodes.append(n)
        stack.extend(m for m, _ in n.next_functions if m is not None)
    leaves = [n.variable for n in nodes if hasattr(n, "variable")]
    if any(id(v) not in own_ids for v in leaves):
        return True, None
    inner = [n for n in nodes if not hasattr(n, "variable")]
    return False, min(inner, key=lambda n: n._sequence_nr()) if inner else None


def _graphs() -> list[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(3, 3, generator=gen)
    out = []
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    out.append(("chain", (a @ b).tanh().sum(), [a, b]))
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    h = a @ b
    out.append(("shared node and leaf used twice", (h * h + a @ b + a.sum()).sum(), [a, b]))
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    outside = torch.randn(3, generator=gen).requires_grad_()
    out.append(("closed-over leaf", ((a @ b) * outside).sum(), [a, b]))
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    deep = (outside * 2).exp()  # a closed-over non-leaf: its graph reaches the outside leaf
    out.append(("closed-over non-leaf", ((a @ b) + deep).sum() + (a @ b).sum(), [a, b]))
    a = x.clone().requires_grad_()
    out.append(("the value is an outside leaf's sum, an own leaf unused", outside.sum(), [a]))
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    out.append(("one own leaf unused", (a * 3).sum(), [a, b]))
    return out


@pytest.mark.parametrize("case", range(len(_graphs())))
def test_graph_walk_equals_a_reference_walk(case: int) -> None:
    name, value, own = _graphs()[case]
    keep, last = graph_walk([value], own)
    ref_keep, ref_last = _reference_walk([value], own)
    assert keep == ref_keep, name
    assert last is ref_last or (
        last is not None and ref_last is not None and last._sequence_nr() == ref_last._sequence_nr()
    ), name
