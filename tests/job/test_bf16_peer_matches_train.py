"""The peer oracle of issue #10's bf16 curve (``bench/precision_peer.py``) is the train job's problem, in torch.

Its float32 twin run must retrace the train job's float32 run (same init, batches, clipping, AdamW and schedule:
only the summation order differs), and its bf16 arithmetic must be torch's bfloat16 arithmetic (the emulated
matmul agrees with torch's own bfloat16 ``F.linear`` where both round once from float32 accumulation).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import precision_peer as peer

from funcshard.job import train

pytestmark = pytest.mark.oracle

SMALL = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq", "16"]
SMALL += ["--batch", "8", "--steps", "6", "--warmup", "2", "--eval-every", "3", "--max-bytes", "200000"]


def _column(path: Path, name: str) -> dict[int, float]:
    with open(path) as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r[name]}


def test_twin_fp32_retraces_the_train_job(tmp_path: Path) -> None:
    job = tmp_path / "job"
    assert train.main([*SMALL, "--out", str(job), "--ckpt-dir", str(job / "ckpt")]) == 0
    peer.train_twin("fp32", str(tmp_path), SMALL, threads=1)
    for name in ("train_loss", "val_loss"):
        ref, got = _column(job / "metrics.csv", name), _column(tmp_path / "twin_fp32" / "metrics.csv", name)
        assert sorted(ref) == sorted(got) and len(ref) >= 3
        for s in ref:  # float32, another summation order: far below the bf16 gap (~1e-2)
            assert abs(got[s] - ref[s]) <= 2e-4 * ref[s], (name, s, got[s], ref[s])


def test_emulated_bf16_is_torchs_bf16() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=g), torch.randn(48, 96, generator=g)
    native = F.linear(x.bfloat16(), w.bfloat16())
    with peer.EmulatedBf16():
        emulated = F.linear(x.bfloat16(), w.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = F.linear(x, w)
    assert emulated.dtype == auto.dtype == torch.bfloat16
    assert torch.equal(auto, emulated)  # autocast rounds the operands to bfloat16 as well
    assert (emulated != native).float().mean() < 1e-2  # a rounding flip where float32 sums differ in order
    torch.testing.assert_close(emulated.float(), native.float(), rtol=1e-2, atol=1e-2)
    assert not torch.equal(emulated, F.linear(x, w).bfloat16())  # the operands were rounded: not the float32 matmul

    table = torch.randn(16, 8, generator=g)
    ids = torch.randint(0, 4, (4096,), generator=g)
    t = table.bfloat16().requires_grad_()
    with peer.EmulatedBf16():
        out = F.embedding(ids, t)
    assert out.dtype == torch.bfloat16 and torch.equal(out, F.embedding(ids, t.detach()))
    up = torch.randn(4096, 8, generator=g).bfloat16()
    (out.float() * up.float()).sum().backward()
    exact = torch.zeros(16, 8, dtype=torch.float64).index_add_(0, ids, up.double())
    assert ((t.grad.double() - exact).norm() / exact.norm()) < 4e-3  # summed in float32, rounded once
