"""``fs.remat``'s outputs carry the varying-axes tags (internal, read with ``get_vma``) of the computation they
stand for."""

from __future__ import annotations

import optree
import torch

import funcshard as fs
from funcshard import P
from funcshard._src.collectives.vma import get_vma


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # tests/autodiff/test_remat_equals_plain.py's block
    h = torch.tanh(x @ w)  # [b/dp, d] @ [d, f/tp] -> [b/dp, f/tp]
    h = fs.checkpoint_name(h, "h")
    g = fs.all_gather(h, "tp", dim=1, tiled=True)  # [b/dp, f/tp] -> [b/dp, f]
    g = fs.ppermute(g, "dp", [(0, 1), (1, 0)])  # swap the dp halves
    s = fs.psum(h.pow(2).sum(-1, keepdim=True), "tp")  # [b/dp, 1]: psum over tp
    return g * s


def test_tags_of_outputs_follow_the_computation() -> None:
    mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="sim")

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = fs.remat(_block)(x, w.requires_grad_())
        if get_vma(y) != frozenset({"dp", "tp"}):
            raise AssertionError(f"tags: {get_vma(y)}")
        return fs.psum(y.sum(), ("dp", "tp"))

    out = fs.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P())(
        torch.randn(6, 4), torch.randn(8, 6)
    )
    assert optree.tree_leaves(fs.device_get(out))
