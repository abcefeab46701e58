"""Asynchronous checkpoints (issue #31 part 3): ``save(..., async_save=True)`` copies the blocks and writes them in
the background; one save in flight; a job killed mid-write leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard import P, checkpoint

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"w": P("dp", "tp"), "b": P("tp")}


def _tree(mesh: fs.Mesh, scale: float) -> dict:
    full = {"w": torch.arange(64.0).reshape(8, 8) * scale, "b": torch.arange(8.0) * scale}
    return {"params": fs.device_put(full, mesh, SPECS), "step": int(scale)}


def _like(mesh: fs.Mesh) -> dict:
    return {"params": fs.device_put({"w": torch.zeros(8, 8), "b": torch.zeros(8)}, mesh, SPECS), "step": 0}


def _async_body(mesh: fs.Mesh, root: str) -> list[float]:
    tree = _tree(mesh, 1.0)
    handle = checkpoint.save(checkpoint.step_path(root, 1), tree, step=1, async_save=True)
    assert isinstance(handle, checkpoint.SaveHandle) and checkpoint.in_flight() is handle
    for a in tree["params"].values():  # the caller writes into its tensors at once (a donated step does)
        for t in a.shards.values():
            t.fill_(-1.0)
    second = checkpoint.save(checkpoint.step_path(root, 2), _tree(mesh, 2.0), step=2, async_save=True)
    assert handle.done()  # the second save waited for the first: one in flight
    assert second.wait() == checkpoint.step_path(root, 2) and second.seconds is not None
    out = [checkpoint.load(checkpoint.step_path(root, s), _like(mesh)) for s in (1, 2)]
    return [float(fs.device_get(o["params"]["w"]).sum()) for o in out] + [o["step"] for o in out]


def test_async_save_writes_what_it_was_given_under_each_backend(run, tmp_path: Path) -> None:
    for result in run(_async_body, {"dp": 2, "tp": 2}, str(tmp_path)):
        assert result == [2016.0, 4032.0, 1, 2]  # sum(arange(64)) and twice it: the values at the call
    assert checkpoint.list_steps(tmp_path) == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]  # no temp folder left
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint.step_path(tmp_path, 2), tmp_path / "full.pt")  # one standard DCP checkpoint
    full = torch.load(tmp_path / "full.pt")
    assert torch.equal(full["params/w"], torch.arange(64.0).reshape(8, 8) * 2)


def test_async_save_error_is_raised_by_wait(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="refusing to replace"):  # checked at the call
        checkpoint.save(tmp_path / "taken", {"x": torch.ones(2)}, async_save=True)
    handle = checkpoint.save(tmp_path / "ck", {"x": torch.ones(2)}, async_save=True)
    assert handle.wait() == str(tmp_path / "ck") and handle.wait() == str(tmp_path / "ck")


_KILL = """
import sys, time
from pathlib import Path
import torch
import funcshard as fs
from funcshard import P, checkpoint
root, ready = Path(sys.argv[1]), Path(sys.argv[2])
mesh = fs.make_mesh({"dp": 2}, backend="sim")
tree = lambda v: {"w": fs.device_put(torch.full((4, 4), v), mesh, P("dp")), "step": int(v)}
checkpoint.save(checkpoint.step_path(root, 1), tree(1.0), step=1)
real = checkpoint._swap_in
def slow(tmp, path):  # the blocks are written: the job is killed before they are put in place
    ready.write_text("writing")
    time.sleep(600)
checkpoint._swap_in = slow
handle = checkpoint.save(checkpoint.step_path(root, 2), tree(2.0), step=2, async_save=True)
for i in range(10**6):  # training goes on meanwhile
    time.sleep(0.01)
"""


def test_job_killed_mid_async_write_leaves_previous_loadable(tmp_path: Path) -> None:
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", _KILL, str(root), str(ready)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert p.poll() is None, p.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert any(".tmp-" in n for n in os.listdir(root))  # killed mid-write: its blocks lie in a temp folder
    assert checkpoint.list_steps(root) == [1] and checkpoint.latest(root) == checkpoint.step_path(root, 1)
    mesh = fs.make_mesh({"dp": 2}, backend="sim")
    like = {"w": fs.device_put(torch.zeros(4, 4), mesh, P("dp")), "step": 0}
    out = checkpoint.load(checkpoint.latest(root), like)
    assert out["step"] == 1 and torch.equal(fs.device_get(out["w"]), torch.ones(4, 4))


def test_relative_paths_after_chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer process keeps the directory it started in: paths are the caller's, whatever its cwd now."""
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
        monkeypatch.chdir(tmp_path / d)
        assert checkpoint.save("ck", {"x": torch.ones(2)}, async_save=True).wait() == "ck"
    assert checkpoint.list_steps(tmp_path) == [] and checkpoint.info(tmp_path / "two" / "ck")["step"] is None
    assert torch.equal(checkpoint.load(tmp_path / "one" / "ck", {"x": torch.zeros(2)})["x"], torch.ones(2))
