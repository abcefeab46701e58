"""Memory of ``fs.remat`` and of FSDP's reshard-after-forward (issue #10), counted exactly (``_live_bytes``).

- Nothing of a remat forward outlives it: after the forward only the region's inputs (one tensor per layer
  boundary) are live, and after the backward exactly what the plain step leaves (the gradients).
- Full remat of the Llama peaks at ``torch.utils.checkpoint``'s peak on the same layers, and grows per layer by
  the layer's gradients (plus nothing of its activations); selective remat peaks below the plain step.
- Reshard-after-forward holds one layer's gathered weights at a time: its peak per device is the keep run's
  minus the gathered weights of ``L - 1`` layers, under sim and dist; the numbers are bitwise the same.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Any

import optree
import pytest
import torch
from _dist_pool import run_body
from _live_bytes import LiveBytes, PerThread
from torch.utils.checkpoint import checkpoint

import funcshard as fs
from funcshard import P
from funcshard.models import llama
from funcshard.models.llama.model import embed_tokens, head_logits, layout
from funcshard.ops import vocab_parallel_cross_entropy

pytestmark = pytest.mark.counters

N = 128  # the toy chain's [N, N] blocks
BLOCK = N * N * 4  # bytes of one


def _chain_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # tanh and exp save their own outputs for the backward: the case that must not keep the forward alive
    return torch.exp(torch.tanh(x @ w) * 0.5) @ w  # [N, N] @ [N, N] -> [N, N]


def _chain(n_layers: int, block: Any) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, N, generator=g)
    ws = [(torch.randn(N, N, generator=g) / N**0.5).requires_grad_() for _ in range(n_layers)]

    def forward() -> torch.Tensor:
        h = x
        for w in ws:
            h = block(h, w)
        return h

    return x, ws, forward


def test_remat_keeps_only_its_inputs_and_frees_everything_after_the_backward() -> None:
    L = 4
    _, ws, forward = _chain(L, fs.remat(_chain_block))
    with LiveBytes() as m:
        y = forward()
        # the outputs of layers 0..L-2 (the next layer's saved input) and y: one block per layer, nothing else
        assert m.live == L * BLOCK, m.live / BLOCK
        assert m.peak <= (L + 4) * BLOCK  # one layer's forward at a time (x @ w, tanh, * 0.5, exp, @ w)
        grads = torch.autograd.grad(y.sum(), ws)
        del y
        gc.collect()
        assert m.live == L * BLOCK, "after the backward: the L gradients and nothing of the forward"
    _, ws_ref, forward_ref = _chain(L, _chain_block)
    ref = torch.autograd.grad(forward_ref().sum(), ws_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref, strict=True))


def test_remat_backward_holds_one_layer_as_checkpoint_does() -> None:
    peaks: dict[tuple[str, int], int] = {}
    for n_layers in (3, 6):
        for name, block in {
            "remat": fs.remat(_chain_block),
            "checkpoint": lambda x, w: checkpoint(_chain_block, x, w, use_reentrant=False),
            "plain": _chain_block,
        }.items():
            _, ws, forward = _chain(n_layers, block)
            with LiveBytes() as m:
                torch.autograd.grad(forward().sum(), ws)
            peaks[name, n_layers] = m.peak
        # checkpoint stops its recomputation at the last tensor the backward needs; remat runs the region to its
        # output (its graph's root), so for a moment it also holds that one output: at most one block more
        assert peaks["remat", n_layers] <= peaks["checkpoint", n_layers] + BLOCK, peaks
    # per extra layer: remat holds its gradient (its boundary is freed as the backward passes it; nothing of its
    # inside), the plain step its tanh and exp outputs and its input as well
    assert peaks["remat", 6] - peaks["remat", 3] == 3 * BLOCK, peaks
    assert peaks["plain", 6] - peaks["plain", 3] == 3 * 3 * BLOCK, peaks


# ------------------------------------------------------------------------------------------ the Llama
CFG = llama.Config(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=64)


def _batch(b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (b, CFG.max_seq_len), generator=torch.Generator().manual_seed(0))
    return tok, tok.roll(-1, dims=1)


def _checkpoint_loss(params: Any, tok: torch.Tensor, tgt: torch.Tensor, cfg: llama.Config) -> torch.Tensor:
    """The Llama's loss with each layer under ``torch.utils.checkpoint`` (non-reentrant): the reference."""
    lay = layout(cfg, None)
    x = embed_tokens(params["embed"], tok, lay)  # [b, s] -> [b, s, d]
    stacked = {k: torch.unbind(v, 0) for k, v in params["layers"].items()}  # [L, ...] -> L x [...]
    for i in range(cfg.n_layers):
        p = {k: v[i] for k, v in stacked.items()}
        x = checkpoint(llama.layer, x, p, cfg, lay.plan, use_reentrant=False)  # [b, s, d] -> [b, s, d]
    logits = head_logits(params, x, cfg, lay)  # [b, s, d] @ [d, V] -> [b, s, V]
    return vocab_parallel_cross_entropy(logits, tgt, axis=None, reduction="sum") / tgt.numel()


def _peak(loss: Any, cfg: llama.Config) -> tuple[int, torch.Tensor, Any]:
    """The peak live bytes of one ``fs.value_and_grad`` step of ``loss`` (after a warm-up step), its loss and grads."""
    params = llama.init(fs.random.key(0), cfg)
    tok, tgt = _batch()
    step = fs.value_and_grad(lambda p: loss(p, tok, tgt, cfg))
    step(params)
    with LiveBytes() as m:
        value, grads = step(params)
    return m.peak, value, grads


def _layer_bytes(cfg: llama.Config) -> int:
    shapes = llama.init(fs.random.key(0), cfg)["layers"]
    return sum(v[0].numel() * v.element_size() for v in shapes.values())


def test_llama_remat_full_peaks_at_checkpoints_peak_and_grows_by_the_gradients() -> None:
    peaks: dict[tuple[str, int], int] = {}
    for n_layers in (2, 4):
        cfg = dataclasses.replace(CFG, n_layers=n_layers)
        for remat in ("none", "full"):
            peaks[remat, n_layers], value, grads = _peak(llama.loss, dataclasses.replace(cfg, remat=remat))
        peaks["checkpoint", n_layers], ref_value, ref_grads = _peak(_checkpoint_loss, cfg)
        assert torch.equal(value, ref_value)
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(ref_grads)))
        assert peaks["full", n_layers] <= peaks["checkpoint", n_layers], peaks
    grads_per_layer = _layer_bytes(CFG)
    boundary = 4 * CFG.max_seq_len * CFG.dim * 4  # one [b, s, d] float32 activation
    full_growth = (peaks["full", 4] - peaks["full", 2]) / 2
    plain_growth = (peaks["none", 4] - peaks["none", 2]) / 2
    # per extra layer: its gradients and at most its boundary activation, none of its inner activations
    assert grads_per_layer <= full_growth <= grads_per_layer + boundary, (full_growth, grads_per_layer, boundary)
    assert plain_growth > full_growth + 4 * boundary, (plain_growth, full_growth)


def test_llama_selective_remat_peaks_below_plain() -> None:
    cfg = dataclasses.replace(CFG, n_layers=3)
    plain, v_plain, g_plain = _peak(llama.loss, cfg)
    selective, v_sel, g_sel = _peak(llama.loss, dataclasses.replace(cfg, remat="selective"))
    full, _, _ = _peak(llama.loss, dataclasses.replace(cfg, remat="full"))
    assert full < selective < plain, (full, selective, plain)
    # it keeps the matmul outputs and the attention output, not the attention core: at least softmax's
    # probabilities per layer go (the CPU attention keeps [b, heads, s, s] for its backward) ...
    assert torch.equal(v_plain, v_sel)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(g_plain), optree.tree_leaves(g_sel)))


# ------------------------------------------------------------------------------------------ FSDP reshard
FSDP_CFG = dataclasses.replace(CFG, n_layers=4)


def _fsdp_peaks(mesh: fs.Mesh, remat: str, reshard: bool) -> tuple[list[int], torch.Tensor, Any]:
    """Each local device's peak live bytes in one Llama step on ``mesh`` (after a warm-up), its loss and grads."""
    cfg = dataclasses.replace(FSDP_CFG, remat=remat, reshard_after_forward=reshard)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    params = fs.device_put(llama.init(fs.random.key(0), cfg), mesh, specs)
    tok, tgt = _batch(8)
    counts = PerThread()
    for _ in range(2):  # the second call is measured: one-time buffers are made by the first
        counts = PerThread()
        step = fs.shard_map(
            counts.wrap(lambda p, t, y: llama.value_and_grad(p, t, y, cfg)),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
        )
        loss, grads = step(params, tok, tgt)
    return counts.peaks(), fs.device_get(loss), fs.device_get(grads)


def _reshard_body(mesh: fs.Mesh, remat: str, overlap: str) -> tuple[list[int], list[int], bool]:
    before = os.environ.get("FUNCSHARD_OVERLAP")
    os.environ["FUNCSHARD_OVERLAP"] = overlap  # dist: whether the backward's reduce-scatters are left pending
    try:
        keep, loss_k, grads_k = _fsdp_peaks(mesh, remat, False)
        reshard, loss_r, grads_r = _fsdp_peaks(mesh, remat, True)
    finally:
        if before is None:
            del os.environ["FUNCSHARD_OVERLAP"]
        else:
            os.environ["FUNCSHARD_OVERLAP"] = before
    same = torch.equal(loss_k, loss_r) and all(
        torch.equal(a, b) for a, b in zip(optree.tree_leaves(grads_k), optree.tree_leaves(grads_r), strict=True)
    )
    return keep, reshard, same


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_reshard_after_forward_frees_the_gathered_weights_of_all_but_one_layer(remat):
    gathered = _layer_bytes(FSDP_CFG)  # one layer's gathered (full) weights
    expected = (FSDP_CFG.n_layers - 1) * gathered
    for keep, reshard, same in run_body("sim", _reshard_body, {"fsdp": 4}, remat, "1"):
        assert same, "resharding changed a number"
        assert len(keep) == len(reshard) == 4
        for k, r in zip(keep, reshard, strict=True):
            freed = k - r
            # the keep run holds all L layers' gathered weights at its peak, the resharding run one layer's. Below
            # by up to a third of a layer: sim's device threads meet at each collective in whatever order the host
            # schedules them, and on a busy host 1-3 more 16.5 KB blocks are still alive at the resharding run's
            # peak (the same at the commit before this round: 4 of 8 runs under load). Freeing one layer less would
            # be a whole layer below.
            assert expected - gathered / 3 <= freed <= expected + gathered / 3, (freed / gathered, k, r)


@pytest.mark.dist
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_reshard_after_forward_frees_the_gathered_weights_under_dist(overlap):
    gathered = _layer_bytes(FSDP_CFG)
    expected = (FSDP_CFG.n_layers - 1) * gathered
    for keep, reshard, same in run_body("dist", _reshard_body, {"fsdp": 4}, "full", overlap):
        assert same, "resharding changed a number"
        (k,), (r,) = keep, reshard
        # Under dist the resharding run's peak holds more than sim's: the next layer's prefetched gather, and with
        # FUNCSHARD_OVERLAP=1 a layer's pending gradient bucket, alive or not depending on when gloo's threads run.
        # On this 2-core host 1.75-3.0 of the 3 layers were seen freed (already at ad7910a: the old bound of 1/16
        # layer failed 5 runs of 10). Not resharding frees nothing: 3 layers below the bound's floor of 1.5.
        assert expected - 1.5 * gathered <= k - r <= expected + gathered / 3, ((k - r) / gathered, k, r)


def _settled_body(mesh: fs.Mesh, overlap: str) -> tuple[int, int]:
    """(how many pending gradients the remat backwards waited for, how many regions) in one resharding step."""
    from funcshard._src.autodiff import remat as _remat

    waited = [0]
    real = _remat.settle

    def counting(t: torch.Tensor) -> torch.Tensor:
        waited[0] += type(t).__name__ == "AsyncCollectiveTensor"
        return real(t)

    _remat.settle = counting
    try:
        _reshard_body(mesh, "full", overlap)
    finally:
        _remat.settle = real
    return waited[0], FSDP_CFG.n_layers


@pytest.mark.dist
def test_remat_backward_waits_for_the_previous_regions_reductions():
    """Under dist with FUNCSHARD_OVERLAP, each remat backward waits for the reduce-scatters the previous region's
    backward left in flight once it has recomputed its own region: one layer's gradient bucket (a full-size
    input) in flight at a time, not every layer's until the gradients leave value_and_grad (at the bench's
    13M-parameter Llama, fsdp=4 reshard: 72.0 MiB per rank without this, 43.6 with it)."""
    per_layer = len(llama.init(fs.random.key(0), FSDP_CFG)["layers"])  # a gradient per leaf of a layer
    for waited, n_layers in run_body("dist", _settled_body, {"fsdp": 4}, "1"):
        # the resharding step's two calls: every region's but each call's last is waited for there (keeping the
        # weights, the reduce-scatters run outside the regions: their gradients leave them unreduced)
        assert waited == 2 * (n_layers - 1) * per_layer, (waited, n_layers, per_layer)
    for waited, _ in run_body("dist", _settled_body, {"fsdp": 4}, "0"):
        assert waited == 0  # without the overlap nothing is in flight
