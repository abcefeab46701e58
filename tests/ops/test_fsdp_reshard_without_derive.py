"""``reshard_after_forward(..., derive=False)``: the reshard scope without its dispatch mode (issue #11).

The mode records the ops computed from the gathered weights alone (casts, concatenations) so that their saved
results are rebuilt too; it puts every op of the layer's forward through Python. The Llama's layers read their
weights through views only, so they run the scope without it. Checked under sim and dist: the Llama's loss and
gradients bitwise equal to the scope with the mode, the same saved tensors dropped and restored per layer, and an
in-place write into the weights still refused (by their version counters, as the scope ends).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama
from funcshard.ops import fsdp_gather
from funcshard.ops.fsdp import reshard_after_forward

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _llama_body(mesh: fs.Mesh, derive: bool | None, precision: str | None) -> tuple[Any, ...]:
    """(loss, grads, per layer scope (derive used, dropped, restored)) of one Llama step; ``derive``: forced on
    every scope (None: the model's own choice)."""
    from funcshard.models.llama import model

    made: list[reshard_after_forward] = []

    class Probe(reshard_after_forward):
        def __init__(self, *a: Any, **k: Any) -> None:
            if derive is not None:
                k["derive"] = derive
            super().__init__(*a, **k)
            made.append(self)

    cfg = dataclasses.replace(CFG, precision=precision)
    params = llama.init(fs.random.key(0), cfg)
    tok = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(tok, -1, dims=1)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    model.reshard_after_forward = Probe
    try:
        loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    finally:
        model.reshard_after_forward = reshard_after_forward
    scopes = sorted((s._derive, s.layer.dropped, s.layer.restored) for s in made)
    return fs.device_get(loss), fs.device_get(grads), scopes


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_llama_scope_without_the_mode_is_bitwise_the_same(run, precision):
    for (loss_m, grads_m, with_mode), (loss, grads, without) in zip(
        run(_llama_body, {"fsdp": 2}, True, precision), run(_llama_body, {"fsdp": 2}, None, precision), strict=True
    ):
        assert torch.equal(loss_m, loss)
        for a, b in zip(optree.tree_leaves(grads_m), optree.tree_leaves(grads), strict=True):
            assert torch.equal(a, b)
        assert {d for d, _, _ in with_mode} == {True} and {d for d, _, _ in without} == {False}, without
        # the same saved tensors dropped (every one restored) per layer: the mode found nothing else to drop
        assert [r[1:] for r in with_mode] == [r[1:] for r in without], (with_mode, without)
        assert all(dropped > 0 and dropped == restored for _, dropped, restored in without), without


def test_scope_without_the_mode_refuses_an_in_place_write_into_the_weights():
    mesh = fs.make_mesh({"fsdp": 2}, backend="sim")

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        full = fsdp_gather(p, {"w": P("fsdp")})
        with reshard_after_forward(full, lambda: fsdp_gather(p, {"w": P("fsdp")}), derive=False):
            w = full["w"]
            y = (w * w).sum()  # saves w: dropped, gathered again for the backward
            w.mul_(2.0)  # the regather would not see this write
            return fs.pmean(y, "fsdp")

    f = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=({"w": P("fsdp")},), out_specs=(P(), P("fsdp")))
    with pytest.raises(fs.ConfigError, match="in place"):
        f({"w": torch.ones(4)})


def test_scope_without_the_mode_keeps_a_saved_cast_of_the_weights(run):
    """A cast of the weights is not recorded without the mode: autograd keeps it (the numbers are the same)."""
    for (v_m, g_m, d_m), (v, g, d) in zip(run(_cast_body, {"fsdp": 2}, True), run(_cast_body, {"fsdp": 2}, False)):
        assert torch.equal(v_m, v) and torch.equal(g_m, g)
        assert d_m == 2 and d == 1, (d_m, d)  # with the mode the cast's saved result is dropped too


def _cast_body(mesh: fs.Mesh, derive: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    dropped: list[int] = []

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        full = fsdp_gather(p, {"w": P("fsdp", None)})  # [4/2, 4] -> [4, 4]
        with reshard_after_forward(full, lambda: fsdp_gather(p, {"w": P("fsdp", None)}), derive=derive) as s:
            h = torch.tanh(x @ full["w"])  # [b, 4] @ [4, 4] (x needs no gradient: w not saved)
            y = h @ full["w"]  # [b, 4] @ [4, 4]: saves w (dropped)
            z = h.double() @ full["w"].double()  # [b, 4] @ [4, 4]: saves the cast w
        dropped.append(s.layer.dropped)
        return fs.pmean((y + z.float()).pow(2).mean(), "fsdp")

    g = torch.Generator().manual_seed(0)
    f = fs.shard_map(
        fs.value_and_grad(loss), mesh=mesh, in_specs=({"w": P("fsdp", None)}, P("fsdp")), out_specs=(P(), P("fsdp"))
    )
    v, grads = f({"w": torch.randn(4, 4, generator=g)}, torch.randn(4, 4, generator=g))
    return fs.device_get(v), fs.device_get(grads)["w"], dropped[0]
