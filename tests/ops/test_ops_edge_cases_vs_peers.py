"""Audit of ``funcshard.ops`` (tensor, sequence and context parallelism, attention, the Triton kernels) on what
the op tests do not cover: masked (``-inf``) and huge logits, labels and ids that do not fit, misshapen
attention inputs, context parallelism under ``fs.remat`` (and remat of in-place-written matmul products), the
tracked positions of the zigzag layout, and edge shapes of the kernels.

Oracles: the unsharded single-device computation (``F.cross_entropy``, ``F.embedding``, ``F.linear``, softmax
attention written out in float64), optax's ``softmax_cross_entropy_with_integer_labels`` and
``jax.nn.dot_product_attention`` (JAX on host devices, a test oracle only: skipped without it). Bodies that
communicate run under ``sim`` and under ``dist`` (gloo), with check_vma on and off.

Causal attention with fewer keys than queries (or more) raises in funcshard; torch's SDPA and JAX's
``dot_product_attention(is_causal=True)`` both align the mask top-left there (query ``i`` sees keys ``<= i``),
which for a decoder with a cache is the wrong end, so a ShardingError is the answer, not a guess.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P
from funcshard.ops import (
    attention,
    column_parallel_linear,
    ring_attention,
    row_parallel_linear,
    ulysses_attention,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    zigzag_indices,
    zigzag_inverse_indices,
    zigzag_merge,
    zigzag_positions,
    zigzag_split,
)

pytestmark = pytest.mark.oracle


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- vocab-parallel cross-entropy ----------------------------------------------------------------------------

V, TP = 16, 2  # a vocabulary of 16 over tp=2: columns 0 and 8 open the two shards


def _masked_logits(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """[2, 5, V] logits with masked (-inf) vocabulary entries: column 0 (the first column of shard 0), column
    8 (the first of shard 1, in one row) and the last column, as a model masks padding or forbidden tokens."""
    x = _rand(2, 5, V, seed=11) * scale
    x[..., 0] = float("-inf")
    x[0, 1, V // TP] = float("-inf")
    x[1, :, V - 1] = float("-inf")
    return x.to(dtype)


# labels on either shard and at their edges (1, 7, 9, 14), never a masked column, and -100 (ignored) entries
_LABELS = torch.tensor([[1, 7, 9, -100, 14], [-100, -100, 2, 9, 7]])


def _ce_body(mesh: fs.Mesh, dtype: torch.dtype, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Loss and logits' gradient of the vocab-parallel cross-entropy (mean and none), check_vma on and off."""
    logits = _masked_logits(dtype, scale)
    out = []
    for check_vma in (True, False):
        for reduction in ("mean", "none"):

            def inner(lg: torch.Tensor, lab: torch.Tensor, reduction: str = reduction) -> tuple:
                lg = lg.detach().requires_grad_(True)
                loss = vocab_parallel_cross_entropy(lg, lab, reduction=reduction)
                (g,) = torch.autograd.grad(loss.sum(), lg)
                return loss, g

            f = fs.shard_map(
                inner,
                mesh=mesh,
                in_specs=(P(None, None, "tp"), P()),
                out_specs=(P(), P(None, None, "tp")),
                check_vma=check_vma,
            )
            loss, g = f(logits, _LABELS)
            out.append((fs.device_get(loss).detach(), fs.device_get(g).detach()))
    return out


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [(torch.float32, 3.0), (torch.bfloat16, 40.0), (torch.float32, 1e30)],
    ids=["fp32", "bf16", "huge"],
)
def test_cross_entropy_with_masked_logits(run, dtype: torch.dtype, scale: float) -> None:
    """A -inf logit in the first column of a shard made every loss NaN: a device not holding a row's label
    multiplied the logit it picked in its place by 0 (-inf * 0 = NaN) and the psum spread it. Now the loss and
    gradient of F.cross_entropy on the whole vocabulary (float32 math, also for bf16 logits and logits of 1e30)."""
    logits = _masked_logits(dtype, scale).float().requires_grad_(True)
    want = {}
    for reduction in ("mean", "none"):
        ref = F.cross_entropy(logits.reshape(-1, V), _LABELS.reshape(-1), reduction=reduction)
        ref = ref if reduction == "mean" else ref.view(_LABELS.shape)
        (g,) = torch.autograd.grad(ref.sum(), logits)
        want[reduction] = (ref.detach(), g)
    tol = 1e-5 * max(1.0, scale)
    for got in run(_ce_body, {"tp": TP}, dtype, scale):
        assert len(got) == 4
        for (loss, g), reduction in zip(got, ["mean", "none"] * 2):
            assert torch.isfinite(loss).all(), (reduction, loss)
            torch.testing.assert_close(loss, want[reduction][0], rtol=1e-5, atol=tol)
            torch.testing.assert_close(g.float(), want[reduction][1], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                       atol=1e-2 if dtype == torch.bfloat16 else 1e-6)  # fmt: skip


def test_cross_entropy_matches_optax() -> None:
    """The per-token losses against optax on the same (masked) logits, ignored labels left out."""
    optax = pytest.importorskip("optax")
    jnp = pytest.importorskip("jax.numpy")
    import numpy as np

    logits = _masked_logits(torch.float32, 3.0)
    valid = _LABELS != -100
    want = optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits.numpy()), jnp.asarray(_LABELS.clamp(min=0).numpy())
    )
    want = torch.where(valid, torch.from_numpy(np.array(want)), 0.0)  # (label 0, masked, where -100 was: inf)
    mesh = fs.make_mesh({"tp": TP}, backend="sim")
    f = fs.shard_map(
        lambda lg, lab: vocab_parallel_cross_entropy(lg, lab, reduction="none"),
        mesh=mesh,
        in_specs=(P(None, None, "tp"), P()),
        out_specs=P(),
    )
    got = fs.device_get(f(logits, _LABELS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mean = fs.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "tp"), P()), out_specs=P())
    torch.testing.assert_close(fs.device_get(mean(logits, _LABELS)), want.sum() / valid.sum(), rtol=1e-5, atol=1e-6)


def test_cross_entropy_labels_that_do_not_fit_raise() -> None:
    """Labels of another shape than ``logits.shape[:-1]`` or dtype: a ShardingError naming both shapes, with
    an axis and without one. The sharded op raised torch's "stack expects each tensor to be equal size" (or
    gather's dtype error for uint8 / int16 labels, which the unsharded path took); the unsharded op took
    labels [8, 2] for logits [2, 8, V], flattened both and silently paired each logit row with another label."""
    mesh = fs.make_mesh({"tp": TP}, backend="sim")
    logits = _rand(2, 8, V, seed=1)
    sharded = fs.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "tp"), P()), out_specs=P())
    for labels in (torch.zeros(8, 2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)):
        msg = re.escape(f"logits of shape (2, 8, {V}) need int64 or int32 labels of shape (2, 8)")
        msg += ".*" + re.escape(f"the labels have shape {tuple(labels.shape)}")
        with pytest.raises(fs.ShardingError, match=msg):
            vocab_parallel_cross_entropy(logits, labels, axis=None)
        with pytest.raises(fs.ShardingError, match="need int64 or int32 labels of shape"):
            sharded(logits, labels)
    for dt in (torch.uint8, torch.int16, torch.float32):
        labels = torch.zeros(2, 8).to(dt)
        with pytest.raises(fs.ShardingError, match=f"dtype {dt}; reshape or cast them"):
            vocab_parallel_cross_entropy(logits, labels, axis=None)
        with pytest.raises(fs.ShardingError, match=f"dtype {dt}; reshape or cast them"):
            sharded(logits, labels)
    ok = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    ref = F.cross_entropy(logits.reshape(-1, V), ok.reshape(-1))
    for labels in (ok, ok.int()):  # the ids the sharded op takes, with and without an axis
        torch.testing.assert_close(fs.device_get(sharded(logits, labels)), ref)
        torch.testing.assert_close(vocab_parallel_cross_entropy(logits, labels, axis=None), ref)


def _varying_ids_body(mesh: fs.Mesh) -> list[str]:
    """Ids / labels sharded over the vocabulary's own axis, check_vma on and off: the error of each call."""
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    table, logits = _rand(V, 3, seed=2), _rand(1, 4, V, seed=3)  # labels [2, 4] over tp: [1, 4] a device
    calls = [
        (vocab_parallel_embedding, (ids, table), (P("tp"), P("tp")), P("tp")),
        (vocab_parallel_embedding, (ids, table), (P("tp"), P("tp")), P()),
        (vocab_parallel_cross_entropy, (logits, ids), (P(None, None, "tp"), P("tp")), P()),
    ]
    errors = []
    for check_vma in (True, False):
        for fn, args, in_specs, out_spec in calls:
            f = fs.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)
            try:
                f(*args)
                errors.append("no error")
            except fs.ShardingError as e:
                errors.append(str(e))
    return errors


def test_ids_varying_over_the_vocab_axis_raise(run) -> None:
    """Every device of the vocabulary's axis must look up the same ids. Ids sharded over that axis were looked
    up per device and summed across it: silently wrong embeddings (2.0 off F.embedding), even as an output
    promised replicated (P()). Now a ShardingError naming the axis and the fix, tracked or not."""
    for errors in run(_varying_ids_body, {"tp": TP}):
        assert len(errors) == 6
        for e in errors:
            assert "vary over axis 'tp', the axis the vocabulary is split over" in e, e
            assert "in_spec that does not name 'tp'" in e, e


def _embedding_edges_body(mesh: fs.Mesh) -> list[object]:
    """Ids at every shard boundary and the last id, forward and backward; an id past the end; -1."""
    n = mesh.shape["tp"]
    table = _rand(V, 3, seed=4, dtype=torch.float64)
    rows = V // n
    ids = torch.tensor([[j * rows + e for j in range(n) for e in (0, rows - 1)] + [V - 1, 0]])
    out: list[object] = []
    for check_vma in (True, False):

        def inner(ids: torch.Tensor, t: torch.Tensor) -> tuple:
            t = t.detach().requires_grad_(True)
            e = vocab_parallel_embedding(ids, t, scatter_dim=1)  # [1, 2n + 2] -> [1, (2n + 2) / n, 3]
            (g,) = torch.autograd.grad(fs.psum((e * e).sum(), "tp"), t)
            return e, g

        f = fs.shard_map(
            inner, mesh=mesh, in_specs=(P(), P("tp")), out_specs=(P(None, "tp"), P("tp")), check_vma=check_vma
        )
        e, g = f(ids, table)
        out.append((fs.device_get(e).detach(), fs.device_get(g).detach()))
        bad = fs.shard_map(vocab_parallel_embedding, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P())
        for v in (V, -1):
            try:
                bad(torch.tensor([[0, v]]), table)
                out.append("no error")
            except fs.ShardingError as err:
                out.append(str(err))
    return out


def test_embedding_at_shard_boundaries(run) -> None:
    n = 2
    table = _rand(V, 3, seed=4, dtype=torch.float64).requires_grad_(True)
    rows = V // n
    ids = torch.tensor([[j * rows + e for j in range(n) for e in (0, rows - 1)] + [V - 1, 0]])
    ref = F.embedding(ids, table)
    (g_ref,) = torch.autograd.grad((ref * ref).sum(), table)
    for got in run(_embedding_edges_body, {"tp": n}):
        for k in (0, 3):
            e, g = got[k]
            torch.testing.assert_close(e, ref.detach(), rtol=0, atol=0)
            torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=1e-14)
            assert f"ids contain {V}, outside [0, {V})" in got[k + 1]
            assert f"ids contain -1, outside [0, {V})" in got[k + 2]


# --- sequence-parallel linear layers -------------------------------------------------------------------------


def _sp_mlp_body(mesh: fs.Mesh) -> list[list[torch.Tensor]]:
    """A sequence-parallel MLP on a 3-d input: column (all-gather of dim 1, bias) then row (reduce-scatter of dim
    1, bias); output and gradients of x, w1, b1, w2, b2, check_vma on and off."""
    x, w1, b1 = _rand(2, 8, 6, seed=1, dtype=torch.float64), _rand(8, 6, seed=2), _rand(8, seed=3)
    w2, b2, r = _rand(6, 8, seed=4), _rand(6, seed=5), _rand(2, 8, 6, seed=6, dtype=torch.float64)
    w1, b1, w2, b2 = (t.double() for t in (w1, b1, w2, b2))
    out = []
    for check_vma in (True, False):

        def inner(r, x, w1, b1, w2, b2):
            args = [t.detach().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
            h = torch.tanh(column_parallel_linear(args[0], args[1], args[2], gather_dim=1))  # [2, 8, 8/tp]
            y = row_parallel_linear(h, args[3], args[4], scatter_dim=1)  # [2, 8/tp, 6]
            return y, list(torch.autograd.grad(fs.psum((y * r).sum(), "tp"), args))

        specs = (P(None, "tp"), P(None, "tp"), P("tp"), P("tp"), P(None, "tp"), P())
        f = fs.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=(P(None, "tp"), list(specs[1:])),
                         check_vma=check_vma)  # fmt: skip
        y, grads = f(r, x, w1, b1, w2, b2)
        out.append([fs.device_get(t).detach() for t in (y, *grads)])
    return out


def test_sequence_parallel_mlp(run) -> None:
    """Forward and backward of column(gather_dim) + row(scatter_dim) with biases against the unsharded MLP."""
    x, w1, b1 = _rand(2, 8, 6, seed=1, dtype=torch.float64), _rand(8, 6, seed=2), _rand(8, seed=3)
    w2, b2, r = _rand(6, 8, seed=4), _rand(6, seed=5), _rand(2, 8, 6, seed=6, dtype=torch.float64)
    args = [t.double().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    y = F.linear(torch.tanh(F.linear(args[0], args[1], args[2])), args[3], args[4])
    want = [y.detach(), *torch.autograd.grad((y * r).sum(), args)]
    for got in run(_sp_mlp_body, {"tp": 2}):
        for per_mode in got:
            for name, g, w in zip(["y", "x", "w1", "b1", "w2", "b2"], per_mode, want):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


# --- attention ------------------------------------------------------------------------------------------------


def _softmax_attention(q, k, v, causal, scale=None):
    """Softmax attention written out in float64: the output and the log-sum-exp of the scores."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [b,h,sq,d] @ [b,h,d,sk]
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)  # [b, h, sq, sk] @ [b, h, sk, d] -> [b, h, sq, d]


ATT_SHAPES = [  # (b, hq, hkv, sq, sk, d, causal): GQA, head_dim not a power of two, q and k lengths differing
    (2, 4, 2, 5, 5, 12, True),
    (1, 6, 2, 3, 7, 20, False),
    (1, 8, 2, 9, 9, 7, True),
    (1, 2, 2, 1, 1, 4, True),
]


@pytest.mark.parametrize("shape", ATT_SHAPES, ids=lambda s: "x".join(map(str, s[:-1])) + ("c" if s[-1] else ""))
def test_attention_matches_jax_and_the_log_sum_exp(shape) -> None:
    """float32: out equal to jax.nn.dot_product_attention's (BTNH layout); float64: out and lse equal to the
    softmax written out in float64, with and without return_lse (the SDPA path and the written-out one)."""
    jax = pytest.importorskip("jax")
    import numpy as np

    b, hq, hkv, sq, sk, d, causal = shape
    q, k, v = _rand(b, hq, sq, d, seed=1), _rand(b, hkv, sk, d, seed=2), _rand(b, hkv, sk, d, seed=3)
    jo = jax.nn.dot_product_attention(*(jax.numpy.asarray(t.transpose(1, 2).numpy()) for t in (q, k, v)),
                                      is_causal=causal)  # fmt: skip
    jo = torch.from_numpy(np.array(jo)).transpose(1, 2)
    torch.testing.assert_close(attention(q, k, v, causal=causal), jo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention(q, k, v, causal=causal, return_lse=True)[0], jo, rtol=1e-5, atol=1e-5)
    q, k, v = q.double(), k.double(), v.double()
    ref, lse_ref = _softmax_attention(q, k, v, causal)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64 and lse.shape == (b, hq, sq)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attention(q, k, v, causal=causal), ref, rtol=1e-12, atol=1e-12)


def test_attention_inputs_that_do_not_fit_raise() -> None:
    """3-d or 5-d q/k/v raised Python's "not enough values to unpack"; zero k/v heads a ZeroDivisionError
    (attention, ring_attention and ulysses_attention alike). Now ShardingErrors naming the shapes."""
    x3, x4, x5 = torch.zeros(2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8, 2)
    kv0 = torch.zeros(1, 0, 4, 8)
    for q in (x3, x5):
        with pytest.raises(fs.ShardingError, match=r"attention: q .*need 4-d \[batch, heads, seq, head_dim\]"):
            attention(q, q, q)
    for fn in (attention, ring_attention, ulysses_attention):
        with pytest.raises(fs.ShardingError, match=r"q \(1, 2, 4, 8\), k \(1, 0, 4, 8\)|k/v 0"):
            fn(x4, kv0, kv0, **({} if fn is attention else {"axis": None}))
    with pytest.raises(fs.ShardingError, match="q has 4 positions but k has 6"):
        attention(x4, torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), causal=True)


# --- context parallelism --------------------------------------------------------------------------------------

CP_B, CP_H, CP_HKV, CP_S, CP_D = 1, 4, 2, 16, 6


def _cp_body(mesh: fs.Mesh, dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """Ring (both layouts, causal, and non-causal with 3x more keys than queries) and Ulysses (causal) over
    {"cp": n}, GQA, head_dim 6, a scale: out and dq, dk, dv of sum(out * r), in the global sequence order."""
    n = mesh.shape["cp"]
    q, r = _rand(CP_B, CP_H, CP_S, CP_D, seed=1, dtype=dtype), _rand(CP_B, CP_H, CP_S, CP_D, seed=4, dtype=dtype)
    out = {}
    for name, sk, layout in (("zigzag", CP_S, "zigzag"), ("contiguous", CP_S, "contiguous"),
                             ("full", 3 * CP_S, "zigzag"), ("ulysses", CP_S, None)):  # fmt: skip
        k, v = _rand(CP_B, CP_HKV, sk, CP_D, seed=2, dtype=dtype), _rand(CP_B, CP_HKV, sk, CP_D, seed=3, dtype=dtype)
        zig = name == "zigzag"
        fq = zigzag_indices(CP_S, n) if zig else torch.arange(CP_S)
        fk = zigzag_indices(sk, n) if zig else torch.arange(sk)
        causal = name != "full"
        for check_vma in (True, False):

            def inner(r, q, k, v, causal=causal, layout=layout):
                q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
                if layout is None:
                    o = ulysses_attention(q, k, v, causal=causal, scale=0.3)
                else:
                    o = ring_attention(q, k, v, causal=causal, layout=layout, scale=0.3)
                return o, list(torch.autograd.grad(fs.psum((o.float() * r.float()).sum(), "cp"), (q, k, v)))

            spec = P(None, None, "cp")
            f = fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, [spec] * 3), check_vma=check_vma)
            o, grads = f(r[:, :, fq], q[:, :, fq], k[:, :, fk], v[:, :, fk])
            iq, ik = torch.argsort(fq), torch.argsort(fk)
            got = [fs.device_get(o).detach()[:, :, iq]]
            got += [fs.device_get(g).detach()[:, :, i] for g, i in zip(grads, (iq, ik, ik))]
            out[f"{name} vma={check_vma}"] = got
    return out


def _check_cp(results: list[dict[str, list[torch.Tensor]]], dtype: torch.dtype) -> None:
    """Each result of :func:`_cp_body` against the float64 softmax on the whole sequence (bf16: its rounding)."""
    q, r = _rand(CP_B, CP_H, CP_S, CP_D, seed=1, dtype=dtype), _rand(CP_B, CP_H, CP_S, CP_D, seed=4, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for got in results:
        assert len(got) == 8
        for key, vals in got.items():
            sk = 3 * CP_S if key.startswith("full") else CP_S
            k, v = (_rand(CP_B, CP_HKV, sk, CP_D, seed=s, dtype=dtype) for s in (2, 3))
            ref_args = [t.double().requires_grad_(True) for t in (q, k, v)]
            ref, _ = _softmax_attention(*ref_args, causal=not key.startswith("full"), scale=0.3)
            want = [ref.detach(), *torch.autograd.grad((ref * r.double()).sum(), ref_args)]
            for name, g, w in zip(["out", "dq", "dk", "dv"], vals, want):
                assert g.dtype == dtype, (key, name, g.dtype)
                torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=f"{key} {name}")


def test_context_parallel_against_float64(run) -> None:
    """Ring and Ulysses on cp=2 equal the float64 softmax on the whole sequence, under sim and dist."""
    _check_cp(run(_cp_body, {"cp": 2}, torch.float64), torch.float64)


def test_context_parallel_cp4_bfloat16() -> None:
    """The same on cp=4 in bfloat16 (the ring's k/v and its float32 dk/dv travel as two messages), sim."""
    from _dist_pool import run_body

    _check_cp(run_body("sim", _cp_body, {"cp": 4}, torch.bfloat16), torch.bfloat16)


def _remat_ring_body(mesh: fs.Mesh) -> dict[str, list[torch.Tensor]]:
    """q projected by a replicated weight, then ring (zigzag) or Ulysses attention, the block under fs.remat with
    each policy, check_vma on and off (off: the weight's pvary written out): dq, dk, dv, dw in sequence order."""
    n = mesh.shape["cp"]
    q, k, v = _rand(1, 4, 16, 4, seed=1, dtype=torch.float64), *(_rand(1, 2, 16, 4, seed=s, dtype=torch.float64)
                                                                   for s in (2, 3))  # fmt: skip
    w, r = _rand(4, 4, seed=5, dtype=torch.float64), _rand(1, 4, 16, 4, seed=4, dtype=torch.float64)
    spec = P(None, None, "cp")
    out = {}
    for policy in ("nothing_saveable", "dots_saveable"):
        for method in ("ring", "ulysses"):
            for check_vma in (True, False):

                def block(q, k, v, w, method=method):
                    qw = q @ w  # [1, 4, 16/n, 4] @ [4, 4] -> [1, 4, 16/n, 4]
                    return ring_attention(qw, k, v) if method == "ring" else ulysses_attention(qw, k, v)

                def loss(q, k, v, w, r, policy=policy, check_vma=check_vma, block=block):
                    w = w if check_vma else fs.pvary(w, "cp")
                    o = fs.remat(block, policy=getattr(fs.remat_policies, policy))(q, k, v, w)
                    return fs.psum((o * r).sum(), "cp")

                f = fs.shard_map(
                    lambda *a, loss=loss: fs.value_and_grad(loss, argnums=(0, 1, 2, 3))(*a)[1],
                    mesh=mesh,
                    in_specs=(spec, spec, spec, P(), spec),
                    out_specs=(spec, spec, spec, P()),
                    check_vma=check_vma,
                )
                order = zigzag_indices(16, n) if method == "ring" else torch.arange(16)
                grads = f(*(t[:, :, order] for t in (q, k, v)), w, r[:, :, order])
                back = torch.argsort(order)
                got = [fs.device_get(g).detach()[:, :, back] for g in grads[:3]] + [fs.device_get(grads[3]).detach()]
                out[f"{policy} {method} vma={check_vma}"] = got
    return out


def test_context_parallel_under_remat(run) -> None:
    """fs.remat(dots_saveable) around ring attention gave gradients 0.77 off: the ring's merge writes its blocks'
    p @ v products in place, and the remat log, whose saved matmul outputs were detached below autograd (a
    version counter of their own), did not see the write and handed the written products to the recomputation.
    Now every policy gives the gradients of the unsharded block, ring and Ulysses, under sim and dist."""
    q, k, v = _rand(1, 4, 16, 4, seed=1, dtype=torch.float64), *(_rand(1, 2, 16, 4, seed=s, dtype=torch.float64)
                                                                   for s in (2, 3))  # fmt: skip
    w, r = _rand(4, 4, seed=5, dtype=torch.float64), _rand(1, 4, 16, 4, seed=4, dtype=torch.float64)
    args = [t.clone().requires_grad_(True) for t in (q, k, v, w)]
    want = torch.autograd.grad((attention(args[0] @ args[3], args[1], args[2], causal=True) * r).sum(), args)
    for got in run(_remat_ring_body, {"cp": 2}):
        assert len(got) == 8
        for key, grads in got.items():
            for name, g, ww in zip(["dq", "dk", "dv", "dw"], grads, want):
                torch.testing.assert_close(g, ww, rtol=1e-12, atol=1e-12, msg=f"{key} {name}")


@pytest.mark.parametrize("dims", [2, 4], ids=["mm", "bmm"])
def test_remat_sees_in_place_writes_to_saved_products(dims: int) -> None:
    """The same without communication: h = a @ b written in place inside fs.remat(dots_saveable) (2-d: mm's own
    output; 4-d: the _unsafe_view of bmm's) gave dw 1.34 off the plain gradient. Now bit for bit equal."""
    shape = (2, 3)[: dims - 2]
    a, b = _rand(*shape, 4, 5, seed=1, dtype=torch.float64), _rand(*shape, 5, 4, seed=2, dtype=torch.float64)

    def f(a, b):
        h = a @ b  # [.., 4, 5] @ [.., 5, 4] -> [.., 4, 4]
        h[..., :2].mul_(2)
        return torch.tanh(h)

    ref = [t.clone().requires_grad_(True) for t in (a, b)]
    want = torch.autograd.grad(f(*ref).sum(), ref)
    for policy in ("dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable"):
        args = [t.clone().requires_grad_(True) for t in (a, b)]
        got = torch.autograd.grad(fs.remat(f, policy=getattr(fs.remat_policies, policy))(*args).sum(), args)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (policy, (g - w).abs().max())


def _positions_body(mesh: fs.Mesh) -> list[object]:
    n = mesh.shape["cp"]
    pos = lambda: zigzag_positions(4 * n, n, fs.axis_index("cp"))  # noqa: E731
    sharded = fs.shard_map(pos, mesh=mesh, in_specs=(), out_specs=P("cp"))
    out: list[object] = [fs.device_get(sharded())]
    try:
        fs.device_get(fs.shard_map(pos, mesh=mesh, in_specs=(), out_specs=P())())
        out.append("no error")
    except fs.ShardingError as e:
        out.append(str(e))
    return out


def test_zigzag_positions_vary_over_the_axis(run) -> None:
    """zigzag_positions(s, n, fs.axis_index("cp")) sliced with the index read as an int: the result carried no
    tag, so returning it under out_specs=P() gave device 0's positions as "the" value. Now it varies over
    "cp" (a ShardingError there); sharded, it is the zigzag order; an index outside [0, n) raises (it gave [])."""
    n = 2
    for got in run(_positions_body, {"cp": n}):
        assert torch.equal(got[0], zigzag_indices(4 * n, n)), got[0]
        assert "varies over axis 'cp'" in got[1], got[1]
    assert torch.equal(zigzag_positions(8, 2, 1), zigzag_indices(8, 2)[4:])
    for bad in (2, -1):
        with pytest.raises(fs.ShardingError, match=rf"zigzag_positions: device index {bad} is outside \[0, 2\)"):
            zigzag_positions(8, 2, bad)
    assert torch.equal(zigzag_inverse_indices(8, 2)[zigzag_indices(8, 2)], torch.arange(8))


def _zigzag_body(mesh: fs.Mesh) -> list[list[torch.Tensor]]:
    """zigzag_split of a replicated value, then zigzag_merge back; the gradients of both (dim -2, check_vma on
    and off); a length not divisible by 2n: its uneven zigzag split."""
    n = mesh.shape["cp"]
    x, r = _rand(2, 4 * n, 3, seed=1, dtype=torch.float64), _rand(2, 4 * n, 3, seed=2, dtype=torch.float64)
    out = []
    for check_vma in (True, False):

        def inner(x, r):
            x = x.detach().requires_grad_(True)
            y = zigzag_split(x, "cp", dim=-2)  # [2, 4n, 3] -> [2, 4, 3]
            z = zigzag_merge(y * 2, "cp", dim=-2)  # [2, 4, 3] -> [2, 4n, 3], invariant
            (g,) = torch.autograd.grad((z * r).sum(), x)
            return y, z, g

        f = fs.shard_map(inner, mesh=mesh, in_specs=(P(), P()), out_specs=(P(None, "cp"), P(), P()),
                         check_vma=check_vma)  # fmt: skip
        out.append([fs.device_get(t).detach() for t in f(x, r)])
    odd = fs.shard_map(lambda x: zigzag_split(x, "cp", dim=1), mesh=mesh, in_specs=(P(),), out_specs=P(None, "cp"))
    out.append([fs.device_get(odd(torch.arange(2 * n + 2.0).view(1, -1, 1)))])  # 2n does not divide 2n + 2
    return out


def test_zigzag_split_merge_round_trip(run) -> None:
    """split then merge is the identity (times 2 here), its gradient 2r, the split in zigzag order; sim and dist."""
    n = 2
    x, r = _rand(2, 4 * n, 3, seed=1, dtype=torch.float64), _rand(2, 4 * n, 3, seed=2, dtype=torch.float64)
    for got in run(_zigzag_body, {"cp": n}):
        for y, z, g in got[:2]:
            assert torch.equal(y, x[:, zigzag_indices(4 * n, n)])
            assert torch.equal(z, 2 * x) and torch.equal(g, 2 * r)
        # a length 2n does not divide: the uneven zigzag chunks (ceil / floor of each device's tensor_split length)
        assert got[2][0].flatten().tolist() == zigzag_indices(2 * n + 2, n).tolist(), got[2][0]


# --- the Triton kernels, interpreted ----------------------------------------------------------------------------

TRITON_SHAPES = [  # (b, hq, hkv, sq, sk, d, causal); the interpreter's blocks are 32 x 16 and 16 x 32
    (1, 2, 2, 1, 1, 16, True),  # one position
    (1, 2, 1, 1, 37, 48, False),  # one query, head_dim 48 (padded to 64)
    (1, 8, 2, 33, 33, 48, True),  # GQA group 4, a partial block
    (1, 4, 1, 17, 17, 64, True),  # MQA, head_dim 64
    (1, 2, 2, 40, 5, 16, False),  # fewer keys than one block
]


@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=lambda s: "x".join(map(str, s[:-1])) + ("c" if s[-1] else ""))
def test_flash_attention_edge_shapes(monkeypatch: pytest.MonkeyPatch, shape) -> None:
    """The kernels (Triton's interpreter) against the float64 softmax: out, lse, and the gradients of a random
    linear function of both."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from funcshard.ops.triton import flash_attention, uses_triton

    b, hq, hkv, sq, sk, d, causal = shape
    q, k, v = _rand(b, hq, sq, d, seed=1), _rand(b, hkv, sk, d, seed=2), _rand(b, hkv, sk, d, seed=3)
    assert uses_triton(q)
    ro, rl = _rand(b, hq, sq, d, seed=4, dtype=torch.float64), _rand(b, hq, sq, seed=5, dtype=torch.float64)
    results = []
    for fn, dt in ((flash_attention, torch.float32), (_softmax_attention, torch.float64)):
        args = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(*args, causal=causal, **({"return_lse": True} if fn is flash_attention else {}))
        loss = (out.double() * ro).sum() + (lse.double() * rl).sum()
        results.append([out, lse, *torch.autograd.grad(loss, args)])
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv"], *results):
        assert g.dtype == torch.float32, (name, g.dtype)
        torch.testing.assert_close(g.double(), w.detach(), rtol=1e-4, atol=1e-5, msg=name)
