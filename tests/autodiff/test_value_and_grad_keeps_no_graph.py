"""``fs.value_and_grad`` keeps no graph of the backward (plain ``torch.autograd.grad`` where nothing asks for a
higher derivative), and falls back to ``torch.func`` where something may: the numbers are the same either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs


def _f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) @ w.T).sin().pow(2).sum()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)


def _packs(fn: Any) -> int:
    """How many tensors autograd saves while ``fn`` runs (forward graph and any graph of the backward)."""
    n = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return n[0]


def test_no_graph_of_the_backward_is_kept() -> None:
    w, x = _data()

    def plain() -> None:
        wr = w.detach().requires_grad_()
        torch.autograd.grad(_f(wr, x), wr)

    def create_graph() -> None:  # what torch.func.grad_and_value does (it refuses saved-tensor hooks)
        wr = w.detach().requires_grad_()
        torch.autograd.grad(_f(wr, x), wr, create_graph=True)

    ours = _packs(lambda: fs.value_and_grad(_f)(w, x))
    assert ours == _packs(plain), "as many saved tensors as loss.backward(): the forward's only"
    assert _packs(create_graph) > ours  # a backward with create_graph saves its own intermediates too
    value, g = fs.value_and_grad(_f)(w, x)
    ref_g, ref_v = torch.func.grad_and_value(_f)(w, x)
    assert torch.equal(value, ref_v) and torch.equal(g, ref_g)
    assert not value.requires_grad and not g.requires_grad


def test_nested_uses_are_exact() -> None:
    w, x = _data()
    vg = fs.value_and_grad
    ref = torch.func.grad(lambda w: torch.func.grad(_f)(w, x).sum())(w)
    torch.testing.assert_close(torch.func.grad(lambda w: vg(_f)(w, x)[1].sum())(w), ref)  # grad of it
    torch.testing.assert_close(vg(lambda w: vg(_f)(w, x)[1].sum())(w)[1], ref)  # itself of itself
    # a closed-over tensor that requires grad: the gradient keeps its graph for an outer backward
    wr = w.clone().requires_grad_()
    _, gx = vg(lambda x: _f(wr, x))(x)
    gx.sum().backward()
    ref_w = torch.func.grad(lambda w: torch.func.grad(lambda x: _f(w, x))(x).sum())(w)
    torch.testing.assert_close(wr.grad, ref_w)
    xs = torch.stack([x, 2 * x])
    torch.testing.assert_close(
        torch.func.vmap(lambda x: vg(_f)(w, x)[1])(xs), torch.func.vmap(lambda x: torch.func.grad(_f)(w, x))(xs)
    )
    _, t = torch.func.jvp(lambda w: vg(_f)(w, x)[1], (w,), (torch.ones_like(w),))
    _, ref_t = torch.func.jvp(lambda w: torch.func.grad(_f)(w, x), (w,), (torch.ones_like(w),))
    torch.testing.assert_close(t, ref_t)


def test_edge_cases_match_torch_func() -> None:
    w, x = _data()
    _, (gw, gx) = fs.value_and_grad(lambda a, b: (a * 2).sum(), argnums=(0, 1))(w, w)
    assert torch.equal(gx, torch.zeros_like(w)) and torch.equal(gw, torch.full_like(w, 2.0))
    _, g = fs.value_and_grad(lambda a: torch.tensor(1.0))(w)  # a constant: zero gradient
    assert torch.equal(g, torch.zeros_like(w))
    with torch.no_grad():  # like torch.func.grad, an outer no_grad does not stop it
        assert torch.equal(fs.value_and_grad(_f)(w, x)[1], torch.func.grad(_f)(w, x))
    with pytest.raises(fs.ConfigError, match="scalar"):
        fs.value_and_grad(lambda a: a * 2)(w)
