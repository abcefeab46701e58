"""``python -m funcshard train --model mixtral``: the Mixtral trained by the main job on an ``ep`` mesh (sim), its
loss falling, ``generate`` from its checkpoint, one-line errors; under torchrun (4 gloo processes) the simulated
run's losses."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _train_job import TINY, _args, _write_corpus

from funcshard.__main__ import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
MOE = ["--model", "mixtral", "--experts", "4", "--top-k", "2"]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_mixtral_on_ep_dp_learns_and_generates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write_corpus(tmp_path / "data")
    argv = _args(tmp_path, data, *MOE, "--mesh", "ep=2,dp=2", "--steps", "20", "--eval-every", "10", "--lr", "1e-2")
    assert cli_main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "model: Mixtral (4 experts, top-2)" in out
    rows = _rows(tmp_path / "out" / "metrics.csv")
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert vals[-1] < vals[0] - 1.0, vals
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())["model"]
    assert saved["n_experts"] == 4 and saved["experts_per_token"] == 2
    gen = ["generate", "--ckpt-dir", str(tmp_path / "ckpt"), "--prompt", "def ", "--tokens", "20"]
    assert cli_main(gen) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_plan_a_mixtral(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --preset mixtral-8x7b``: the step lowered on an abstract 64-device ep x fsdp mesh; MFU of the active
    parameters (2 of 8 experts a token)."""
    argv = ["plan", "--preset", "mixtral-8x7b", "--mesh", "ep=8,fsdp=8", "--seq", "4096", "--batch", "64"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: mixtral-8x7b (46.70B params) on {'ep': 8, 'fsdp': 8} (64 devices)")
    assert "ragged_all_to_all ep" in out and "MFU" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--mesh", "ep=3"], "n_experts=4 is not divisible by ep=3"),
        (["--mesh", "ep=2", "--batch", "3"], "not divisible by the data-parallel size (ep = 2)"),
        (["--mesh", "tp=2", "--sp"], "sequence_parallel=True is not supported by the Mixtral"),
        (["--top-k", "5"], "experts_per_token=5 is more than n_experts=4"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra, needle: str) -> None:
    data = _write_corpus(tmp_path / "data")
    argv = _args(tmp_path, data, *MOE, "--steps", "2", *extra)  # (a later --batch replaces TINY's)
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err


@pytest.mark.slow
@pytest.mark.dist
def test_mixtral_under_torchrun_matches_sim(tmp_path: Path) -> None:
    """The same command under torchrun (4 gloo processes, ep=2 x dp=2) gives the simulated run's losses."""
    data = _write_corpus(tmp_path / "data")
    common = [*TINY, *MOE, "--data", str(data), "--steps", "3", "--eval-every", "3", "--mesh", "ep=2,dp=2"]
    common += ["--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FUNCSHARD_TIMEOUT": "120"}
    dist_out = tmp_path / "dist"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "funcshard"]
    cmd = [*run, "train", *common, "--ckpt-dir", str(dist_out / "ckpt"), "--out", str(dist_out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim_out = tmp_path / "sim"
    assert cli_main(["train", *common, "--ckpt-dir", str(sim_out / "ckpt"), "--out", str(sim_out)]) == 0
    for d, s in zip(_rows(dist_out / "metrics.csv"), _rows(sim_out / "metrics.csv"), strict=True):
        assert abs(float(d["train_loss"] or 0) - float(s["train_loss"] or 0)) < 1e-4, (d, s)
        assert abs(float(d["val_loss"] or 0) - float(s["val_loss"] or 0)) < 1e-4, (d, s)
