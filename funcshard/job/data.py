"""The training corpus as byte-level tokens, its held-out split, and batches drawn by step from a key.

With no ``--data`` the corpus is the Python standard library's own ``.py`` files (every machine with Python
has them; nothing is downloaded): sorted by path, ``site-packages`` and test folders left out, read until
``max_bytes``. ``--data PATH`` takes a text file or a folder of text files instead (binary files, those with
NUL bytes or that are not UTF-8, are skipped; a single binary file is refused). Files are streamed: memory
holds only the ``max_bytes`` kept, however large the files. Tokens are the bytes themselves (vocabulary 256).

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

import codecs
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from funcshard import random as fsr

from .cli import UsageError

__all__ = ["Corpus", "eval_batches", "load_corpus", "not_text", "train_batch"]

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


_SNIFF = 8192  # bytes looked at to tell text from binary (as git and grep do)
_CONTROL = set(range(32)) - set(b"\t\n\r\f\v\b\x1b") | {0x7F}


def not_text(head: bytes) -> str | None:
    r"""Why the bytes ``head`` (a file's first bytes) are not text, or None when they are.

    Text is NUL-free and UTF-8 (a multi-byte character cut at the end is fine); bytes that are not UTF-8 still
    pass when under 5% of them are control bytes (Latin-1 and other 8-bit text).

    Example:
        >>> not_text("x = 'é'  # UTF-8".encode())
        >>> not_text(b"PK\x03\x04\x14\x00\x00\x00")
        'it has NUL bytes in its first 8 bytes (a binary file?)'
    """
    if b"\0" in head:
        return f"it has NUL bytes in its first {len(head)} bytes (a binary file?)"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        control = sum(b in _CONTROL for b in head)
        if control > 0.05 * len(head):
            return f"it is not UTF-8 and {control / len(head):.0%} of its first {len(head)} bytes are control bytes"
    return None


class _Reader:
    """Reads the text files in order into a buffer sized for what is used: every 20th kept file goes to the
    validation buffer, the rest to the training buffer, each file cut to the bytes still wanted."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.train = bytearray(capacity)
        self.n_train = 0
        self.val = bytearray()
        self.max_bytes = max_bytes
        self.total = 0  # bytes taken, separators included (both splits)
        self.kept = 0
        self.skipped: list[tuple[Path, str]] = []

    def full(self) -> bool:
        return self.total >= self.max_bytes

    def add(self, f: Path) -> None:
        """Read ``f`` (what is still wanted of it) unless it is empty or not text (then note why)."""
        want = self.max_bytes - self.total
        try:
            with open(f, "rb") as fh:
                head = fh.read(min(_SNIFF, want))
                if not head.strip():
                    return
                why = not_text(head)
                if why is not None:
                    self.skipped.append((f, why))
                    return
                to_val = self.kept % VAL_EVERY == VAL_EVERY - 1
                if to_val:
                    self._val(fh, head, want)
                else:
                    self._train(fh, head, want)
        except OSError as e:
            self.skipped.append((f, e.strerror or str(e)))
            return
        self.kept += 1

    def _train(self, fh: BinaryIO, head: bytes, want: int) -> None:
        sep = _SEP if self.n_train else b""
        view = memoryview(self.train)
        pos = self.n_train
        view[pos : pos + len(sep)] = sep
        pos += len(sep)
        view[pos : pos + len(head)] = head
        pos += len(head)
        end = pos + max(0, want - len(head))
        while pos < end:  # straight into the buffer: no copy of the file in memory
            n = fh.readinto(view[pos:end])
            if not n:
                break
            pos += n
        view.release()
        self.total += pos - self.n_train - len(sep) + len(_SEP)
        self.n_train = pos

    def _val(self, fh: BinaryIO, head: bytes, want: int) -> None:
        rest = fh.read(max(0, want - len(head)))
        if self.val:
            self.val += _SEP
        self.val += head
        self.val += rest
        self.total += len(head) + len(rest) + len(_SEP)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        del self.train[self.n_train :]  # in place: what was not used of the buffer goes back
        return _tensor(self.train), _tensor(self.val)


def _tensor(buf: bytearray) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def _read(files: list[Path], max_bytes: int) -> _Reader:
    """Stream the regular files among ``files`` into a :class:`_Reader`, ``max_bytes`` in all."""
    sizes = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):  # no FIFOs or devices: reading them could block or never end
            sizes.append((f, st.st_size))
    capacity = min(max_bytes, sum(n for _, n in sizes)) + len(_SEP) * len(sizes)  # the separators: at most one a file
    reader = _Reader(capacity, max_bytes)
    for f, _ in sizes:
        if reader.full():
            break
        reader.add(f)
    return reader


def load_corpus(data: str | None, *, max_bytes: int, seq: int) -> Corpus:
    """Read the corpus (``data``: a file or folder; ``None``: the standard library) and split it.

    Files are streamed: at most ``max_bytes`` are read in all, whatever the size of the files, and memory holds
    only the bytes kept. Files that are not text (see :func:`not_text`) are skipped in a folder and refused
    when given alone.

    Raises:
        UsageError: no text at ``data`` (a single file that is not text says why), or too little for windows
            of ``seq + 1`` bytes in both splits.
    """
    single = False
    if data is None:
        root, files = _stdlib_files()
        source = f"Python standard library ({root})"
    else:
        path = Path(data).expanduser()
        files = _data_files(path)
        source = str(path)
        single = path.is_file()
    reader = _read(files, max_bytes)
    if single and reader.skipped:
        why = reader.skipped[0][1]
        raise UsageError(f"--data {source!r} is not text: {why}; give a UTF-8 text file or a folder of them.")
    if not reader.kept:
        if reader.skipped:
            (f, why), n = reader.skipped[0], len(reader.skipped)
            found = f"{n} file(s) that are not text (e.g. '{f}': {why}), the rest empty"
        else:
            found = "only empty files"
        raise UsageError(f"--data {source!r}: found no text there, {found}; give UTF-8 text files.")
    n_files, n_bytes = reader.kept, reader.total
    if n_files >= VAL_EVERY:
        train, val = reader.tensors()
        split = f"every {VAL_EVERY}th file held out"
    else:
        allb, _ = reader.tensors()
        n_val = max(int(len(allb) * VAL_FRACTION), seq + 1)
        train, val = allb[: max(len(allb) - n_val, 0)], allb[max(len(allb) - n_val, 0) :]
        split = f"last {VAL_FRACTION:.0%} of the bytes held out"
    if len(train) < seq + 1 or len(val) < seq + 1:
        raise UsageError(
            f"--data {source!r}: only {n_bytes} bytes of text, too little for windows of --seq {seq} "
            f"in both the training and validation split; give more text or a smaller --seq."
        )
    return Corpus(train, val, source, n_files, split)


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
