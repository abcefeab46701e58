"""The checkpoint directory on disk: fsync, the atomic swap of a finished save, and finding a checkpoint.

A save writes into ``<path>.tmp-<uuid>`` and swaps it in: the previous checkpoint is renamed to ``<path>.old``,
the new one to ``<path>``, and ``.old`` is deleted; a reader finds the previous checkpoint at ``.old`` when a
save died between the two renames.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ._manifest import MANIFEST, CheckpointError


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def is_checkpoint(d: Path) -> bool:
    return d.is_dir() and (d / MANIFEST).is_file()


def check_replaceable(path: Path) -> None:
    if path.exists() and not is_checkpoint(path) and not (path.is_dir() and not any(path.iterdir())):
        raise CheckpointError(
            f"save('{path}'): refusing to replace it: it exists and is not a funcshard checkpoint (no {MANIFEST}); "
            f"pick another path or remove it yourself."
        )


def swap_in(tmp: Path, path: Path) -> None:
    """Make the finished ``tmp`` the checkpoint at ``path``; the previous one stays readable throughout."""
    old = _old(path)
    if old.exists() and path.exists():
        if is_checkpoint(path):
            shutil.rmtree(old)  # left by an earlier save that died after its swap: ``path`` is newer
        else:  # an empty directory made after a save died between its renames: ``old`` is the previous one
            shutil.rmtree(path)
    moved = path.exists()
    if moved:
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if moved:
            os.rename(old, path)
        raise
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def resolve(path: Path, where: str) -> Path:
    if path.is_dir() and (is_checkpoint(path) or not is_checkpoint(_old(path))):
        return path
    if is_checkpoint(_old(path)):
        return _old(path)  # a save died between its two renames: the previous checkpoint is here
    raise CheckpointError(f"{where}: there is no checkpoint at '{path}' (no such directory).")
