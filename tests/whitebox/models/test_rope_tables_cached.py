"""RoPE's angle tables computed once per shape, not in every layer of every step (issue #11).

``models.transformer.rope`` keeps its ``cos`` / ``sin`` tables from call to call (keyed by sequence length, head
size, theta, an ``int`` offset and the device): the 13.2M Llama's 16 rope calls a step issued ~220 ops through the
vma mode (and ~700 aten ops) to make the same two tables again. The numbers are those of the tables computed at
each call, bitwise: here against the formula as it was, and the Llama's loss and gradients under ``dp`` (sim and
dist) with the kept tables against the same step computing them at each call.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from _llama_dp import llama_step
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard import P
from funcshard.models import llama
from funcshard.models import transformer as tr

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _rope_as_it_was(x: torch.Tensor, theta: float, offset: int | torch.Tensor = 0) -> torch.Tensor:
    """The rotary embedding with its tables made at each call (the code before the tables were kept)."""
    s, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)  # [hd/2]
    pos = torch.arange(s, dtype=torch.float32, device=x.device) + offset  # [s]
    ang = pos[:, None] * inv  # [s, hd/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]  # [1, s, 1, hd/2]
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Ops(TorchDispatchMode):
    """The aten ops that run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_rope_kept_tables_are_the_fresh_ones_bitwise() -> None:
    tr._ROPE_TABLES.clear()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for offset in (0, 5):
            x = torch.randn(2, 7, 3, 8, generator=g).to(dtype)
            for _ in range(2):  # the first call makes the table, the second reads it
                assert torch.equal(tr.rope(x, 500000.0, offset), _rope_as_it_was(x, 500000.0, offset))
    # a tensor offset (cp's position of this device) is never kept: computed at the call, as before
    x = torch.randn(2, 7, 3, 8, generator=g)
    before = len(tr._ROPE_TABLES)
    assert torch.equal(tr.rope(x, 10000.0, torch.tensor(3)), _rope_as_it_was(x, 10000.0, torch.tensor(3)))
    assert len(tr._ROPE_TABLES) == before


def test_rope_table_made_once() -> None:
    tr._ROPE_TABLES.clear()
    x = torch.randn(2, 16, 4, 8)
    counted = _Ops()
    with counted:
        tr.rope(x, 10000.0)  # the table is made with every mode off: not seen here
        first = list(counted.names)
        tr.rope(x, 10000.0)
    second = counted.names[len(first) :]
    assert "cos" not in first and "cos" not in second and "arange" not in second, (first, second)
    assert first == second, (first, second)
    # without the kept table (a transform around it) the table's ops run at each call, under the mode
    counted = _Ops()
    with counted:
        torch.func.vmap(lambda t: tr.rope(t, 10000.0))(x[None])
    assert "cos" in counted.names and "sin" in counted.names


def test_rope_table_made_in_inference_mode_is_not_kept() -> None:
    tr._ROPE_TABLES.clear()
    x = torch.randn(1, 8, 2, 8)
    with torch.inference_mode():
        tr.rope(x, 10000.0)
    assert not tr._ROPE_TABLES  # an inference tensor could not be saved for a later backward
    w = torch.randn(1, 8, 2, 8, requires_grad=True)
    tr.rope(w, 10000.0).sum().backward()  # kept now, saved for the backward
    assert w.grad is not None and len(tr._ROPE_TABLES) == 1


def _body(mesh: fs.Mesh) -> dict[str, Any]:
    step, params, tok, tgt = llama_step(mesh, CFG)
    sharded = fs.device_put(params, mesh, llama.param_specs(CFG, mesh))
    out = []
    kept = tr._rope_cached
    for fresh in (True, False, False):  # tables made at each call, then kept (made, then read)
        if fresh:
            tr._rope_cached = lambda x, s, hd, theta, offset: tr._rope_table(s, hd, theta, offset, x.device)
        try:
            loss, grads = step(sharded, tok, tgt)
        finally:
            tr._rope_cached = kept
        out.append((fs.device_get(loss), optree.tree_leaves(fs.device_get(grads))))
    same = [
        torch.equal(out[0][0], o[0]) and all(torch.equal(a, b) for a, b in zip(out[0][1], o[1], strict=True))
        for o in out[1:]
    ]
    return {"same": same, "kept": len(tr._ROPE_TABLES) >= 1}


def test_llama_dp_grads_bitwise_with_kept_tables(run: Any, backend: str) -> None:
    for r in run(_body, {"dp": 2}):
        assert r["same"] == [True, True] and r["kept"], r


def test_kept_tables_take_the_tag_of_x() -> None:
    # inside shard_map, the kept tables are handed out as views tagged as x (varying over dp here): rope's four
    # products then mix no invariant constant with a varying operand (the vma mode's slower mixed path)
    from funcshard._src.collectives.vma import find_vma

    tr._ROPE_TABLES.clear()
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    seen: list[Any] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        cos, sin = tr._rope_cached(x, x.shape[1], x.shape[-1], 10000.0, 0)
        with torch._C.DisableTorchFunction():  # (a view's _base read under the vma mode would tag its base)
            seen.append((find_vma(x), find_vma(cos), find_vma(sin), cos._base is not None))
        return tr.rope(x, 10000.0)

    x = torch.randn(4, 8, 2, 8)
    out = fs.shard_map(body, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"), check_vma=True)(x)
    assert torch.equal(fs.device_get(out), _rope_as_it_was(x, 10000.0))
    assert len(seen) == 2 and all(v == c == s == frozenset({"dp"}) and view for v, c, s, view in seen), seen
    kept = next(iter(tr._ROPE_TABLES.values()))
    assert find_vma(kept[0]) is None and find_vma(kept[1]) is None  # the kept tables themselves stay untagged
    # outside shard_map (x untagged): views tagged invariant, never read through to the kept tables
    cos, _ = tr._rope_cached(x, 8, 8, 10000.0, 0)
    assert find_vma(cos) == frozenset() and cos._base is not None
