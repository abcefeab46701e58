"""Ring attention saves one block for its backward, at every ring size; autograd through the ring saves O(n) blocks.

White-box: it compares ``ring_attention`` (the ``RingAttention`` op with its hand-written backward) with
``ring_through_autograd`` (``funcshard.ops.attention._ring_kernel``, the ring differentiated by autograd, which the
transforms without a rule take), counting the storages a saved-tensors hook sees, per device, on cp=2 and cp=4.
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.ops import ring_attention
from funcshard.ops.attention._ring_kernel import ring_through_autograd

B, D = 2, 8
HEADS = {"gqa": (8, 2)}  # (q heads, kv heads)


def _rand(*shape, seed):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _saved_bytes(cp: int, fn, layout: str) -> list[int]:
    """Per device: the bytes of the distinct storages saved for the backward by one ``fn(q, k, v)`` (GQA,
    a local block of 8 positions), counted by a saved-tensors hook."""
    mesh = fs.make_mesh({"cp": cp}, backend="sim")
    h, hkv = HEADS["gqa"]
    q, k, v = (_rand(B, hh, 8 * cp, D, seed=i) for i, hh in ((1, h), (2, hkv), (3, hkv)))
    spec = P(None, None, "cp")

    def inner(q, k, v):
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))  # own storages, the size of the block
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v, layout)
        return torch.tensor([sum(storages.values())])

    return fs.device_get(fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 3, out_specs=P("cp"))(q, k, v)).tolist()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_saved_bytes(layout: str) -> None:
    """Saved for the backward: q, k, v, out and the float32 log-sum-exp of this device's block, nothing per ring
    step, so the same at every ring size; autograd through the ring keeps every received block and the
    per-step scores, O(n) blocks."""
    h, hkv = HEADS["gqa"]
    q_bytes, kv_bytes, lse_bytes = B * h * 8 * D * 4, B * hkv * 8 * D * 4, B * h * 8 * 4
    local = 2 * q_bytes + 2 * kv_bytes + lse_bytes  # q and out, k and v, lse: 10752 bytes

    def ring(q, k, v, layout):
        return ring_attention(q, k, v, layout=layout)

    def through_autograd(q, k, v, layout):
        return ring_through_autograd(q, k, v, "cp", True, layout, None)

    new = {cp: _saved_bytes(cp, ring, layout) for cp in (2, 4)}
    old = {cp: _saved_bytes(cp, through_autograd, layout) for cp in (2, 4)}
    print(f"saved bytes per device ({layout}): ring_attention {new}, autograd through the ring {old}")
    assert new[2] == [local] * 2 and new[4] == [local] * 4
    # through autograd: the busiest device (every device under zigzag) keeps the n-1 received k/v blocks
    # besides q, k, v, and more with every step
    busiest = min if layout == "zigzag" else max
    assert busiest(old[4]) >= local - lse_bytes + 3 * 2 * kv_bytes
    assert busiest(old[4]) > max(old[2]) > local
