"""``funcshard.ops.moe.grouped_mm``: every implementation (``torch._grouped_mm``, one matmul per segment, the Triton
grouped GEMM run by Triton's interpreter) against a per-expert loop, forward and backward (``x`` and ``w``), with
empty segments, rows past the counts, and the errors.

``TRITON_INTERPRET=1`` is set by tests/conftest.py before Triton's first import and again here (autouse) for the
Triton cases; ``impl="auto"`` never picks the interpreter on CPU. Small shapes with partial blocks (the
interpreter's blocks are 16 x 32 x 16).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import funcshard as fs
from funcshard.ops import moe

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'triton>=3.0')")


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _loop(x, w, counts):
    """The reference: one ``x_e @ w[e]^T`` per expert, zeros after the counts."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        out.append(x[start : start + c] @ w[e].T)
        start += c
    out.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    return torch.cat(out)


# (rows, in, out, counts): empty segments first, last and in the middle; a segment spanning several row blocks;
# rows past the counts; sizes that leave partial blocks; one with in / out not 16-byte rows (no torch._grouped_mm)
CASES = {
    "mixed": (37, 32, 48, [10, 0, 20, 7]),
    "empty_ends": (40, 16, 20, [0, 0, 33, 0]),
    "all_empty": (5, 16, 16, [0, 0, 0]),
    "tail_rows": (30, 16, 24, [3, 9, 0, 11]),
    "one_expert": (50, 48, 16, [50]),
    "unaligned": (21, 6, 10, [4, 0, 17]),
}
IMPLS = ["torch", "segments", pytest.param("triton", marks=needs_triton)]


def _check(name, impl, dtype=torch.float32, rtol=1e-5, atol=1e-5):
    t, d, f, counts = CASES[name]
    counts = torch.tensor(counts)
    x = _rand(t, d, seed=1, dtype=dtype).requires_grad_()
    w = _rand(len(counts), f, d, seed=2, dtype=dtype).requires_grad_()
    g = _rand(t, f, seed=3, dtype=dtype)
    ref = _loop(x, w, counts)
    rdx, rdw = torch.autograd.grad(ref, (x, w), g)
    y = moe.grouped_mm(x, w, counts, impl=impl)
    assert y.dtype == dtype and y.shape == (t, f)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    for a, b in ((y, ref), (dx, rdx), (dw, rdw)):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_grouped_mm_matches_loop(name: str, impl) -> None:
    if impl == "torch" and name == "unaligned":
        with pytest.raises(fs.ConfigError, match="16 bytes"):
            _check(name, impl)
        return
    _check(name, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_mm_bf16(impl) -> None:
    _check("mixed", impl, dtype=torch.bfloat16, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_mm_sum_cotangent_and_x_only(impl) -> None:
    """A sum's cotangent (an expanded view) and a gradient for x alone (w frozen)."""
    x = _rand(12, 16, seed=4).requires_grad_()
    w = _rand(3, 16, 16, seed=5)
    counts = torch.tensor([5, 0, 7])
    (dx,) = torch.autograd.grad(moe.grouped_mm(x, w, counts, impl=impl).sum(), (x,))
    (rdx,) = torch.autograd.grad(_loop(x, w, counts).sum(), (x,))
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_mm_under_torch_func_grad(impl) -> None:
    x, w, counts = _rand(9, 16, seed=6), _rand(2, 16, 16, seed=7), torch.tensor([4, 5])
    g = torch.func.grad(lambda w: moe.grouped_mm(x, w, counts, impl=impl).square().sum())(w)
    rg = torch.func.grad(lambda w: _loop(x, w, counts).square().sum())(w)
    torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)


def test_auto_picks_torch_or_segments_on_cpu() -> None:
    assert moe.pick_impl(torch.zeros(4, 16), torch.zeros(2, 8, 16)) == "torch"  # never the interpreter on CPU
    assert moe.pick_impl(torch.zeros(4, 6), torch.zeros(2, 8, 6)) == "segments"
    assert moe.pick_impl(torch.zeros(4, 16), torch.zeros(2, 6, 16)) == "segments"  # out rows of 24 bytes
    assert moe.pick_impl(torch.zeros(4, 16, dtype=torch.float64), torch.zeros(2, 8, 16, dtype=torch.float64)) == (
        "segments"
    )


def test_triton_needs_a_device_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(fs.ConfigError, match="TRITON_INTERPRET=1"):
        moe.grouped_mm(torch.zeros(4, 16), torch.zeros(2, 8, 16), torch.tensor([2, 2]), impl="triton")


def test_grouped_mm_errors() -> None:
    x, w, counts = torch.zeros(4, 16), torch.zeros(2, 8, 16), torch.tensor([2, 2])
    with pytest.raises(fs.ShardingError, match=r"x \(4, 16\), w \(2, 8, 12\)"):
        moe.grouped_mm(x, torch.zeros(2, 8, 12), counts)
    with pytest.raises(fs.ShardingError, match="integer counts"):
        moe.grouped_mm(x, w, torch.tensor([2.0, 2.0]))
    with pytest.raises(fs.ShardingError, match=r"counts \(3,\)"):
        moe.grouped_mm(x, w, torch.tensor([1, 1, 2]))
    with pytest.raises(fs.ShardingError, match="dtype"):
        moe.grouped_mm(x, w.double(), counts)
    with pytest.raises(fs.ShardingError, match="more than x's 4"):
        moe.grouped_mm(x, w, torch.tensor([3, 3]), impl="segments")
    with pytest.raises(fs.ConfigError, match="impl must be one of"):
        moe.grouped_mm(x, w, counts, impl="cutlass")


@needs_triton
def test_moe_ffn_through_the_triton_kernels() -> None:
    """The layer with ``impl="triton"`` (the interpreter) equals ``impl="segments"``, output and gradients."""
    e, d, f = 4, 16, 32
    p = {"router": _rand(e, d, seed=10), "w1": _rand(e, f, d, seed=11) * 0.3, "w3": _rand(e, f, d, seed=12) * 0.3,
         "w2": _rand(e, d, f, seed=13) * 0.3}  # fmt: skip
    x = _rand(3, 7, d, seed=14)

    def run(impl):
        xx, pp = x.clone().requires_grad_(), {n: t.clone().requires_grad_() for n, t in p.items()}
        y = moe.moe_ffn(xx, pp, 2, axis=None, impl=impl)
        return y, torch.autograd.grad(y.square().sum(), [xx, *pp.values()])

    (y, gs), (ry, rgs) = run("triton"), run("segments")
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    for g, rg in zip(gs, rgs):
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-5)
