"""``funcshard.ops.moe.grouped.grouped_swiglu`` (the SwiGLU experts in one autograd Function) and
``funcshard.ops.moe.grouped.swiglu_combine`` (with the gather and the weighted combine): every implementation
against a per-expert loop of ``F.linear`` (forward, and the gradients of ``x`` and of the three weights), with empty
experts, rows past the counts, skewed counts, no rows at all, the CPU path cut into blocks of whole experts (a
``[rows, f]`` of more than 4 MiB), a frozen part, ``torch.func.grad``, ``no_grad`` and bfloat16.

``TRITON_INTERPRET=1`` is set (autouse) for the Triton cases, as in ``test_moe_grouped_mm.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard.ops.moe.grouped import grouped_swiglu, swiglu_combine

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'triton>=3.0')")
IMPLS = ["torch", "segments", pytest.param("triton", marks=needs_triton)]


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _loop(x, w1, w3, w2, counts):
    """The reference: per expert, ``F.linear`` of its rows through gate, up and down; zeros after the counts."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        h = x[start : start + c]
        out.append(F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e]))
        start += c
    out.append(x.new_zeros(x.shape[0] - start, w2.shape[1]))
    return torch.cat(out)


# (rows, d, f, counts): an empty expert first, in the middle and last; rows past the counts; every row to one expert
# (skewed); no rows at all; and two cut into blocks on CPU (rows x f x 4 B > 4 MiB): balanced, and skewed with
# empty experts and a block of one expert larger than the block size
CASES = {
    "mixed": (37, 16, 32, [10, 0, 20, 7]),
    "empty_ends": (40, 16, 48, [0, 0, 33, 0]),
    "tail_rows": (30, 32, 16, [3, 9, 0, 11]),
    "skewed": (50, 16, 32, [0, 48, 1, 1]),
    "no_rows": (0, 16, 32, [0, 0]),
    "blocks": (36000, 16, 64, [4500] * 8),
    "blocks_skewed": (36010, 16, 64, [0, 30000, 0, 3000, 3000, 0]),
}


def _weights(e, d, f, dtype=torch.float32):
    return [
        (_rand(e, f, d, seed=2, dtype=dtype) * 0.3).requires_grad_(),
        (_rand(e, f, d, seed=3, dtype=dtype) * 0.3).requires_grad_(),
        (_rand(e, d, f, seed=4, dtype=dtype) * 0.3).requires_grad_(),
    ]


def _check(name, impl, dtype=torch.float32, rtol=1e-5, atol=1e-5):
    t, d, f, counts = CASES[name]
    counts = torch.tensor(counts)
    x = _rand(t, d, seed=1, dtype=dtype).requires_grad_()
    ws = _weights(len(counts), d, f, dtype)
    g = _rand(t, d, seed=5, dtype=dtype)
    ref = _loop(x, *ws, counts)
    rgrads = torch.autograd.grad(ref, (x, *ws), g)
    y = grouped_swiglu(x, *ws, counts, impl=impl)
    assert y.dtype == dtype and y.shape == (t, d)
    grads = torch.autograd.grad(y, (x, *ws), g)
    for a, b in zip((y, *grads), (ref, *rgrads)):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("blocks")])
def test_grouped_swiglu_matches_loop(name: str, impl) -> None:
    _check(name, impl)


@pytest.mark.parametrize("name", ["blocks", "blocks_skewed"])
def test_grouped_swiglu_in_blocks_matches_loop(name: str) -> None:
    """Large enough that the CPU path runs in blocks of whole experts (atol: sums over thousands of rows)."""
    _check(name, "torch", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_swiglu_bf16(impl) -> None:
    _check("mixed", impl, dtype=torch.bfloat16, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("frozen", ["x", "weights", "w2"])
def test_grouped_swiglu_gradient_of_a_part(frozen: str) -> None:
    """Gradients for a part of the operands (the others frozen), a sum's cotangent (an expanded view)."""
    t, d, f, counts = CASES["mixed"]
    counts = torch.tensor(counts)
    x = _rand(t, d, seed=1).requires_grad_(frozen != "x")
    ws = _weights(len(counts), d, f)
    if frozen == "weights":
        ws = [w.detach() for w in ws]
    if frozen == "w2":
        ws[2] = ws[2].detach()
    want = [a for a in (x, *ws) if a.requires_grad]
    grads = torch.autograd.grad(grouped_swiglu(x, *ws, counts, impl="torch").sum(), want)
    rgrads = torch.autograd.grad(_loop(x, *ws, counts).sum(), want)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mixed", "blocks_skewed"])
def test_grouped_swiglu_no_grad_and_torch_func(name: str) -> None:
    """Under ``no_grad`` (nothing kept for a backward) and under ``torch.func.grad`` (the weights' gradient)."""
    t, d, f, counts = CASES[name]
    counts = torch.tensor(counts)
    x, ws = _rand(t, d, seed=1), [w.detach() for w in _weights(len(counts), d, f)]
    with torch.no_grad():
        torch.testing.assert_close(grouped_swiglu(x, *ws, counts), _loop(x, *ws, counts), rtol=1e-5, atol=1e-5)
    g = torch.func.grad(lambda w1: grouped_swiglu(x, w1, *ws[1:], counts).square().sum())(ws[0])
    rg = torch.func.grad(lambda w1: _loop(x, w1, *ws[1:], counts).square().sum())(ws[0])
    torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-3)


def test_grouped_swiglu_errors() -> None:
    x, counts = torch.zeros(4, 16), torch.tensor([2, 2])
    w1, w2 = torch.zeros(2, 32, 16), torch.zeros(2, 16, 32)
    with pytest.raises(fs.ShardingError, match=r"w2 \(2, 32, 16\)"):
        grouped_swiglu(x, w1, w1, w1, counts)
    with pytest.raises(fs.ShardingError, match=r"w3 \(2, 16, 16\)"):
        grouped_swiglu(x, w1, torch.zeros(2, 16, 16), w2, counts)
    with pytest.raises(fs.ShardingError, match="integer counts"):
        grouped_swiglu(x, w1, w1, w2, torch.tensor([2.0, 2.0]))
    with pytest.raises(fs.ConfigError, match="impl must be one of"):
        grouped_swiglu(x, w1, w1, w2, counts, impl="cutlass")


# --- swiglu_combine: the gather, the experts and the weighted combine in one Function -------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["mixed", "skewed", "no_rows", "blocks_skewed"])
def test_swiglu_combine_matches_gather_loop_index_add(name: str, impl) -> None:
    """Against gather, the per-expert loop and ``index_add`` of the weighted rows: the output and the gradients of
    the tokens, the row weights and the three weights (tokens repeated: top-2 rows of the same token)."""
    if name == "blocks_skewed" and impl != "torch":
        pytest.skip("the blocked path once (the interpreter is slow; segments is the unfused composition)")
    _, d, f, counts = CASES[name]
    counts = torch.tensor(counts)
    rows = int(counts.sum())
    n_tokens = max(rows // 2, 1)
    tokens = torch.randperm(rows, generator=torch.Generator().manual_seed(6)) % n_tokens  # [A], each token twice
    x = _rand(n_tokens, d, seed=1).requires_grad_()
    rw = torch.rand(rows, generator=torch.Generator().manual_seed(7)).requires_grad_()
    ws = _weights(len(counts), d, f)
    g = _rand(n_tokens, d, seed=8)
    ref = x.new_zeros(n_tokens, d).index_add(0, tokens, _loop(x[tokens], *ws, counts) * rw[:, None])
    rgrads = torch.autograd.grad(ref, (x, rw, *ws), g)
    y = swiglu_combine(x, tokens, rw, *ws, counts, impl=impl)
    grads = torch.autograd.grad(y, (x, rw, *ws), g)
    tol = 1e-4 if name.startswith("blocks") else 1e-5
    for a, b in zip((y, *grads), (ref, *rgrads)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(swiglu_combine(x, tokens, rw, *ws, counts, impl=impl), ref, rtol=tol, atol=tol)


def test_swiglu_combine_errors() -> None:
    x, counts, w1, w2 = torch.zeros(3, 16), torch.tensor([2, 2]), torch.zeros(2, 32, 16), torch.zeros(2, 16, 32)
    with pytest.raises(fs.ShardingError, match="one token and one weight per row"):
        swiglu_combine(x, torch.tensor([0, 1, 2]), torch.ones(3), w1, w1, w2, counts)
    with pytest.raises(fs.ShardingError, match=r"row_weights \(3,\)"):
        swiglu_combine(x, torch.tensor([0, 1, 2, 0]), torch.ones(3), w1, w1, w2, counts)
    with pytest.raises(fs.ShardingError, match=r"w2 \(2, 32, 16\)"):
        swiglu_combine(x, torch.tensor([0, 1, 2, 0]), torch.ones(4), w1, w1, w1, counts)
