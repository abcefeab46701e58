"""What the train job checks before its first step: numbers, folders, and whether one step fits the machine.

Everything here runs before the corpus is read and before any tensor is allocated, so bad input costs a
second and gives one ``error: ...`` line (a :class:`~funcshard.job.cli.UsageError`), never a traceback after
minutes of training:

- float options are finite and in range (``--lr inf`` / ``nan`` / ``-1``);
- ``--ckpt-dir`` does not hold an earlier run's checkpoints unless ``--resume`` or ``--overwrite`` says what to
  do with them (nothing an earlier run wrote is deleted without ``--overwrite``);
- ``--out`` and ``--ckpt-dir`` are folders this process can write to (probed with a file, which also finds a
  read-only filesystem, where permission bits say nothing for root);
- one training step fits in memory and in time: an estimate of its activations, logits, parameters and AdamW
  state against the memory available, and of its FLOPs against ``--peak-tflops``.

Example:
    >>> from funcshard.models import llama
    >>> cfg = llama.Config(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704, max_seq_len=128)
    >>> human_bytes(step_memory(cfg, batch=16, seq=128, eval_batches=4, tp=2))
    '779 MB'
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from funcshard.checkpoint import list_steps
from funcshard.models import llama

from .cli import UsageError, finite_positive, parse_mesh

__all__ = [
    "MAX_STEP_SECONDS",
    "available_memory",
    "check_ckpt_dir",
    "check_numbers",
    "check_step_size",
    "check_writable",
    "human_bytes",
    "step_memory",
]

MAX_STEP_SECONDS = 3600.0  # a step estimated to take longer than this at --peak-tflops is refused
_OURS = re.compile(r"step_\d+(\.old|\.tmp-\w+|\.trash-\w+)?|config\.json")  # what train writes into --ckpt-dir


def check_numbers(args: argparse.Namespace) -> None:
    """Float options finite and in range: ``--lr``, ``--clip``, ``--peak-tflops`` > 0; ``--final-lr``,
    ``--weight-decay`` >= 0.

    Raises:
        UsageError: naming the flag and the value.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> check_numbers(train_parser().parse_args(["--lr", "inf"]))
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --lr must be a finite number > 0, found inf.
    """
    finite_positive("--lr", args.lr)
    if args.final_lr is not None:
        finite_positive("--final-lr", args.final_lr, zero=True)
    finite_positive("--weight-decay", args.weight_decay, zero=True)
    finite_positive("--clip", args.clip)
    finite_positive("--peak-tflops", args.peak_tflops)
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --ckpt-dir and --overwrite deletes it; pass one of them.")


def check_ckpt_dir(ckpt_dir: Path, *, resume: bool, overwrite: bool) -> list[int]:
    """The steps saved in ``ckpt_dir``, after checking that the run may start there.

    Without ``--resume`` or ``--overwrite``, a folder holding anything but an old ``config.json`` is refused:
    re-running a command from the shell history must not wipe the run it started. ``--overwrite`` may delete
    only what train wrote (``step_N`` checkpoints and ``config.json``).

    Raises:
        UsageError: saying what is there and which flag to pass.

    Example:
        >>> import tempfile
        >>> check_ckpt_dir(Path(tempfile.mkdtemp()), resume=False, overwrite=False)
        []
    """
    saved = list_steps(ckpt_dir)
    if resume:
        if not saved:
            raise UsageError(f"--resume: no checkpoint in '{ckpt_dir}'; drop --resume to start, or fix --ckpt-dir.")
        return saved
    entries = sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
    entries = [n for n in entries if n != "config.json"]
    if not entries:
        return saved
    if overwrite:
        foreign = [n for n in entries if not _OURS.fullmatch(n)]
        if foreign:
            raise UsageError(
                f"--overwrite: --ckpt-dir '{ckpt_dir}' also holds '{foreign[0]}' ({len(foreign)} entries train did "
                f"not write); train deletes only its own checkpoints, so choose an empty or new --ckpt-dir."
            )
        return saved
    if saved:
        steps = ", ".join(map(str, saved))
        what = f"{len(saved)} checkpoint(s) of an earlier run (step {steps})"
    else:
        what = f"{len(entries)} entries (e.g. '{entries[0]}')"
    raise UsageError(
        f"--ckpt-dir '{ckpt_dir}' already holds {what}; pass --resume to continue that run, --overwrite to delete "
        f"its checkpoints and start afresh, or choose another --ckpt-dir."
    )


def check_writable(flag: str, folder: Path) -> None:
    """Create ``folder`` if needed and write (then remove) a probe file in it.

    Raises:
        UsageError: ``flag``, the folder and the OS's reason (permission denied, read-only file system, ...).

    Example:
        >>> check_writable("--out", Path("/proc/funcshard"))
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --out '/proc/funcshard' is not writable (No such file or directory); ...
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".funcshard-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(
            f"{flag} '{folder}' is not writable ({e.strerror or e}); choose a folder you can write to."
        ) from None


def step_memory(cfg: llama.Config, *, batch: int, seq: int, eval_batches: int, tp: int = 1) -> int:
    """Bytes one training step of the whole mesh holds at its peak, all devices together (an estimate that errs
    low, so that it refuses only what cannot fit).

    Per token and layer, ``24 dim tp + 10 (ffn + dim)`` fp32 values: what stays replicated over ``tp`` (the
    residual stream, norms, vma-tracked copies) is held once per ``tp`` device, the rest is split. Per token
    also ``6 vocab`` values for the logits. These are three quarters of what the sim train step was measured
    to hold over three model shapes (``dim`` 128 to 512, ``tp`` 2 and 4). Add the int64 batch windows
    (training and validation) and parameters, gradients and the two AdamW moments.

    Example:
        >>> cfg = llama.Config(vocab_size=256, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=8)
        >>> step_memory(cfg, batch=2, seq=8, eval_batches=1) > 0
        True
    """
    d, f, layers, v = cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    per_token = 4 * (layers * (24 * d * tp + 10 * (f + d)) + 6 * v)
    windows = 8 * (seq + 1) * batch * (3 + 2 * eval_batches)
    state = 4 * 4 * cfg.num_params()
    return batch * seq * per_token + windows + state


def available_memory() -> int | None:
    """Bytes of memory available to new allocations on this machine (``MemAvailable``), or None if unknown.

    Example:
        >>> (available_memory() or 1) > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def human_bytes(n: float) -> str:
    """``1.3 PB``, ``260 MB``: a byte count in decimal units, two or three significant digits.

    Example:
        >>> human_bytes(26e9), human_bytes(512)
        ('26 GB', '512 B')
    """
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.2g} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


def _duration(s: float) -> str:
    if s < 2 * 3600:
        return f"{s / 60:.0f} minutes"
    if s < 2 * 86400:
        return f"{s / 3600:.0f} hours"
    return f"{s / 86400:.2g} days"


def check_step_size(args: argparse.Namespace, cfg: llama.Config) -> None:
    """Refuse a step that cannot fit this machine's memory, or would take over an hour at ``--peak-tflops``.

    Under torchrun the processes on this machine hold their share of the mesh's memory
    (``LOCAL_WORLD_SIZE / WORLD_SIZE``); simulated, this process holds all of it.

    Raises:
        UsageError: with the estimate, what it is measured against, and which flags to lower.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> args = train_parser().parse_args(["--batch", "100000000"])
        >>> cfg = llama.Config(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
        ...                    max_seq_len=128)
        >>> check_step_size(args, cfg)
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --batch 100000000 x --seq 128: one training step needs about ... PB of memory ...
    """
    flags = f"--batch {args.batch} x --seq {args.seq}"
    tp = parse_mesh(args.mesh).get("tp", 1)
    need = step_memory(cfg, batch=args.batch, seq=args.seq, eval_batches=args.eval_batches, tp=tp)
    world = int(os.environ.get("WORLD_SIZE", "0")) or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
    here = need * min(local, world) / world if "RANK" in os.environ else need
    have = available_memory()
    if have is not None and here > have:
        share = f" ({human_bytes(here)} on this machine)" if here != need else ""
        raise UsageError(
            f"{flags}: one training step needs about {human_bytes(need)} of memory{share} (activations, logits, "
            f"parameters and AdamW state), more than the {human_bytes(have)} available; lower --batch or --seq."
        )
    flops = cfg.flops_per_token(args.seq) * args.batch * args.seq
    seconds = flops / (args.peak_tflops * 1e12)
    if seconds > MAX_STEP_SECONDS:
        raise UsageError(
            f"{flags}: one training step is about {flops:.2g} FLOP, {_duration(seconds)} even at the assumed peak "
            f"of {args.peak_tflops:g} TFLOP/s (--peak-tflops); lower --seq or --batch, or raise --peak-tflops if "
            f"the hardware is faster."
        )
