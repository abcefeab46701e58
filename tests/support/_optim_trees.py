"""The optimiser tests' trees: a mesh, sharded leaves of several layouts, random values for them, a closeness check
over a tree, a small regression loss, and the reference steps of ``torch.optim`` on the unsharded params."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

import funcshard as fs
from funcshard import P

MESH = {"dp": 2, "tp": 2}


CLIP_SPECS = {
    "row": P("tp", None),
    "both": P(("dp", "tp")),
    "grid": P("dp", "tp"),
    "rep": P(),
    "col": P(None, "dp"),
    "bias": P(),
}


CLIP_SHAPES = {"row": (8, 3), "both": (8,), "grid": (4, 6), "rep": (5,), "col": (3, 4), "bias": (2, 2)}


Tree = Any


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _rand(shapes: Tree, seed: int, scale: float = 1.0) -> Tree:
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda s: torch.randn(*s, generator=g) * scale, shapes, is_leaf=_is_shape)


def _close(a: Tree, b: Tree, rtol: float = 1e-6, atol: float = 1e-8) -> None:
    a, b = fs.device_get(a), fs.device_get(b)
    paths, la, _ = optree.tree_flatten_with_path(a)
    lb = optree.tree_leaves(b)
    assert len(la) == len(lb)
    for p, x, y in zip(paths, la, lb, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, p=p: f"{p}: {m}")


def _mse(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x @ p["w"] + p["b"] - y) ** 2).mean()


def _torch_steps(
    params: Tree,
    grads_seq: list[Tree],
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    *,
    clip: float | None = None,
    lrs: list[float] | None = None,
) -> tuple[Tree, torch.optim.Optimizer, list[torch.Tensor], list[torch.Tensor]]:
    """The reference: torch.optim (optionally after clip_grad_norm_) on the unsharded params."""
    leaves, treedef = optree.tree_flatten(params)
    ref = [p.clone().requires_grad_(True) for p in leaves]
    opt = make(ref)
    norms = []
    for k, grads in enumerate(grads_seq):
        for p, g in zip(ref, optree.tree_leaves(grads), strict=True):
            p.grad = g.clone()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ref, clip))
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[k]
        opt.step()
    return optree.tree_unflatten(treedef, [p.detach() for p in ref]), opt, ref, norms
