"""The train job's tiny problem: a tiny model's flags and a small corpus of Python-like text files."""

from __future__ import annotations

from pathlib import Path

TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq", "32", "--batch", "4"]


def _write_corpus(d: Path, n_files: int = 24) -> Path:
    """A small folder of Python-like text files (enough for a train and a held-out split)."""
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines = [f"def function_{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n" for j in range(12)]
        (d / f"mod_{i:02d}.py").write_text("".join(lines))
    (d / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    return d


def _args(tmp: Path, data: Path, *extra: str) -> list[str]:
    return [*TINY, "--data", str(data), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"), *extra]
