"""The test suite's pool of gloo workers (``tests/support/_dist_pool.py``): a worker that dies while running a body is
reported with its exit status and the body runs once more on a fresh pool; a body that kills its worker every
time fails; a body that raises fails at once (no second run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist
from _dist_pool import RemoteError, WorkerDied, run_body


def _die_once(mesh: object, marker: str) -> str:
    path = Path(marker)
    if dist.get_rank() == 1 and not path.exists():
        path.write_text("died")
        os._exit(3)
    return "ok"


def _die(mesh: object) -> str:
    if dist.get_rank() == 1:
        os._exit(3)
    return "ok"


def _raise(mesh: object, marker: str) -> str:
    with open(marker, "a") as f:
        f.write("x")
    raise ValueError("the body's own error")


@pytest.mark.dist
def test_a_worker_that_dies_once_is_reported_and_the_body_runs_again(tmp_path: Path) -> None:
    marker = tmp_path / "died"
    with pytest.warns(UserWarning, match=r"dist worker 1 died \(exit code 3\) while running _die_once"):
        assert run_body("dist", _die_once, {"dp": 2}, str(marker)) == ["ok", "ok"]
    assert marker.read_text() == "died"


@pytest.mark.dist
def test_a_body_that_kills_its_worker_every_time_fails() -> None:
    with pytest.warns(UserWarning, match="again on a fresh pool"), pytest.raises(WorkerDied, match="exit code 3"):
        run_body("dist", _die, {"dp": 2})
    assert run_body("dist", _die_once, {"dp": 2}, os.devnull) == ["ok", "ok"]  # the next body gets a fresh pool


@pytest.mark.dist
def test_a_body_that_raises_runs_once(tmp_path: Path) -> None:
    marker = tmp_path / "runs"
    with pytest.raises(RemoteError, match="the body's own error"):
        run_body("dist", _raise, {"dp": 2}, str(marker))
    assert marker.read_text() == "xx"  # once on each of the two workers
