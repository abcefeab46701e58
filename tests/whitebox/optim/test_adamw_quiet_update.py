"""``fs.optim.adamw``'s in-place update runs with torch functions off where every leaf is tagged alike (issue #11).

Inside ``shard_map`` the vma mode sees every torch op; in AdamW's donated update, where the gradients, moments
and parameters all vary over the same axes, it would only tag the update's temporaries (views of each leaf row,
padding, the step count): ~500 Python calls a step of the 13.2M Llama's 75 leaf rows. ``_adamw._quiet`` turns
torch functions off for it then, and leaves them on where the tags differ (the mode's widening stays). Same numbers:
the update with and without it, bitwise, under ``sim`` and ``dist`` (the Llama's dp step, 3 steps).
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from torch.overrides import TorchFunctionMode

import funcshard as fs
from funcshard import P, lax, optim
from funcshard.models import llama
from funcshard.optim import _adamw

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


class _Count(TorchFunctionMode):
    """The torch functions called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _train(mesh: fs.Mesh, quiet: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Three donated AdamW steps of the Llama on ``mesh``: (losses, final params' leaves, the torch functions seen
    by a mode pushed inside the body around each update)."""
    opt = optim.adamw(1e-2, weight_decay=0.1)
    specs, bs = llama.param_specs(CFG, mesh), llama.batch_spec(mesh)
    sspecs = opt.state_specs(specs)
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
    tgt = tok.roll(-1, 1)
    seen: list[int] = []

    def body(p: Any, s: Any, t: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any, Any]:
        loss, grads = llama.value_and_grad(p, t, y, CFG)
        count = _Count()
        with count:
            p, s = opt.update(grads, s, p)
        seen.append(count.n)
        return loss, p, s

    step = fs.shard_map(
        body, mesh=mesh, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs), donate=(0, 1)
    )
    params = fs.device_put(llama.init(fs.random.key(0), CFG), mesh, specs)
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)(params)
    real = _adamw._quiet
    _adamw._quiet = real if quiet else (lambda *a: False)
    try:
        losses = []
        for _ in range(3):
            loss, params, state = step(params, state, tok, tgt)
            losses.append(fs.device_get(loss))
    finally:
        _adamw._quiet = real
    return losses, optree.tree_leaves(fs.device_get(params)), seen


def _body(mesh: fs.Mesh) -> dict[str, Any]:  # (under tp the sharded weights vary over tp, the norms do not)
    l_on, p_on, seen_on = _train(mesh, quiet=True)
    l_off, p_off, seen_off = _train(mesh, quiet=False)
    return {
        "losses": all(torch.equal(a, b) for a, b in zip(l_on, l_off, strict=True)),
        "params": all(torch.equal(a, b) for a, b in zip(p_on, p_off, strict=True)),
        "seen_on": seen_on,
        "seen_off": seen_off,
    }


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_quiet_update_same_numbers_fewer_calls(run: Any, backend: str, axis: str) -> None:
    # tp: each leaf's operands carry one tag, the leaves different ones (quiet per leaf since helper V's count:
    # ~300 of the 763 torch functions of a tp step were the update's); the params' out_specs (check_vma) hold
    # only where the update kept every leaf's tag
    for r in run(_body, {axis: 2}):
        assert r["losses"] and r["params"], r
        # the donated steps (the last two of each device: the first one's inputs are fresh) call fewer than half
        # the torch functions while quiet (the arguments' checks and the step count stay outside the quiet part)
        on, off = r["seen_on"], r["seen_off"]
        assert len(on) == len(off) and all(2 * a < b for a, b in zip(on[-2:], off[-2:], strict=True)), (on, off)


def test_quiet_only_with_one_tag() -> None:
    mesh = fs.make_mesh({"dp": 2}, backend="sim")

    def body(x: torch.Tensor) -> torch.Tensor:
        a, b = x * 1, x * 2  # invariant over dp
        va, vb = lax.pvary(a, "dp"), lax.pvary(b, "dp")  # varying over dp
        same = _adamw._quiet(([a], [b]))
        mixed = _adamw._quiet(([a], [vb]))  # one leaf's operands differ: the mode stays on
        rows = _adamw._quiet(([a, va], [b, vb]))  # each leaf alike, the leaves not: quiet
        scalar = _adamw._quiet(([a], [b]), (torch.tensor(1.0), 0.5))  # a tensor hyper-parameter: tagged alike
        inv = _adamw._quiet(([va], [vb]), (torch.tensor(1.0),))  # an invariant hyper-parameter, a varying leaf
        wide = _adamw._quiet(([a], [b]), (lax.pvary(torch.tensor(1.0), "dp"),))  # varying over more than the leaf
        grad = _adamw._quiet(([a.requires_grad_()], [b]))  # an operand that requires grad: the mode stays on
        return torch.tensor([same, mixed, rows, scalar, inv, wide, grad])

    out = fs.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=True)(torch.ones(3))
    assert fs.device_get(out).tolist() == [True, False, True, True, True, False, False]


def test_leaf_errors_still_name_the_leaf() -> None:
    # the leaves' paths are made only for an error now (optim._base.tensor_leaves): the errors still name them
    import pytest

    opt = optim.adamw(1e-2)
    p = {"w": torch.ones(2, 2), "b": torch.ones(3)}
    state = opt.init(p)
    with pytest.raises(fs.ShardingError, match=r"grads leaf 'b' must be a torch.Tensor, found float"):
        opt.update({"w": torch.ones(2, 2), "b": 1.0}, state, p)
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    # an fs.Array among plain tensors, outside shard_map: the update runs on its mesh, the tensors replicated
    got, _ = opt.update({"w": fs.device_put(torch.ones(2, 2), mesh, P()), "b": torch.ones(3)}, state, p)
    want, _ = opt.update({"w": torch.ones(2, 2), "b": torch.ones(3)}, state, p)
    assert all(torch.equal(fs.device_get(got[k]), want[k]) for k in want)
    with pytest.raises(fs.ShardingError, match=r"params leaf 'b' has shape \(4,\) but grads has \(3,\)"):
        opt.update(p, state, {"w": torch.ones(2, 2), "b": torch.ones(4)})
