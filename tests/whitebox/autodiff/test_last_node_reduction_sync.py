"""Inside ``fs.value_and_grad`` under ``dist``, a gradient reduction is issued asynchronously (a pending result
waited for at its first use) so that it travels while the backward goes on, except in the node the backward
runs last, where nothing is left to overlap: that one is synchronous (cheaper per call). Counted, not timed:
the asynchronous reductions through ``dist.issued_hook``, all of them through ``fs.comm_stats``.

The tensor-parallel MLP step (``bench/shard_map_overhead.py``): the pvary on its input is the first node of
the forward, so the backward's one all-reduce is its last node (0 asynchronous of 2 psums). With a node made
before it (an identity ``torch.autograd.Function`` on the input), the same all-reduce is pending again (1 of 2).
The numbers equal the unsharded model's either way, under sim too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P

pytestmark = pytest.mark.counters


class _Ident(torch.autograd.Function):
    """Identity: a node made before the pvary, so the backward runs it after the pvary's all-reduce."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _tp_mlp_body(mesh: fs.Mesh, before: bool, check_vma: bool) -> dict:
    from funcshard._src.runtime.backends import dist as dist_backend

    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)

    def loss_fn(x, w1, w2):
        if before:
            x = _Ident.apply(x)
        xin = x if check_vma else fs.pvary(x, "tp")  # check_vma inserts this pvary itself
        h = F.gelu(F.linear(xin, w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
        out = fs.psum(F.linear(h, w2), "tp")  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
        return (out**2).mean()

    specs = (P(), P("tp", None), P(None, "tp"))
    step = fs.shard_map(
        lambda x, w1, w2: fs.value_and_grad(loss_fn, argnums=(0, 1, 2))(x, w1, w2),
        mesh=mesh,
        in_specs=specs,
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    issued: list = []
    dist_backend.issued_hook = issued.append
    try:
        with fs.comm_stats() as stats:
            loss, grads = step(x, w1, w2)
    finally:
        dist_backend.issued_hook = None
    ref_loss, ref_grads = fs.value_and_grad(
        lambda x, w1, w2: (F.linear(F.gelu(F.linear(x, w1)), w2) ** 2).mean(), argnums=(0, 1, 2)
    )(x, w1, w2)
    close = torch.allclose(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(fs.device_get(a), b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, ref_grads, strict=True)
    )
    plain = all(type(fs.device_get(a)) is torch.Tensor for a in grads)
    return {"psums": stats.calls("psum", "tp"), "async": len(issued), "close": close, "plain": plain}


def test_reduction_in_the_last_backward_node_is_synchronous(run, backend) -> None:
    for check_vma in (False, True):
        for before, n_async in ((False, 0), (True, 1)):
            for r in run(_tp_mlp_body, {"tp": 2}, before, check_vma):
                assert r["close"] and r["plain"], (check_vma, before, r)
                assert r["psums"] == 2, (check_vma, before, r)  # forward psum + the pvary's backward psum
                # sim: every collective is synchronous
                assert r["async"] == (n_async if backend == "dist" else 0), (check_vma, before, r)
