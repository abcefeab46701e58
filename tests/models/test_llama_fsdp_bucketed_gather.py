"""FSDP's reshard-after-forward (issue #10 item 3) and the per-layer bucketed gather.

The Llama on an ``fsdp`` axis gathers each layer's parameters in one collective per bucket (leaves of one dtype
that vary over the same axes), and with ``remat`` on and ``Config(reshard_after_forward=True)`` (the default, as
FSDP2's) gathers them inside the layer's ``fs.remat`` region: freed after the layer's forward, gathered again
when it is recomputed. The loss and every gradient equal the single-device model's and, bit for bit, the
keep-the-weights run's, under sim and dist; the extra all-gathers are exactly one per layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _step(mesh: fs.Mesh, cfg: llama.Config) -> tuple[torch.Tensor, dict, dict]:
    params = llama.init(fs.random.key(0), cfg)
    tok = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(tok, -1, dims=1)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    with fs.comm_stats() as stats:
        loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, cfg))(params)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    got = fs.device_get(grads)
    for (path, g), (_, r) in zip(fs.pytree.leaves_with_path(got), fs.pytree.leaves_with_path(ref_grads), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=path)
    return fs.device_get(loss), got, dict(stats.rows())


def _reshard_body(mesh: fs.Mesh, remat: str) -> tuple[int, int, bool]:
    keep = dataclasses.replace(CFG, remat=remat, reshard_after_forward=False)
    loss_k, grads_k, comm_k = _step(mesh, keep)
    loss_r, grads_r, comm_r = _step(mesh, dataclasses.replace(keep, reshard_after_forward=True))
    same = torch.equal(loss_k, loss_r) and all(
        torch.equal(a, b)
        for (_, a), (_, b) in zip(fs.pytree.leaves_with_path(grads_k), fs.pytree.leaves_with_path(grads_r))
    )
    return comm_k[("all_gather", "fsdp")][0], comm_r[("all_gather", "fsdp")][0], same


@pytest.mark.parametrize("remat", ["none", "full", "selective"])
def test_reshard_after_forward_equals_keeping_the_weights(run, remat):
    for kept, resharded, same in run(_reshard_body, {"fsdp": 2}, remat):
        assert kept == CFG.n_layers + 2  # one bucket per layer, plus the embedding's and one of the final norm and head
        # the re-gathers of the backward (or the recomputation), one per layer; kept, even
        # remat="full" saves the gathered weights: they are the remat region's inputs
        assert resharded == kept + CFG.n_layers
        assert same, "resharding changed a number"


@pytest.mark.parametrize("shape", [{"fsdp": 2, "tp": 2}, {"dp": 2, "fsdp": 2}])
def test_reshard_after_forward_with_tp_and_hsdp(shape):
    """The norms (replicated over tp) gather apart from the tp-sharded weights; HSDP's replicas change nothing."""
    mesh = fs.make_mesh(shape, backend="sim")
    _, _, comm = _step(mesh, dataclasses.replace(CFG, remat="selective"))
    # fsdp x tp: the norms (replicated over tp) gather apart from the tp-sharded weights: 2 buckets per layer
    per_layer = 2 if "tp" in shape else 1
    # the embedding, then the final norm and the head gathered in one call: one bucket (two under tp: the norm
    # apart again)
    top = 3 if "tp" in shape else 2
    assert comm[("all_gather", "fsdp")][0] == 2 * per_layer * CFG.n_layers + top
    assert comm[("psum_scatter", "fsdp")][0] == per_layer * CFG.n_layers + top
