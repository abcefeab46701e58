"""Checkpoints of Arrays split unevenly (``torch.tensor_split``'s blocks, API §14): saved on one uneven layout,
loaded onto another mesh and layout, under ``sim`` and ``dist``."""

from __future__ import annotations

from pathlib import Path

import torch

import funcshard as fs
from funcshard import P, checkpoint


def _tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(10, 7, generator=g), "b": torch.randn(3, generator=g), "s": torch.randn(5, generator=g)}


def _save_body(mesh: fs.Mesh, path: str) -> str:
    a = fs.device_put(_tree(), mesh, {"w": P("dp", "tp"), "b": P(("dp", "tp")), "s": P()})
    checkpoint.save(path, a)
    return "ok"


def _load_body(mesh: fs.Mesh, path: str) -> str:
    like = fs.device_put(
        {k: torch.zeros_like(v) for k, v in _tree().items()}, mesh, {"w": P(None, "tp"), "b": P("tp"), "s": P("tp")}
    )
    out = checkpoint.load(path, like)
    assert out["w"].spec == P(None, "tp") and out["s"].spec == P("tp")
    for k, v in fs.device_get(out).items():
        assert torch.equal(v, _tree()[k]), k
    return "ok"


def test_uneven_save_on_dp2_tp2_load_on_tp4(run, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    assert set(run(_save_body, {"dp": 2, "tp": 2}, path)) == {"ok"}
    assert set(run(_load_body, {"tp": 4}, path)) == {"ok"}
