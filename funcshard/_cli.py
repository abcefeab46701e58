"""Command-line plumbing shared by the jobs: ``--mesh`` parsing, one-line errors, exit codes.

Every job turns bad input into ONE line ``error: ...`` on stderr and exit code 2 (no traceback): argparse's
own complaints, :class:`UsageError` (raised by the jobs for input they cannot use), and the library's
``MeshError`` / ``ShardingError`` / ``CheckpointError``, whose messages already say what to change.

Example:
    >>> parse_mesh("dp=2,tp=4")
    {'dp': 2, 'tp': 4}
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from ._errors import MeshError, ShardingError
from .checkpoint import CheckpointError

__all__ = ["ArgumentParser", "UsageError", "generate_parser", "parse_mesh", "run", "train_parser"]


class UsageError(ValueError):
    """Input a job cannot use (a path with no text, a missing checkpoint, a bad flag value)."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``.

    Raises:
        MeshError: text that is not ``name=size`` pairs separated by commas.

    Example:
        >>> parse_mesh("dp=2,tp=4")
        {'dp': 2, 'tp': 4}
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(f"--mesh {text!r}: write axis=size pairs separated by commas, e.g. --mesh dp=2,tp=2.")
        if name.strip() in out:
            raise MeshError(f"--mesh {text!r}: axis '{name.strip()}' appears twice.")
        out[name.strip()] = int(size)
    return out


class _ArgError(Exception):
    pass


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors become one ``error: ...`` line (see :func:`run`)."""

    def error(self, message: str) -> NoReturn:
        raise _ArgError(f"{self.prog}: {message} (see {self.prog} --help)")


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, found {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
positive_int.__doc__ = "An argparse type: an int >= 1."
nonneg_int = _int_at_least(0, "an integer >= 0")
nonneg_int.__doc__ = "An argparse type: an int >= 0."


def train_parser() -> ArgumentParser:
    """The options of ``python -m funcshard train``; the defaults train a ~3M-parameter byte-level Llama."""
    ap = ArgumentParser(
        prog="funcshard train",
        description="Train a byte-level Llama on a real text corpus (by default the Python standard library's "
        "own .py files) over a mesh of dp / fsdp / tp / cp axes: simulated in this process, or one device per process "
        "under torchrun.",
    )
    g = ap.add_argument_group("mesh")
    g.add_argument("--mesh", default="dp=2,tp=2", help="axis=size pairs over dp, fsdp, tp (default dp=2,tp=2)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism over tp (activations split by sequence)")
    g.add_argument("--no-check-vma", dest="check_vma", action="store_false", help="turn varying-axes tracking off")
    g.add_argument("--threads", type=nonneg_int, default=0, help="torch threads per process (0: cores / processes)")
    g = ap.add_argument_group("model")
    g.add_argument("--dim", type=positive_int, default=256)
    g.add_argument("--layers", type=positive_int, default=4)
    g.add_argument("--heads", type=positive_int, default=8)
    g.add_argument("--kv-heads", type=positive_int, default=4)
    g.add_argument("--ffn", type=positive_int, default=704, help="SwiGLU hidden size")
    g.add_argument("--seq", type=positive_int, default=128, help="tokens (bytes) per sequence")
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=200, help="total optimiser steps (the schedule's length)")
    g.add_argument("--batch", type=positive_int, default=16, help="global batch, in sequences")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--final-lr", type=float, default=None, help="learning rate at the last step (default lr/10)")
    g.add_argument("--warmup", type=nonneg_int, default=None, help="warmup steps (default min(20, steps/10))")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    g.add_argument("--seed", type=nonneg_int, default=0, help="seeds the init and the batches")
    g.add_argument("--stop-after", type=positive_int, default=None, help="stop (with a checkpoint) after N steps")
    g = ap.add_argument_group("data")
    g.add_argument("--data", default=None, help="a text file or folder of text files (default: the stdlib)")
    g.add_argument("--max-bytes", type=positive_int, default=8_000_000, help="read at most this much text")
    g.add_argument("--eval-every", type=positive_int, default=25, help="validation loss every N steps")
    g.add_argument("--eval-batches", type=positive_int, default=4, help="fixed held-out batches per evaluation")
    g = ap.add_argument_group("output")
    g.add_argument("--ckpt-dir", default="runs/llama/ckpt", help="checkpoints (one subfolder per step, last 2 kept)")
    g.add_argument("--ckpt-every", type=positive_int, default=100)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    g.add_argument("--out", default="runs/llama", help="where the loss curve (PNG) and metrics (CSV) go")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=0.5,
        help="assumed peak TFLOP/s of all the hardware running the mesh, for the MFU estimate (0.5: a few CPU cores)",
    )
    return ap


def generate_parser() -> ArgumentParser:
    """The options of ``python -m funcshard generate``."""
    ap = ArgumentParser(prog="funcshard generate", description="Sample text from a trained checkpoint.")
    ap.add_argument("--ckpt-dir", default="runs/llama/ckpt", help="the --ckpt-dir of a train run")
    ap.add_argument("--prompt", default="def ", help="text to continue")
    ap.add_argument("--tokens", type=positive_int, default=200, help="bytes to generate")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    return ap


def run(parser: ArgumentParser, job: Callable[[argparse.Namespace], object], argv: list[str] | None) -> int:
    """Parse ``argv`` and run ``job``; exit code 0, or 2 with one ``error: ...`` line on bad input."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _ArgError as e:
        return _fail(str(e))
    try:
        job(args)
    except (UsageError, MeshError, ShardingError, CheckpointError) as e:
        return _fail(str(e))
    finally:
        if "RANK" in os.environ:  # under torchrun: leave the process group cleanly
            from ._backend import dist as dist_backend

            dist_backend.shutdown()
    return 0


def _fail(message: str) -> int:
    line = " ".join(message.split())  # one line, whatever the message holds
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank fails alike: say it once
        print(f"error: {line}", file=sys.stderr)
    return 2
