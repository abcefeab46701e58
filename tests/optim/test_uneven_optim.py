"""``fs.optim`` on params split unevenly (``torch.tensor_split``'s blocks, API §14): AdamW after
``clip_by_global_norm`` equals ``torch.optim.AdamW`` after ``clip_grad_norm_`` on the unsharded params, under
``sim`` and ``dist``. The transforms are elementwise on the blocks and the norm sums every element once."""

from __future__ import annotations

import pytest
import torch
from _optim_trees import CLIP_SPECS, MESH, _close, _rand, _torch_steps

import funcshard as fs
from funcshard import optim

pytestmark = pytest.mark.oracle

#: CLIP_SPECS's layouts on dims that 2 and 4 do not divide (some blocks empty: 3 rows over 4 devices)
UNEVEN_SHAPES = {"row": (7, 3), "both": (3,), "grid": (5, 7), "rep": (5,), "col": (3, 5), "bias": (2, 2)}


def _adamw_clip_body(mesh: fs.Mesh, check_vma: bool) -> str:
    params = _rand(UNEVEN_SHAPES, 0)
    grads_seq = [_rand(UNEVEN_SHAPES, k + 1, scale=0.1 * (k + 1)) for k in range(3)]  # clipped from step 2 on
    opt = optim.chain(optim.clip_by_global_norm(2.0), optim.adamw(1e-2, b2=0.95, weight_decay=0.1))
    sspecs = opt.state_specs(CLIP_SPECS)
    step = fs.shard_map(
        lambda p, g, s: opt.update(g, s, p),
        mesh=mesh,
        in_specs=(CLIP_SPECS, CLIP_SPECS, sspecs),
        out_specs=(CLIP_SPECS, sspecs),
        check_vma=check_vma,
    )
    p = fs.device_put(params, mesh, CLIP_SPECS)
    state = opt.init(p)
    norms_ours = []
    for g in grads_seq:
        p, state = step(p, g, state)
        norms_ours.append(fs.device_get(state[0].norm))
    assert p["grid"].shape == (5, 7) and p["both"].shape == (3,)
    ref, _, _, norms = _torch_steps(
        params,
        grads_seq,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False),
        clip=2.0,
    )
    torch.testing.assert_close(torch.stack(norms_ours), torch.stack(norms), rtol=1e-6, atol=0)
    assert norms[0] < 2.0 < norms[-1]
    _close(p, ref, rtol=1e-5)
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_adamw_with_clipping_on_uneven_layout_matches_torch(run, check_vma: bool) -> None:
    assert set(run(_adamw_clip_body, MESH, check_vma)) == {"ok"}
