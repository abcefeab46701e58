"""A save that dies after writing its blocks keeps the previous checkpoint.

White-box: it makes ``funcshard.checkpoint._save``'s checksumming step raise (an injected kill between the blocks
and the swap) and checks that the previous checkpoint stays readable and no temporary directory is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard import P, checkpoint
from funcshard.checkpoint import _save

MESH = {"dp": 2, "tp": 2}


def test_save_dying_while_checksumming_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that raises after its blocks are written (while checksumming, before the swap) leaves the
    previous checkpoint readable and no temp directory behind."""
    mesh = fs.make_mesh(MESH, backend="sim")
    checkpoint.save(tmp_path / "ck", {"w": fs.device_put(torch.ones(4, 4), mesh, P("dp", "tp"))}, step=1)

    def die(*_: Any) -> None:
        raise RuntimeError("killed while checksumming (injected)")

    monkeypatch.setattr(_save, "record_checksums", die)
    with pytest.raises(RuntimeError, match="injected"):
        checkpoint.save(tmp_path / "ck", {"w": fs.device_put(torch.zeros(4, 4), mesh, P("tp"))}, step=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    like = {"w": fs.device_put(torch.zeros(4, 4), mesh, P())}
    assert torch.equal(fs.device_get(checkpoint.load(tmp_path / "ck", like)["w"]), torch.ones(4, 4))
    assert checkpoint.info(tmp_path / "ck")["step"] == 1
