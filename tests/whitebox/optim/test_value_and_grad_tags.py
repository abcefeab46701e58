"""The varying-axes tags (internal, read with ``get_vma`` / ``official_vma``) of what ``fs.value_and_grad`` and
the gradient clip see and return inside shard_map: gradients of replicated params tagged replicated, aux and
values keeping their tags, untagged values named by ``specs=``."""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from _optim_trees import CLIP_SHAPES, CLIP_SPECS, MESH, Tree, _close, _mse, _rand

import funcshard as fs
from funcshard import P, optim, value_and_grad
from funcshard._src.collectives.vma import get_vma, official_vma


def test_clip_specs_argument_for_untagged_values() -> None:
    """Values made inside the body with check_vma=False carry no tags; ``specs=`` names their axes."""
    mesh = fs.make_mesh(MESH, backend="sim")
    grads = _rand(CLIP_SHAPES, 1)
    full = torch.sqrt(sum((g**2).sum() for g in optree.tree_leaves(grads)))

    def norms(g: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        fresh = optree.tree_map(lambda t: t * 1.0, g)  # axes unknown without tracking
        assert all(official_vma(t) is None for t in optree.tree_leaves(fresh))
        with pytest.raises(fs.ShardingError, match=r"axes leaf .* are unknown"):
            optim.global_norm(fresh)  # never this shard's norm, silently
        _, state = optim.clip_by_global_norm(1.0, specs=CLIP_SPECS).transform(fresh, optim.ClipByGlobalNormState(0))
        return state.norm, optim.global_norm(fresh, specs=CLIP_SPECS)

    f = fs.shard_map(norms, mesh=mesh, in_specs=(CLIP_SPECS,), out_specs=(P(), P()), check_vma=False)
    n1, n2 = f(grads)
    torch.testing.assert_close(fs.device_get(n1), full, rtol=1e-6, atol=0)
    torch.testing.assert_close(fs.device_get(n2), full, rtol=1e-6, atol=0)


def _regression_body(mesh: fs.Mesh, check_vma: bool) -> str:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    ref_value, ref_grads = value_and_grad(_mse)(params, x, y)

    def local(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        def loss(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            if not check_vma:  # by hand what check_vma=True inserts
                p = fs.pvary(p, "dp")
            return fs.pmean(_mse(p, x, y), "dp"), x.sum()  # [] -> [], the mean over the global batch

        (value, aux), grads = value_and_grad(loss, has_aux=True)(p)
        if any(get_vma(t) != frozenset() for t in optree.tree_leaves(grads)):
            raise AssertionError("gradients of replicated params must be tagged replicated")
        if check_vma and get_vma(aux) != frozenset({"dp"}):
            raise AssertionError(f"aux lost its tag: {get_vma(aux)}")
        return value, grads

    f = fs.shard_map(local, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=(P(), P()), check_vma=check_vma)
    value, grads = f(params, x, y)
    torch.testing.assert_close(fs.device_get(value), ref_value)
    _close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "explicit_pvary"])
def test_value_and_grad_in_shard_map_dp_regression(run, check_vma: bool) -> None:
    assert set(run(_regression_body, {"dp": 2}, check_vma)) == {"ok"}


def test_value_and_grad_tags_follow_inputs() -> None:
    mesh = fs.make_mesh(MESH, backend="sim")
    w, x = torch.randn(3, 4), torch.randn(2, 3)

    def f(w: torch.Tensor, x: torch.Tensor) -> Any:
        value, gw = value_and_grad(lambda w: fs.psum(fs.pmean((x @ w).sum(), "dp"), "tp"))(w)
        if get_vma(gw) != frozenset({"tp"}) or get_vma(value) != frozenset():
            raise AssertionError(f"tags: grad {get_vma(gw)}, value {get_vma(value)}")
        return value, gw

    value, gw = fs.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=(P(), P(None, "tp")))(w, x)
    ref_value, ref_gw = value_and_grad(lambda w: (x @ w).sum() / 2)(w)
    torch.testing.assert_close(fs.device_get(value), ref_value)
    torch.testing.assert_close(fs.device_get(gw), ref_gw)

    # a value that still varies over dp keeps its tag, so out_specs=P() is refused instead of silently wrong
    def unreduced(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return value_and_grad(lambda w: fs.psum((x @ w).sum(), "tp"))(w)[0]

    with pytest.raises(fs.ShardingError, match="varies over axis 'dp'"):
        fs.shard_map(unreduced, mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P())(w, x)
