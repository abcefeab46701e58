"""Context parallelism (ring and Ulysses attention, the zigzag layout), forward and backward, against the
unsharded ``funcshard.ops.attention`` on the whole sequence.

Every case runs on cp=2 and cp=4, MHA and GQA, under sim with check_vma on and off; one body covering ring
(zigzag) and Ulysses also runs under dist (gloo workers) on {"cp": 4} and {"dp": 2, "cp": 2}. The backward
check differentiates sum(out * r) inside shard_map with torch.autograd.grad and compares the gradients of
q, k and v with those of the unsharded computation.

Ring attention's hand-written backward is checked on its own as well: both layouts, causal or not, through
``torch.autograd.grad``, ``torch.func.grad`` and ``fs.value_and_grad``, check_vma on and off, in float32 and
float64, on cp=2, cp=4 and dp=2 x cp=2, under sim and dist; its grad of grad; the transforms it hands to
autograd (vmap, jvp); what it sends. (What it saves for the backward, O(s/n) whatever n, against autograd through
the ring: ``tests/whitebox/ops/test_ring_saves_one_block.py``.)
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard import P
from funcshard.ops import (
    attention,
    ring_attention,
    ulysses_attention,
    zigzag_indices,
    zigzag_inverse_indices,
    zigzag_merge,
    zigzag_positions,
    zigzag_split,
)

B, S, D = 2, 16, 8
HEADS = {"mha": (4, 4), "gqa": (8, 2)}  # (q heads, kv heads); gqa on cp=4 repeats kv heads for Ulysses
METHODS = {  # name -> (fn(q, k, v, causal), zigzag layout)
    "ring_zigzag": (lambda q, k, v, c: ring_attention(q, k, v, causal=c), True),
    "ring_contiguous": (lambda q, k, v, c: ring_attention(q, k, v, causal=c, layout="contiguous"), False),
    "ulysses": (lambda q, k, v, c: ulysses_attention(q, k, v, causal=c), False),
}


def _rand(*shape, seed):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _cp_body(mesh: fs.Mesh, method: str, causal: bool, heads: str, check_vma: bool) -> str:
    fn, zig = METHODS[method]
    h, hkv = HEADS[heads]
    n = mesh.shape["cp"]
    q, k, v = _rand(B, h, S, D, seed=1), _rand(B, hkv, S, D, seed=2), _rand(B, hkv, S, D, seed=3)
    r = _rand(B, h, S, D, seed=4)

    ref_args = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = attention(*ref_args, causal=causal)
    (out_ref * r).sum().backward()

    # lay the full sequence out for an ordinary P(.., .., "cp") split: zigzag order for the zigzag ring
    fwd = zigzag_indices(S, n) if zig else torch.arange(S)
    inv = zigzag_inverse_indices(S, n) if zig else torch.arange(S)
    spec = P("dp" if "dp" in mesh.shape else None, None, "cp")

    def inner(r_l, q_l, k_l, v_l):
        q_l, k_l, v_l = (t.detach().requires_grad_(True) for t in (q_l, k_l, v_l))
        out = fn(q_l, k_l, v_l, causal)
        loss = fs.psum((out * r_l).sum(), spec.axes)
        return out, list(torch.autograd.grad(loss, [q_l, k_l, v_l]))

    f = fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, [spec] * 3), check_vma=check_vma)
    out, grads = f(*(t.index_select(2, fwd) for t in (r, q, k, v)))
    tag = f"{method} causal={causal} {heads} cp={n} vma={check_vma}"
    torch.testing.assert_close(fs.device_get(out).index_select(2, inv), out_ref.detach(), rtol=1e-5, atol=1e-5, msg=tag)
    for name, g, a in zip("qkv", grads, ref_args):
        assert g.spec == spec
        got = fs.device_get(g).index_select(2, inv)
        torch.testing.assert_close(got, a.grad, rtol=1e-5, atol=1e-5, msg=f"{tag} d{name}")
    return "ok"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_context_parallel_sim(method: str, causal: bool, heads: str, check_vma: bool, cp: int) -> None:
    from _dist_pool import run_body

    assert run_body("sim", _cp_body, {"cp": cp}, method, causal, heads, check_vma) == ["ok"]


def _dist_body(mesh: fs.Mesh) -> str:
    for method in ("ring_zigzag", "ulysses"):
        for heads in sorted(HEADS):
            for check_vma in (True, False):
                _cp_body(mesh, method, True, heads, check_vma)
    return "ok"


@pytest.mark.parametrize("shape", [{"cp": 4}, {"dp": 2, "cp": 2}], ids=["cp4", "dp2cp2"])
def test_context_parallel_backends(run, shape: dict[str, int]) -> None:
    assert set(run(_dist_body, shape)) == {"ok"}


# --- ring attention's hand-written backward ------------------------------------------------------------------

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _grads_inside(how: str, f, args):
    """The gradients of the scalar ``f(*args)`` w.r.t. all of ``args``, inside shard_map, by ``how``."""
    if how == "autograd":
        args = [a.detach().requires_grad_(True) for a in args]
        return list(torch.autograd.grad(f(*args), args))
    if how == "func":
        return list(torch.func.grad(f, argnums=tuple(range(len(args))))(*args))
    return list(fs.value_and_grad(f, argnums=tuple(range(len(args))))(*args)[1])


def _ring_grad_body(mesh: fs.Mesh, dtype: torch.dtype) -> str:
    """Ring attention vs ``attention`` on the whole sequence, out and dq, dk, dv: both layouts, causal or not,
    three ways to differentiate, check_vma on and off (GQA: 8 query heads on 2 kv heads)."""
    n = mesh.shape["cp"]
    h, hkv = HEADS["gqa"]
    q, k, v = (_rand(B, hh, S, D, seed=i).to(dtype) for i, hh in ((1, h), (2, hkv), (3, hkv)))
    r = _rand(B, h, S, D, seed=4).to(dtype)
    spec = P("dp" if "dp" in mesh.shape else None, None, "cp")
    tol = TOL[dtype]
    for layout in ("zigzag", "contiguous"):
        zig = layout == "zigzag"
        fwd = zigzag_indices(S, n) if zig else torch.arange(S)
        inv = zigzag_inverse_indices(S, n) if zig else torch.arange(S)
        for causal in (True, False):
            ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out_ref = attention(*ref, causal=causal)
            ref_grads = torch.autograd.grad((out_ref * r).sum(), ref)
            for how in ("autograd", "func", "value_and_grad"):
                for check_vma in (True, False):

                    def inner(r_l, q_l, k_l, v_l, how=how, causal=causal, layout=layout):
                        def loss(q_l, k_l, v_l):
                            out = ring_attention(q_l, k_l, v_l, causal=causal, layout=layout)
                            return fs.psum((out * r_l).sum(), spec.axes)

                        out = ring_attention(q_l, k_l, v_l, causal=causal, layout=layout)
                        return out, _grads_inside(how, loss, [q_l, k_l, v_l])

                    f = fs.shard_map(
                        inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, [spec] * 3), check_vma=check_vma
                    )
                    out, grads = f(*(t.index_select(2, fwd) for t in (r, q, k, v)))
                    tag = f"{layout} causal={causal} {how} vma={check_vma} {dtype} {dict(mesh.shape)}"
                    got = fs.device_get(out).index_select(2, inv)
                    torch.testing.assert_close(got, out_ref.detach(), rtol=tol, atol=tol, msg=tag)
                    for name, g, want in zip("qkv", grads, ref_grads):
                        got = fs.device_get(g).index_select(2, inv)
                        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{tag} d{name}")
    return "ok"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", [{"cp": 2}, {"cp": 4}, {"dp": 2, "cp": 2}], ids=["cp2", "cp4", "dp2cp2"])
def test_ring_backward(run, shape: dict[str, int], dtype: torch.dtype) -> None:
    assert set(run(_ring_grad_body, shape, dtype)) == {"ok"}


def _attention_softmax(q, k, v, causal):
    """Plain softmax attention in q's dtype (twice differentiable, unlike SDPA's fused CPU kernel)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [b, h, s, d] @ [b, h, d, s] -> [b, h, s, s]
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v  # [b, h, s, s] @ [b, h, s, d] -> [b, h, s, d]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_grad_of_grad(layout: str, check_vma: bool) -> None:
    """The hand-written backward is made of differentiable ops and collectives (and takes the log-sum-exp's
    cotangent): the gradient of ``|dL/dk|^2`` matches the unsharded one, in float64."""
    n = 4
    mesh = fs.make_mesh({"cp": n}, backend="sim")
    h, hkv = HEADS["gqa"]
    q, k, v = (_rand(B, hh, S, D, seed=i).double() for i, hh in ((1, h), (2, hkv), (3, hkv)))
    r = _rand(B, h, S, D, seed=4).double()
    fwd = zigzag_indices(S, n) if layout == "zigzag" else torch.arange(S)
    inv = zigzag_inverse_indices(S, n) if layout == "zigzag" else torch.arange(S)

    def ref(q, k, v):
        dk = torch.func.grad(lambda k: (_attention_softmax(q, k, v, True) * r).sum())(k)
        return (dk**2).sum()

    want = torch.func.grad(ref, argnums=(0, 1, 2))(q, k, v)
    spec = P(None, None, "cp")

    def inner(r_l, q, k, v):
        def loss(q, k, v):
            return fs.psum((ring_attention(q, k, v, layout=layout) * r_l).sum(), "cp")

        def norm(q, k, v):
            return fs.psum((torch.func.grad(loss, argnums=1)(q, k, v) ** 2).sum(), "cp")

        return list(torch.func.grad(norm, argnums=(0, 1, 2))(q, k, v))

    f = fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=[spec] * 3, check_vma=check_vma)
    got = f(*(t.index_select(2, fwd) for t in (r, q, k, v)))
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(fs.device_get(g).index_select(2, inv), w, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_ring_vmap_and_jvp() -> None:
    """Under vmap and jvp (no rule on the Function) autograd goes through the ring instead: same numbers."""
    n = 4
    mesh = fs.make_mesh({"cp": n}, backend="sim")
    h, hkv = HEADS["gqa"]
    q, k, v = (_rand(3, hh, S, D, seed=i) for i, hh in ((1, h), (2, hkv), (3, hkv)))
    tq = _rand(3, h, S, D, seed=5)
    zz, inv = zigzag_indices(S, n), zigzag_inverse_indices(S, n)
    spec = P(None, None, "cp")

    def inner(q, k, v, tq):  # vmap over the batch (each sample [h, s/n, d]), and a jvp in q
        out = torch.vmap(lambda q, k, v: ring_attention(q[None], k[None], v[None])[0])(q, k, v)
        tangent = torch.func.jvp(lambda q: ring_attention(q, k, v), (q,), (tq,))[1]
        return out, tangent

    out, tangent = fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))(
        *(t.index_select(2, zz) for t in (q, k, v, tq))
    )
    ref_out, ref_tangent = torch.func.jvp(lambda q: _attention_softmax(q, k, v, True), (q,), (tq,))
    torch.testing.assert_close(fs.device_get(out).index_select(2, inv), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fs.device_get(tangent).index_select(2, inv), ref_tangent, rtol=1e-5, atol=1e-5)


# --- the zigzag layout ----------------------------------------------------------------------------------------


def test_zigzag_indices() -> None:
    assert zigzag_indices(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_indices(8, 4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    idx = zigzag_indices(24, 3)
    assert torch.equal(idx[zigzag_inverse_indices(24, 3)], torch.arange(24))
    assert torch.equal(torch.cat([zigzag_positions(24, 3, i) for i in range(3)]), idx)
    assert zigzag_positions(24, 3, 1).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]  # chunks 1 and 4 of 6


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_split_merge(cp: int, check_vma: bool) -> None:
    mesh = fs.make_mesh({"cp": cp}, backend="sim")
    x = _rand(2, S, 3, seed=1)
    r = _rand(2, S, 3, seed=2)
    r_zig = r.index_select(1, zigzag_indices(S, cp))

    def split_grad(x, r_l):  # x replicated: split, then the gradient of sum(split * r) is r, back in order
        x = x.detach().requires_grad_(True)
        y = zigzag_split(x, "cp", dim=1)  # [2, s, 3] -> [2, s/cp, 3]
        (g,) = torch.autograd.grad(fs.psum((y * r_l).sum(), "cp"), [x])
        return y, zigzag_merge(y, "cp", dim=1), g

    y, z, g = fs.shard_map(
        split_grad, mesh=mesh, in_specs=(P(), P(None, "cp")), out_specs=(P(None, "cp"), P(), P()), check_vma=check_vma
    )(x, r_zig)
    torch.testing.assert_close(fs.device_get(y), x.index_select(1, zigzag_indices(S, cp)))
    torch.testing.assert_close(fs.device_get(z), x)  # round trip
    torch.testing.assert_close(fs.device_get(g), r)

    def merge_grad(y_l, r):  # zigzag shards merged: the gradient of sum(merged * r) is this device's chunks of r
        y_l = y_l.detach().requires_grad_(True)
        (g,) = torch.autograd.grad((zigzag_merge(y_l, "cp", dim=1) * r).sum(), [y_l])
        return g

    g = fs.shard_map(
        merge_grad, mesh=mesh, in_specs=(P(None, "cp"), P()), out_specs=P(None, "cp"), check_vma=check_vma
    )(x.index_select(1, zigzag_indices(S, cp)), r)
    torch.testing.assert_close(fs.device_get(g), r_zig)


# --- communication --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_communication(cp: int, dtype: torch.dtype) -> None:
    mesh = fs.make_mesh({"cp": cp}, backend="sim")
    h, hkv = HEADS["gqa"]
    q, k, v = (_rand(B, hh, S, D, seed=i).to(dtype) for i, hh in ((1, h), (2, hkv), (3, hkv)))
    spec = P(None, None, "cp")
    block = B * hkv * (S // cp) * D  # elements of one [b, hkv, s/n, d] block
    kv_block = 2 * block * dtype.itemsize  # k and v packed: [2, b, hkv, s/n, d], one message per step
    dkv_block = 2 * block * 4  # the dk/dv accumulator [2, b, hkv, s/n, d], float32

    with fs.comm_stats() as st:
        fs.shard_map(ring_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    # forward: n-1 ring steps, one ppermute of the packed k/v block each, nothing else
    assert st.calls("ppermute", "cp") == cp - 1
    assert st.bytes("ppermute", "cp") == (cp - 1) * kv_block
    assert st.calls() == cp - 1

    def grads(q, k, v):
        return list(torch.func.grad(lambda q, k, v: ring_attention(q, k, v).float().sum(), argnums=(0, 1, 2))(q, k, v))

    with fs.comm_stats() as st:
        fs.shard_map(grads, mesh=mesh, in_specs=(spec,) * 3, out_specs=[spec] * 3)(q, k, v)
    # backward: n-1 ring steps of the k/v block with its dk/dv accumulator (one [4, ...] message when both are
    # float32, else two), then one hop of the dk/dv accumulator home. (Autograd through the ring sent n-1
    # ppermutes of the k/v cotangent instead, at the memory of every received block: tests/whitebox/ops/
    # test_ring_saves_one_block.py)
    per_step = 1 if dtype == torch.float32 else 2
    assert st.calls("ppermute", "cp") == (cp - 1) + (cp - 1) * per_step + 1
    assert st.bytes() == (cp - 1) * kv_block + (cp - 1) * (kv_block + dkv_block) + dkv_block
    assert st.calls() == st.calls("ppermute", "cp")


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_communication(cp: int, heads: str) -> None:
    mesh = fs.make_mesh({"cp": cp}, backend="sim")
    h, hkv = HEADS[heads]
    hkv_sent = hkv if hkv % cp == 0 else cp  # gqa on cp=4: 2 kv heads are repeated to 4 before the all-to-all
    q, k, v = _rand(B, h, S, D, seed=1), _rand(B, hkv, S, D, seed=2), _rand(B, hkv, S, D, seed=3)
    spec = P(None, None, "cp")
    # q in, k in, v in, out back: 4 all-to-alls, each payload this device's input ([b, heads, s/n, d] float32)
    fwd_bytes = (2 * h + 2 * hkv_sent) * B * (S // cp) * D * 4

    with fs.comm_stats() as st:
        fs.shard_map(ulysses_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    assert st.calls("all_to_all", "cp") == 4
    assert st.bytes("all_to_all", "cp") == fwd_bytes
    assert st.calls() == 4

    def grads(q, k, v):
        return list(torch.func.grad(lambda q, k, v: ulysses_attention(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v))

    with fs.comm_stats() as st:
        fs.shard_map(grads, mesh=mesh, in_specs=(spec,) * 3, out_specs=[spec] * 3)(q, k, v)
    # backward: each all-to-all's transpose, the reverse all-to-all of a cotangent of the same size
    assert st.calls("all_to_all", "cp") == 8
    assert st.bytes() == 2 * fwd_bytes


# --- bad inputs -----------------------------------------------------------------------------------------------


SEQ = P(None, None, "cp")


def _call(fn, mesh_shape, *args, spec=SEQ):
    mesh = fs.make_mesh(mesh_shape, backend="sim")
    return fs.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)(*args)


def test_ulysses_heads_not_divisible() -> None:
    q = torch.zeros(1, 6, 8, 4)
    with pytest.raises(fs.ShardingError, match=r"q has 6 heads, not divisible by the size 4 of axis 'cp'"):
        _call(ulysses_attention, {"cp": 4}, q, q, q)


def test_ring_unknown_layout() -> None:
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(fs.ShardingError, match=r"unknown layout 'striped'"):
        _call(lambda q, k, v: ring_attention(q, k, v, layout="striped"), {"cp": 2}, q, q, q)


def test_zigzag_needs_a_device() -> None:
    # (odd local lengths and sequences 2n does not divide are zigzag layouts too: tests/ops/test_ring_uneven.py)
    with pytest.raises(fs.ShardingError, match=r"needs n >= 1 devices"):
        zigzag_indices(12, 0)
