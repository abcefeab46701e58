"""Ring attention over uneven sequences (``torch.tensor_split``'s local lengths, odd ones included) in both
layouts, and the zigzag helpers on them: forward and q/k/v gradients equal the unsharded ``attention`` on the
whole sequence (sim, check_vma on and off; one case under dist); the balance of the causal work per device
(``ring_work``, counted from the ring's block plan): equal on every device for an even zigzag split, within one
query row of the whole sequence for an uneven one, against the contiguous layout's staircase.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.ops import (
    attention,
    layout_positions,
    ring_attention,
    ring_work,
    zigzag_chunk_sizes,
    zigzag_indices,
    zigzag_inverse_indices,
    zigzag_merge,
    zigzag_positions,
    zigzag_split,
)

B, D = 2, 4
SPEC = P(None, None, "cp")
#: (sequence, cp): 30 on 4 -> 8, 8, 7, 7; 13 on 4 -> 4, 3, 3, 3 (odd local lengths); 15 on 2 -> 8, 7
CASES = [(30, 4), (13, 4), (15, 2)]


def _rand(*shape, seed):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _ring_body(mesh: fs.Mesh, seq: int, layout: str, causal: bool, check_vma: bool, grad: str = "autograd") -> str:
    n = mesh.shape["cp"]
    q, k, v = _rand(B, 8, seq, D, seed=1), _rand(B, 2, seq, D, seed=2), _rand(B, 2, seq, D, seed=3)
    r = _rand(B, 8, seq, D, seed=4)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = attention(*ref, causal=causal)  # GQA: 8 query heads on 2 kv heads
    (out_ref * r).sum().backward()
    fwd = zigzag_indices(seq, n) if layout == "zigzag" else torch.arange(seq)
    inv = zigzag_inverse_indices(seq, n) if layout == "zigzag" else torch.arange(seq)

    def inner(r_l, q_l, k_l, v_l):
        def f(q_l, k_l, v_l):
            out = ring_attention(q_l, k_l, v_l, causal=causal, layout=layout)
            return fs.psum((out * r_l).sum(), "cp"), out

        if grad == "func":  # torch.func.grad: the Function's backward under functorch
            grads, out = torch.func.grad(f, argnums=(0, 1, 2), has_aux=True)(q_l, k_l, v_l)
            return out, list(grads)
        q_l, k_l, v_l = (t.detach().requires_grad_(True) for t in (q_l, k_l, v_l))
        loss, out = f(q_l, k_l, v_l)
        return out, list(torch.autograd.grad(loss, [q_l, k_l, v_l]))

    f = fs.shard_map(inner, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(SPEC, [SPEC] * 3), check_vma=check_vma)
    out, grads = f(*(t.index_select(2, fwd) for t in (r, q, k, v)))
    tag = f"seq={seq} cp={n} {layout} causal={causal} vma={check_vma} {grad}"
    torch.testing.assert_close(fs.device_get(out).index_select(2, inv), out_ref.detach(), rtol=1e-5, atol=1e-5, msg=tag)
    for name, g, a in zip("qkv", grads, ref, strict=True):
        got = fs.device_get(g).index_select(2, inv)
        torch.testing.assert_close(got, a.grad, rtol=1e-5, atol=1e-5, msg=f"{tag} d{name}")
    return "ok"


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize(("seq", "cp"), CASES, ids=[f"seq{s}_cp{n}" for s, n in CASES])
def test_ring_uneven_sim(seq: int, cp: int, layout: str, causal: bool, check_vma: bool) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _ring_body, {"cp": cp}, seq, layout, causal, check_vma) == ["ok"]


def test_ring_uneven_torch_func_grad() -> None:
    from _dist_pool import run_body

    assert run_body("sim", _ring_body, {"cp": 4}, 30, "zigzag", True, True, "func") == ["ok"]


@pytest.mark.dist
def test_ring_uneven_dist() -> None:
    from _dist_pool import run_body

    assert set(run_body("dist", _ring_body, {"cp": 4}, 30, "zigzag", True, True)) == {"ok"}


def test_ring_uneven_through_autograd_under_vmap() -> None:
    """vmap hands the ring to autograd through differentiable ppermutes: uneven blocks arrive at their sender's
    length there too."""
    mesh = fs.make_mesh({"cp": 4}, backend="sim")
    seq, n = 30, 4
    q, k, v = (_rand(3, 1, 2, seq, D, seed=i) for i in range(3))  # a vmapped dim of 3 in front
    fwd, inv = zigzag_indices(seq, n), zigzag_inverse_indices(seq, n)
    spec = P(None, None, None, "cp")
    f = fs.shard_map(
        lambda q, k, v: torch.vmap(lambda a, b, c: ring_attention(a, b, c))(q, k, v),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=spec,
    )
    out = fs.device_get(f(*(t.index_select(3, fwd) for t in (q, k, v)))).index_select(3, inv)
    torch.testing.assert_close(out, torch.vmap(lambda a, b, c: attention(a, b, c, causal=True))(q, k, v))


# --- the zigzag helpers on uneven lengths ---------------------------------------------------------------------


@pytest.mark.parametrize(("seq", "n"), [(30, 4), (13, 4), (7, 2), (16, 4), (5, 3)])
def test_zigzag_uneven_indices(seq: int, n: int) -> None:
    chunks = zigzag_chunk_sizes(seq, n)
    local = [len(t) for t in torch.tensor_split(torch.arange(seq), n)]
    assert sum(chunks) == seq and len(chunks) == 2 * n
    assert [chunks[i] + chunks[2 * n - 1 - i] for i in range(n)] == local  # no padding: the contiguous lengths
    assert [chunks[i] for i in range(n)] == [(s + 1) // 2 for s in local]
    idx = zigzag_indices(seq, n)
    assert sorted(idx.tolist()) == list(range(seq))
    assert torch.equal(idx[zigzag_inverse_indices(seq, n)], torch.arange(seq))
    rows = [zigzag_positions(seq, n, i) for i in range(n)]
    assert torch.equal(torch.cat(rows), idx)
    assert [len(r) for r in rows] == local
    for r in rows:  # each device's positions increase (its own block's causal mask is the plain triangle)
        assert bool((r[1:] > r[:-1]).all())
    contiguous = [layout_positions(local, i, "contiguous") for i in range(n)]
    assert torch.equal(torch.cat(contiguous), torch.arange(seq))


def test_zigzag_uneven_values() -> None:
    assert zigzag_chunk_sizes(30, 4) == [4, 4, 4, 4, 3, 3, 4, 4]
    assert zigzag_indices(7, 2).tolist() == [0, 1, 5, 6, 2, 3, 4]
    assert zigzag_positions(30, 4, 2).tolist() == [8, 9, 10, 11, 19, 20, 21]
    assert zigzag_chunk_sizes(32, 4) == [4] * 8  # even: 2n equal chunks, as before


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_zigzag_split_merge_uneven(check_vma: bool) -> None:
    seq, n = 30, 4
    mesh = fs.make_mesh({"cp": n}, backend="sim")
    x, r = _rand(2, seq, 3, seed=1), _rand(2, seq, 3, seed=2)
    r_zig = r.index_select(1, zigzag_indices(seq, n))

    def split_grad(x, r_l):  # x replicated: split, then the gradient of sum(split * r) is r, back in order
        x = x.detach().requires_grad_(True)
        y = zigzag_split(x, "cp", dim=1)  # [2, 30, 3] -> [2, L_i, 3]
        (g,) = torch.autograd.grad(fs.psum((y * r_l).sum(), "cp"), [x])
        return y, zigzag_merge(y, "cp", dim=1), g

    y, z, g = fs.shard_map(
        split_grad, mesh=mesh, in_specs=(P(), P(None, "cp")), out_specs=(P(None, "cp"), P(), P()), check_vma=check_vma
    )(x, r_zig)
    torch.testing.assert_close(fs.device_get(y), x.index_select(1, zigzag_indices(seq, n)))
    torch.testing.assert_close(fs.device_get(z), x)  # round trip
    torch.testing.assert_close(fs.device_get(g), r)


# --- the causal work per device -------------------------------------------------------------------------------


def test_ring_work_balance() -> None:
    assert ring_work(32, 4, "contiguous") == [36, 100, 164, 228]  # the staircase: device 3 does 6.3x device 0
    assert ring_work(32, 4, "zigzag") == [132] * 4  # balanced: (36 + 100 + 164 + 228) / 4 each
    assert ring_work(30, 4, "zigzag") == [124, 124, 105, 112]
    assert ring_work(30, 4, "contiguous") == [36, 100, 140, 189]
    assert ring_work(16, 4, "zigzag", causal=False) == [64] * 4  # no mask: every device its 4 rows x 16


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_work_sums_and_spreads(n: int) -> None:
    for seq in range(n, 12 * n):
        zig, con = ring_work(seq, n, "zigzag"), ring_work(seq, n, "contiguous")
        assert sum(zig) == sum(con) == seq * (seq + 1) // 2  # the visible pairs, each computed once
        if seq % (2 * n) == 0:
            assert len(set(zig)) == 1, (seq, zig)
        assert max(zig) - min(zig) <= seq, (seq, zig)  # within one query row of the whole sequence
        if seq >= 4 * n:  # the contiguous staircase is far wider
            assert max(con) - min(con) > 2 * (max(zig) - min(zig)), (seq, con, zig)


def test_ring_uneven_communication() -> None:
    """Uneven blocks travel padded to the longest local length: forward n-1 packed k/v messages of
    [2, b, hkv, max L, d]; an even split sends exactly what it did (tests/ops/test_context_parallel_attention.py)."""
    seq, n = 30, 4
    mesh = fs.make_mesh({"cp": n}, backend="sim")
    q, k, v = _rand(B, 8, seq, D, seed=1), _rand(B, 2, seq, D, seed=2), _rand(B, 2, seq, D, seed=3)
    with fs.comm_stats() as st:
        fs.shard_map(ring_attention, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)(q, k, v)
    assert st.calls("ppermute", "cp") == n - 1
    assert st.bytes("ppermute", "cp") == (n - 1) * 2 * B * 2 * 8 * D * 4  # max L = 8 positions, float32


def test_ring_sizes_checked() -> None:
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(fs.ShardingError, match=r"sizes=\[3, 3\] do not describe axis 'cp'"):
        fs.shard_map(
            lambda q: ring_attention(q, q, q, sizes=[3, 3]), mesh=fs.make_mesh({"cp": 2}, backend="sim"),
            in_specs=(SPEC,), out_specs=SPEC,
        )(q)  # fmt: skip


def _flash_body(mesh: fs.Mesh, seq: int) -> dict[str, int]:
    """The ring with CPU among the flash devices (the Triton kernels, interpreted) on uneven blocks: loss and
    q/k/v gradients against the unsharded attention; returns how often the block kernels ran here."""
    import importlib

    from funcshard.ops.attention import triton as flash

    local = importlib.import_module("funcshard.ops.attention.local")
    n = mesh.shape["cp"]
    q, k, v = _rand(1, 4, seq, 16, seed=1), _rand(1, 2, seq, 16, seed=2), _rand(1, 2, seq, 16, seed=3)
    r = _rand(1, 4, seq, 16, seed=4)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    (attention(*ref, causal=True) * r).sum().backward()
    order, back = zigzag_indices(seq, n), zigzag_inverse_indices(seq, n)

    def step(r, q, k, v):
        return fs.value_and_grad(lambda q, k, v: fs.psum((ring_attention(q, k, v) * r).sum(), "cp"), argnums=(0, 1, 2))(
            q, k, v
        )

    calls = {"fwd": 0, "bwd": 0}
    forward, backward = flash._forward, flash._backward

    def counted(name, fn):
        return lambda *a, **kw: calls.__setitem__(name, calls[name] + 1) or fn(*a, **kw)

    saved = local.FLASH_DEVICES
    flash._forward, flash._backward = counted("fwd", forward), counted("bwd", backward)
    local.FLASH_DEVICES = ("cuda", "cpu")
    try:
        f = fs.shard_map(step, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(P(), [SPEC] * 3))
        _, grads = f(*(t.index_select(2, order) for t in (r, q, k, v)))
    finally:
        flash._forward, flash._backward = forward, backward
        local.FLASH_DEVICES = saved
    for g, a in zip(grads, ref, strict=True):
        torch.testing.assert_close(fs.device_get(g).index_select(2, back), a.grad, rtol=1e-4, atol=1e-4)
    return calls


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_ring_uneven_runs_the_flash_kernels() -> None:
    """Where the Triton kernels take the blocks (CUDA; CPU added here, interpreted), uneven zigzag blocks (15 on
    cp=2: 8 and 7 positions, chunks 4 + 4 and 4 + 3) run through them too, forward and backward."""
    from _dist_pool import run_body

    (calls,) = run_body("sim", _flash_body, {"cp": 2}, 15)
    assert calls["fwd"] == 4 and calls["bwd"] == 4  # n x n blocks (zigzag: every step computes something)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_ring_uneven_cross_lengths(check_vma: bool) -> None:
    """Not causal, k/v longer than q, both split unevenly (q 30 -> 8, 8, 7, 7; k/v 45 -> 12, 11, 11, 11): the
    k/v blocks travel padded to their own longest, q's lengths play no part."""
    mesh = fs.make_mesh({"cp": 4}, backend="sim")
    q, k, v = _rand(B, 4, 30, D, seed=1), _rand(B, 2, 45, D, seed=2), _rand(B, 2, 45, D, seed=3)
    r = _rand(B, 4, 30, D, seed=4)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = attention(*ref, causal=False)
    (out_ref * r).sum().backward()

    def inner(r_l, q_l, k_l, v_l):
        q_l, k_l, v_l = (t.detach().requires_grad_(True) for t in (q_l, k_l, v_l))
        out = ring_attention(q_l, k_l, v_l, causal=False)
        return out, list(torch.autograd.grad(fs.psum((out * r_l).sum(), "cp"), [q_l, k_l, v_l]))

    f = fs.shard_map(inner, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(SPEC, [SPEC] * 3), check_vma=check_vma)
    out, grads = f(r, q, k, v)
    torch.testing.assert_close(fs.device_get(out), out_ref.detach(), rtol=1e-5, atol=1e-5)
    for g, a in zip(grads, ref, strict=True):
        torch.testing.assert_close(fs.device_get(g), a.grad, rtol=1e-5, atol=1e-5)
