"""What the train job checks before its first step: numbers, folders, and whether one step fits the machine.

Everything here runs before the corpus is read and before any tensor is allocated, so bad input costs a
second and gives one ``error: ...`` line (a :class:`~funcshard.job.cli.UsageError`), never a traceback after
minutes of training:

- float options are finite and in range (``--lr inf`` / ``nan`` / ``-1``), and ``--seq`` gives every device of
  the sequence axes (``cp``, and ``tp`` with ``--sp``) at least one position;
- ``--ckpt-dir`` does not hold an earlier run's checkpoints unless ``--resume`` or ``--overwrite`` says what to
  do with them (nothing an earlier run wrote is deleted without ``--overwrite``); ``--resume`` on a folder with
  no checkpoint starts afresh (so ``torchrun --max-restarts N ... train --resume`` is one command for every try);
- ``--out`` and ``--ckpt-dir`` are folders this process can write to (probed with a file, which also finds a
  read-only filesystem, where permission bits say nothing for root);
- one training step fits in memory and in time: its ``memory_analysis()`` (the step lowered on the abstract twin
  of the mesh, nothing allocated) per device against the device's memory, and its FLOPs against
  ``--peak-tflops``.

Example:
    >>> from funcshard.job.cli import train_parser
    >>> check_numbers(train_parser().parse_args(["--lr", "3e-4"]))
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path

import funcshard as fs
from funcshard.checkpoint import list_steps
from funcshard.models import llama

from . import bridge
from .cli import UsageError, finite_positive, parse_mesh
from .machine import available_memory, device_memory, human_bytes
from .plan.estimate import PARTS, advice, lowered_step

__all__ = [
    "MAX_STEP_SECONDS",
    "available_memory",
    "check_ckpt_dir",
    "check_mesh_sizes",
    "check_numbers",
    "check_shared_ckpt_dir",
    "check_step_size",
    "check_writable",
    "human_bytes",
    "node_order",
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


def check_mesh_sizes(args: argparse.Namespace) -> None:
    """``--seq`` splits over the sequence axes of ``--mesh``: ``cp`` (and ``tp`` too with ``--sp``), checked before
    the corpus is read. A length those axes do not divide is split unevenly (``torch.tensor_split``'s layout: the
    first devices one position more; under ``cp`` each device's part cut in two zigzag chunks), but every device
    needs at least one position.

    Raises:
        UsageError: naming ``--seq``, the axes and the shortest length that works.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> check_mesh_sizes(train_parser().parse_args(["--mesh", "cp=2", "--seq", "63"]))  # 32 + 31 positions
        >>> check_mesh_sizes(train_parser().parse_args(["--mesh", "cp=4", "--seq", "3"]))
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --seq 3 is shorter than cp=4 (--mesh cp=4): ...
    """
    shape = parse_mesh(args.mesh)
    axes = {"cp": shape.get("cp", 1)}
    if args.sp:
        axes["tp"] = shape.get("tp", 1)
    n = math.prod(axes.values())
    if args.seq < n:
        split = " x ".join(f"{a}={s}" for a, s in axes.items() if s > 1)
        raise UsageError(
            f"--seq {args.seq} is shorter than {split} (--mesh {args.mesh}{' --sp' if args.sp else ''}): every "
            f"device holds at least one position of each sequence; use --seq {n} or more."
        )


def node_order(shape: dict[str, int]) -> dict[str, int]:
    """``--mesh`` with ``cp`` and ``tp`` moved last when the job spans several nodes (``WORLD_SIZE`` above
    ``LOCAL_WORLD_SIZE``): the innermost axes stay inside a node, and those two run collectives every layer.
    On one node, the order given.

    Example:
        >>> node_order({"tp": 2, "dp": 2})  # one node (no torchrun here): as given
        {'tp': 2, 'dp': 2}
    """
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not local or local >= world:
        return shape
    inner = ("cp", "tp")
    return {**{a: s for a, s in shape.items() if a not in inner}, **{a: shape[a] for a in inner if a in shape}}


def check_shared_ckpt_dir(ckpt_dir: Path, mesh: fs.Mesh) -> None:
    """Every process sees the same ``--ckpt-dir`` (a collective under torchrun; nothing to check simulated):
    process 0 writes a file with a fresh token there and every process reads it back.

    Raises:
        UsageError: on every process, naming the ranks that do not see it, and saying the folder must be shared.

    Example:
        >>> import tempfile
        >>> check_shared_ckpt_dir(Path(tempfile.mkdtemp()), fs.make_mesh({"dp": 2}, backend="sim"))
    """
    if not mesh.is_multiprocess:
        return
    probe = ckpt_dir / ".funcshard-shared"
    token = mesh.broadcast_object(os.urandom(8).hex() if mesh.process_index() == 0 else None)
    if mesh.process_index() == 0:
        probe.write_text(token)
    mesh.barrier()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    blind = [r for r, ok in enumerate(mesh.all_gather_object(seen)) if not ok]
    if mesh.process_index() == 0:
        probe.unlink(missing_ok=True)
    if blind:
        raise UsageError(
            f"--ckpt-dir '{ckpt_dir}' is not shared: rank(s) {', '.join(map(str, blind))} do not see the file rank 0 "
            f"wrote there; every process writes its blocks of a checkpoint into it and rank 0 puts it in place, so "
            f"it must be one folder on a filesystem every node mounts (NFS, Lustre, ...)."
        )


def check_ckpt_dir(ckpt_dir: Path, *, resume: bool, overwrite: bool) -> list[int]:
    """The steps saved in ``ckpt_dir``, after checking that the run may start there.

    Without ``--resume`` or ``--overwrite``, a folder holding anything but an old ``config.json`` is refused:
    re-running a command from the shell history must not wipe the run it started. ``--overwrite`` may delete
    only what train wrote (``step_N`` checkpoints and ``config.json``). With ``--resume`` every folder is accepted;
    one with no checkpoint yet gives ``[]`` (the run starts afresh).

    Raises:
        UsageError: saying what is there and which flag to pass.

    Example:
        >>> import tempfile
        >>> check_ckpt_dir(Path(tempfile.mkdtemp()), resume=False, overwrite=False)
        []
    """
    saved = list_steps(ckpt_dir)
    if resume:  # with none yet, the run starts afresh: a torchrun restart before the first checkpoint
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


def _duration(s: float) -> str:
    if s < 2 * 3600:
        return f"{s / 60:.0f} minutes"
    if s < 2 * 86400:
        return f"{s / 3600:.0f} hours"
    return f"{s / 86400:.2g} days"


def check_step_size(args: argparse.Namespace, cfg: llama.Config) -> None:
    """Refuse a step that cannot fit a device's memory, or would take over an hour at ``--peak-tflops``.

    The memory is the train step's own ``memory_analysis()``: the step lowered on the abstract twin of the mesh
    (nothing allocated; every flag counted: ``--remat``, ``--dtype``, the pipeline, FSDP's sharded state), its
    per-device peak against the device's memory: a GPU's own under torchrun on CUDA, else this host's available
    memory shared by the devices it runs (every device of a simulated mesh; ``LOCAL_WORLD_SIZE`` processes under
    torchrun).

    Raises:
        UsageError: with the peak, its largest parts, what it is measured against, and the flags that shrink the
            part that does not fit.

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> args = train_parser().parse_args(["--batch", "1000000", "--mesh", "dp=2"])
        >>> cfg = llama.Config(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
        ...                    max_seq_len=128)
        >>> check_step_size(args, cfg)
        Traceback (most recent call last):
        ...
        funcshard.job.cli.UsageError: --batch 1000000 x --seq 128: one training step needs about ... per device ...
    """
    if bridge.wanted(args):  # a Hugging Face model through fs.nn: no abstract twin to lower (its init is the folder)
        return
    flags = f"--batch {args.batch} x --seq {args.seq}"
    shape = node_order(parse_mesh(args.mesh))
    mesh = fs.make_mesh(shape)  # (the job's own mesh: where its devices' memory is)
    have, sharing, what = device_memory(mesh)
    if have is not None:
        memory = lowered_step(args, cfg, shape).memory_analysis()
        need = memory["peak"]
        if need * sharing > have:
            parts = sorted(((memory[k], k) for k in PARTS), reverse=True)[:3]
            top = ", ".join(f"{k} {human_bytes(n)}" for n, k in parts)
            share = f" x {sharing} devices on this machine" if sharing > 1 else ""
            raise UsageError(
                f"{flags}: one training step needs about {human_bytes(need)} per device ({top}){share}, more "
                f"than the {human_bytes(have)} of {what}; {advice(memory, have / sharing)}"
            )
    flops = cfg.flops_per_token(args.seq) * args.batch * args.seq
    seconds = flops / (args.peak_tflops * 1e12)
    if seconds > MAX_STEP_SECONDS:
        raise UsageError(
            f"{flags}: one training step is about {flops:.2g} FLOP, {_duration(seconds)} even at the assumed peak "
            f"of {args.peak_tflops:g} TFLOP/s (--peak-tflops); lower --seq or --batch, or raise --peak-tflops if "
            f"the hardware is faster."
        )
