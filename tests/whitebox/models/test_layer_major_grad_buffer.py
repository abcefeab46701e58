"""The data-parallel step's gradient path without extra copies or Python dispatches (issue #11).

- The Llama's per-layer gradient buckets are rows of one ``[n_layers, per layer]`` buffer, so each stacked
  ``[n_layers, ...]`` gradient is a strided view of it (no stack copy); the numbers are those of
  ``torch.unbind``'s fresh stack (``tests/whitebox/models/test_stacked_grad_buffers_reused.py`` checks the buffers and
  their reuse).
- Under ``dist`` a bucket's pending sum is handed back as one pending view per gradient, made from plain views of
  the bucket: no dispatch through a pending flat result (its split and views) in the backward.
- AdamW's in-place update cuts a strided gradient into blocks of whole rows (cache-sized, as a contiguous one).

Bodies run under ``sim`` and ``dist`` (gloo) and compare with the unsharded reference.
"""

from __future__ import annotations

import optree
import pytest
import torch
from _llama_dp import CFG, llama_step

import funcshard as fs
from funcshard import P
from funcshard.models import llama
from funcshard.optim._adamw import CHUNK, _chunks

pytestmark = pytest.mark.counters


def _dispatch_body(mesh: fs.Mesh) -> tuple[bool, int, bool, bool]:
    f, params, tokens, targets = llama_step(mesh)
    dispatched = [0]
    act = None
    if mesh.backend == "dist":
        from torch.distributed._functional_collectives import AsyncCollectiveTensor as act

        plain = act.__dict__["__torch_dispatch__"]

        def counted(cls, func, types, args=(), kwargs=None):
            dispatched[0] += 1
            return plain.__func__(cls, func, types, args, kwargs)

        act.__torch_dispatch__ = classmethod(counted)
    try:
        loss, grads = f(params, tokens, targets)
    finally:
        if act is not None:
            act.__torch_dispatch__ = plain
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tokens, targets, CFG))(params)
    close = torch.allclose(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(optree.tree_leaves(fs.device_get(grads)), optree.tree_leaves(ref_grads), strict=True)
    )
    wq = grads["layers"]["wq"]
    local = wq.shards[min(wq.shards)]
    return close, dispatched[0], local.is_contiguous(), mesh.backend == "dist"


def test_llama_dp_gradients_without_pending_dispatch_or_stack_copy(run) -> None:
    for close, dispatched, contiguous, dist in run(_dispatch_body, {"dp": 2}):
        assert close
        if dist:
            # each layer's gradients are pending views made from the bucket's plain views (before: a split and a
            # view dispatched through the pending flat sum per gradient, and the stack through the pending views)
            assert dispatched == 0, dispatched
            assert not contiguous  # wq's stacked gradient is a strided view of the layers' bucket buffer
        else:
            assert dispatched == 0 and contiguous


def test_adamw_blocks_a_strided_gradient_by_rows() -> None:
    g = torch.Generator().manual_seed(0)
    rows, row = 6, (CHUNK // 4 + 3,)  # 6 rows of ~CHUNK / 4: 2 blocks of 3 rows, not one whole-leaf op
    buf = torch.randn(rows, row[0] + 5, generator=g)  # the layer-major buffer: each row padded by another leaf
    grad = buf[:, : row[0]]  # [rows, *row], strided
    assert not grad.is_contiguous()
    blocks = list(_chunks(CHUNK, grad, torch.zeros(rows, *row)))
    assert [b[0].shape[0] for b in blocks] == [3, 3]
    # the update is the same as with the contiguous gradient, bit for bit
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    p0 = torch.randn(rows, *row, generator=g)
    mesh = fs.make_mesh({"dp": 1}, backend="sim")

    def step(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        state = opt.init(p)
        return opt.update(grad, state, p)[0]

    donated = fs.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=P(), donate=(0,))
    a = fs.device_get(donated(p0.clone(), grad))
    b = fs.device_get(donated(p0.clone(), grad.contiguous()))
    c = step(p0.clone(), grad.contiguous())  # out of place (no donation): the reference arithmetic
    assert torch.equal(a, b) and torch.equal(a, c)


def _one_work_body(mesh: fs.Mesh) -> tuple[bool, bool]:
    # a torch whose registry of pending collectives keeps one per storage (before 2.13): no shared buffer
    from funcshard._src.runtime.backends import dist as dist_backend

    share = dist_backend.DistDevice.pending_sums_share_storage
    dist_backend.DistDevice.pending_sums_share_storage = lambda self: False
    try:
        close, _, contiguous, _ = _dispatch_body(mesh)
    finally:
        dist_backend.DistDevice.pending_sums_share_storage = share
    return close, contiguous


def test_no_shared_bucket_buffer_where_pending_sums_cannot_share_storage(run) -> None:
    for close, contiguous in run(_one_work_body, {"dp": 2}):
        assert close and contiguous  # the stacked gradients stacked into their own buffers, the same numbers


def test_registry_probe_leaves_nothing_registered() -> None:
    import torch.distributed

    from funcshard._src.runtime.backends.dist import _registry_keeps_every_work

    c10d = torch._C._distributed_c10d
    n0 = c10d._get_work_registry_size()
    assert isinstance(_registry_keeps_every_work(), bool)
    assert c10d._get_work_registry_size() == n0
