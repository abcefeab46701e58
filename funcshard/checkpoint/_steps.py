"""Step directories: ``<root>/step_<N>``, where a training job keeps the checkpoint of step N."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ._files import is_checkpoint

_STEP = re.compile(r"step_(\d+)(\.old)?")


def step_path(root: str | os.PathLike[str], step: int) -> str:
    """``<root>/step_<step, 8 digits>``: where a training job keeps the checkpoint of ``step``.

    Example:
        >>> step_path("ckpt", 100)
        'ckpt/step_00000100'
    """
    return os.path.join(os.fspath(root), f"step_{step:08d}")


def list_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints ``<root>/step_N`` (ascending); ``[]`` when there are none.

    Args:
        root: the folder holding the ``step_N`` folders (it need not exist).

    Returns:
        The step numbers, ascending; incomplete checkpoints are left out. A step whose re-save was killed
        between its two renames is listed: its previous checkpoint is at ``step_N.old``, where ``load``
        finds it.

    Example:
        >>> import tempfile, torch
        >>> from funcshard import checkpoint
        >>> tmp = tempfile.TemporaryDirectory()
        >>> list_steps(tmp.name)
        []
        >>> _ = checkpoint.save(step_path(tmp.name, 5), {"w": torch.ones(2)}, step=5)
        >>> list_steps(tmp.name)
        [5]
        >>> tmp.cleanup()
    """
    root = Path(os.fspath(root))
    if not root.is_dir():
        return []
    found = set()
    for d in root.iterdir():
        m = _STEP.fullmatch(d.name)
        if m and is_checkpoint(d):
            found.add(int(m.group(1)))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> str | None:
    """The path of the newest complete checkpoint under ``root`` (see :func:`step_path`), or None.

    Example:
        >>> if (p := checkpoint.latest("ckpt")) is not None:  # doctest: +SKIP
        ...     state = checkpoint.load(p, like=state)
    """
    steps = list_steps(root)
    return step_path(root, steps[-1]) if steps else None
