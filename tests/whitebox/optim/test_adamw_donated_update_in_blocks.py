"""``fs.optim.adamw``'s donated op-by-op update runs block by block and keeps ``torch.optim.AdamW``'s numbers.

White-box: it turns torch's fused kernel off (``_adamw._FUSED``: the path a compiled step or another dtype takes)
and cuts leaves with ``_adamw._chunks``. Leaves of several update blocks (``_adamw.CHUNK`` elements each, cache-sized),
one with a ragged last block: the donated in-place update equals ``torch.optim.AdamW(foreach=False)`` bit for bit,
under ``sim`` and ``dist``.
"""

from __future__ import annotations

import optree
import pytest
import torch
from _optim_trees import _rand, _torch_steps

import funcshard as fs
from funcshard import P, optim
from funcshard.optim import _adamw

pytestmark = pytest.mark.oracle


# leaves of several update blocks (_adamw.CHUNK elements each), one with a ragged last block
BIG_SPECS = {"w": P(None, "tp"), "b": P("tp"), "n": P()}
_BLOCK = 1 << 20  # _adamw.CHUNK (checked in the test)
BIG_SHAPES = {"w": (3, _BLOCK + 34), "b": (2 * _BLOCK + 6,), "n": (7,)}


def _adamw_donated_body(mesh: fs.Mesh) -> tuple[int, bool, bool]:
    fused, _adamw._FUSED = _adamw._FUSED, None  # the op-by-op path (a compiled step, other dtypes; fused: below)
    try:
        return _adamw_donated_blocks(mesh)
    finally:
        _adamw._FUSED = fused


def _adamw_donated_blocks(mesh: fs.Mesh) -> tuple[int, bool, bool]:
    params = _rand(BIG_SHAPES, 0)
    grads_seq = [_rand(BIG_SHAPES, k + 1) for k in range(3)]
    opt = optim.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    sspecs = opt.state_specs(BIG_SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(BIG_SPECS, BIG_SPECS, sspecs),
        out_specs=(BIG_SPECS, sspecs),
        donate=(0, 2),
    )
    p = fs.device_put(params, mesh, BIG_SPECS)
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(BIG_SPECS,), out_specs=sspecs)(p)
    for g in grads_seq:
        p, state = step(p, g, state)
    ref, topt, ref_leaves, _ = _torch_steps(
        params,
        grads_seq,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False),
    )
    got = fs.device_get(p)
    exact = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(ref), strict=True))
    nu = optree.tree_leaves(fs.device_get(state.nu))
    exact = exact and all(torch.equal(v, topt.state[r]["exp_avg_sq"]) for r, v in zip(ref_leaves, nu, strict=True))
    assert _adamw.CHUNK == _BLOCK, "BIG_SHAPES are sized for the update's block"
    local_w = torch.zeros(3, _BLOCK // 2 + 17)  # one device's block of "w": 1.5 blocks
    blocks = len(list(_adamw._chunks(_adamw.CHUNK, local_w, local_w)))
    return blocks, exact, len(list(_adamw._chunks(0, local_w))) == 1


def test_adamw_donated_blocks_match_torch_bit_for_bit(run) -> None:
    # the op-by-op in-place update runs block by block (cache-sized): torch.optim.AdamW's numbers, bit for bit
    # (float32 CPU leaves take torch's fused kernel instead: tests/whitebox/optim/test_adamw_fused_kernel.py)
    for blocks, exact, whole in run(_adamw_donated_body, {"tp": 2}):
        assert blocks == 2 and whole  # a local leaf of 1.5 blocks is cut in two; chunk 0: one block
        assert exact
