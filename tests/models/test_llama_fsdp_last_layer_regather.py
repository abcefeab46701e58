"""The Llama's FSDP root group and the last layer's early regather (issue #11), as an event order, not a timing.

Resharding after forward without remat, the last decoder layer's weights are gathered again for its backward.
FSDP2's root pre-backward prefetches that block while the output head is differentiated; the Llama issues the
regather when the backward reaches the logits (``reshard_after_forward.regather_at``), so under ``dist`` it
travels during the head's backward instead of being issued and waited for at the layer's first saved weight.
Checked under sim and dist: the last layer's regather is issued before the head's input gradient exists, every
other layer's regather still comes from a later layer's backward, and the loss and gradients equal the
single-device model's.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

pytestmark = pytest.mark.counters

CFG = llama.Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


class _Events:
    """Per thread, the events in order (an object, not a dict: a pytree argument may be rebuilt on the way in)."""

    def __init__(self) -> None:
        self.by_thread: dict[int, list[Any]] = {}

    def add(self, event: Any) -> None:
        self.by_thread.setdefault(threading.get_ident(), []).append(event)


class _Mark(torch.autograd.Function):
    """Identity; its backward appends ``"head"`` to the running thread's events (the head's input gradient is
    computed: the head's backward is done)."""

    @staticmethod
    def forward(x: torch.Tensor, events: _Events) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.events = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.events.add("head")
        return g, None


def _order_body(mesh: fs.Mesh) -> list[list[Any]]:
    """Per device thread, the backward's events in order: ``"head"`` (the head's input gradient computed) and
    ``("issue", i)`` (layer i's regather issued)."""
    from funcshard.models.llama import model
    from funcshard.ops import fsdp as fsdp_mod

    events = _Events()
    made: dict[int, list[Any]] = {}  # thread -> its _Layer objects in forward order
    init, issue, head = fsdp_mod._Layer.__init__, fsdp_mod._Layer.issue, model.head_logits

    def init_probe(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        made.setdefault(threading.get_ident(), []).append(self)

    def issue_probe(self: Any) -> None:
        if self.pending is None and self.leaves is None:  # the first call: the regather goes out now
            events.add(("issue", made[threading.get_ident()].index(self)))
        issue(self)

    def head_probe(params: Any, x: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        return head(params, _Mark.apply(x, events), *a, **k)

    params = llama.init(fs.random.key(0), CFG)
    tok = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(tok, -1, dims=1)
    specs, bs = llama.param_specs(CFG, mesh), llama.batch_spec(mesh)
    f = fs.shard_map(
        lambda p, t, y: llama.value_and_grad(p, t, y, CFG), mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs)
    )
    fsdp_mod._Layer.__init__, fsdp_mod._Layer.issue, model.head_logits = init_probe, issue_probe, head_probe
    try:
        loss, grads = f(fs.device_put(params, mesh, specs), tok, tgt)
    finally:
        fsdp_mod._Layer.__init__, fsdp_mod._Layer.issue, model.head_logits = init, issue, head
    ref_loss, ref_grads = fs.value_and_grad(lambda p: llama.loss(p, tok, tgt, CFG))(params)
    torch.testing.assert_close(fs.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
    for (path, g), (_, r) in zip(
        fs.pytree.leaves_with_path(fs.device_get(grads)), fs.pytree.leaves_with_path(ref_grads), strict=True
    ):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=path)
    return list(events.by_thread.values())


def test_last_layer_regather_is_issued_before_the_head_backward_ends(run):
    n = CFG.n_layers
    for per_device in run(_order_body, {"fsdp": 2}):
        assert per_device, "no device recorded its backward"
        for got in per_device:
            # the last layer's regather first, then the head's backward, then each earlier layer's (prefetched
            # from the backward of the layer after it)
            assert got == [("issue", n - 1), "head"] + [("issue", i) for i in range(n - 2, -1, -1)], got
