"""The training corpus as byte-level tokens, its held-out split, and batches drawn by step from a key.

With no ``--data`` the corpus is the Python standard library's own ``.py`` files (every machine with Python
has them; nothing is downloaded): sorted by path, ``site-packages`` and test folders left out, read until
``max_bytes``. ``--data PATH`` takes a text file or a folder of text files instead (binary files, those with
NUL bytes, are skipped). Tokens are the bytes themselves (vocabulary 256).

The split is deterministic: every 20th file is held out for validation (or, with fewer than 20 files, the last
5% of the bytes). Training batches are windows at offsets drawn with ``fs.random`` from ``fold_in(key,
step)``, so the batch of a step depends only on the key and the step: a resumed run sees exactly the batches
the uninterrupted run would have. Validation uses fixed, evenly spaced windows.

Example:
    >>> import funcshard as fs
    >>> corpus = load_corpus(None, max_bytes=200_000, seq=32)
    >>> tokens, targets = train_batch(corpus.train, fs.random.key(0), step=3, batch=4, seq=32)
    >>> tokens.shape, bool((tokens[:, 1:] == targets[:, :-1]).all())
    (torch.Size([4, 32]), True)
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from . import random as fsr
from ._cli import UsageError

__all__ = ["Corpus", "eval_batches", "load_corpus", "train_batch"]

VAL_EVERY = 20  # every 20th file is held out
VAL_FRACTION = 0.05  # or the last 5% of the bytes, with fewer files
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SEP = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    """Byte tokens (``uint8`` tensors) of the training and validation text, and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    n_files: int
    split: str

    def describe(self) -> str:
        return (
            f"{self.source}: {self.n_files} file(s), {len(self.train) / 1e6:.2f} MB train / "
            f"{len(self.val) / 1e6:.2f} MB val ({self.split})"
        )


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS and not x.startswith(".")]
        files.extend(Path(d) / n for n in names if n.endswith(".py"))
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UsageError(f"--data {str(path)!r}: no such file or folder; give a text file or a folder of text files.")
    files = []
    for d, dirs, names in os.walk(path):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        files.extend(Path(d) / n for n in names if not n.startswith("."))
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def _read_text(files: list[Path], max_bytes: int) -> list[bytes]:
    """The contents of the text files among ``files`` (no NUL bytes), in order, ``max_bytes`` in all."""
    out, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        try:
            raw = f.read_bytes()
        except OSError:
            continue
        if not raw.strip() or b"\0" in raw:
            continue
        raw = raw[: max_bytes - total]
        out.append(raw)
        total += len(raw) + len(_SEP)
    return out


def _tensor(chunks: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(_SEP.join(chunks)), dtype=torch.uint8)


def load_corpus(data: str | None, *, max_bytes: int, seq: int) -> Corpus:
    """Read the corpus (``data``: a file or folder; ``None``: the standard library) and split it.

    Raises:
        UsageError: no text at ``data``, or too little for windows of ``seq + 1`` bytes in both splits.
    """
    if data is None:
        root, files = _stdlib_files()
        source = f"Python standard library ({root})"
    else:
        path = Path(data).expanduser()
        files = _data_files(path)
        source = str(path)
    chunks = _read_text(files, max_bytes)
    if not chunks:
        raise UsageError(f"--data {source!r}: found no text there (empty or binary files); give text files.")
    if len(chunks) >= VAL_EVERY:
        val_chunks = chunks[VAL_EVERY - 1 :: VAL_EVERY]
        train_chunks = [c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY - 1]
        train, val = _tensor(train_chunks), _tensor(val_chunks)
        split = f"every {VAL_EVERY}th file held out"
    else:
        allb = _tensor(chunks)
        n_val = max(int(len(allb) * VAL_FRACTION), seq + 1)
        train, val = allb[: len(allb) - n_val], allb[len(allb) - n_val :]
        split = f"last {VAL_FRACTION:.0%} of the bytes held out"
    if len(train) < seq + 1 or len(val) < seq + 1:
        raise UsageError(
            f"--data {source!r}: only {sum(map(len, chunks))} bytes of text, too little for windows of --seq {seq} "
            f"in both the training and validation split; give more text or a smaller --seq."
        )
    return Corpus(train, val, source, len(chunks), split)


def _windows(data: torch.Tensor, offsets: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + torch.arange(seq + 1)  # [b, 1] + [s+1] -> [b, s+1]
    w = data[idx].long()  # [b, s+1] byte tokens
    return w[:, :-1], w[:, 1:]


def train_batch(
    data: torch.Tensor, key: torch.Tensor, *, step: int, batch: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: ``(tokens, targets)``, each ``[batch, seq]`` int64, targets shifted by one.

    The window offsets are ``fs.random.randint(fold_in(key, step), ...)``: a function of ``key`` and ``step``
    only, the same on every process and in a resumed run.
    """
    offsets = fsr.randint(fsr.fold_in(key, step), (batch,), 0, len(data) - seq)  # [b] in [0, n - s)
    return _windows(data, offsets, seq)


def eval_batches(data: torch.Tensor, *, n: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed validation batches: ``n * batch`` windows evenly spaced over ``data``."""
    count = n * batch
    offsets = torch.arange(count) * (len(data) - seq - 1) // max(count - 1, 1)  # [n*b] evenly spaced starts
    tokens, targets = _windows(data, offsets, seq)
    return list(zip(tokens.split(batch), targets.split(batch), strict=True))
