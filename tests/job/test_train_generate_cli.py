"""The main job, ``python -m funcshard train`` / ``generate``, on a tiny model and a tiny corpus (sim backend)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch
from _train_job import TINY, _args, _write_corpus

import funcshard as fs
from funcshard import checkpoint
from funcshard.__main__ import main as cli_main
from funcshard.job import cli as _cli
from funcshard.job import train

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    data = _write_corpus(tmp / "data")
    argv = _args(tmp, data, "--steps", "30", "--eval-every", "10", "--ckpt-every", "10", "--lr", "1e-2")
    assert cli_main(["train", *argv]) == 0
    return tmp


def test_short_run_learns_and_writes_outputs(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(trained / "out" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(31))
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(vals) == 4  # steps 0, 10, 20, 30
    assert vals[-1] < vals[0] - 1.0, vals
    assert all(float(r["tokens_per_s"]) > 0 for r in rows[1:])
    png = trained / "out" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert checkpoint.list_steps(trained / "ckpt") == [20, 30]  # the last two are kept
    assert (trained / "ckpt" / "config.json").is_file()


def test_generate_prints_text(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    argv = ["generate", "--ckpt-dir", str(trained / "ckpt"), "--prompt", "def ", "--tokens", "40", "--seed", "1"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > 30
    assert cli_main(argv) == 0
    assert capsys.readouterr().out == out  # the seed fixes the sample
    assert cli_main([*argv[:-2], "--temperature", "0"]) == 0


def test_resume_is_exact(tmp_path: Path) -> None:
    data = _write_corpus(tmp_path / "data")
    common = ["--steps", "20", "--eval-every", "5", "--ckpt-every", "5", "--mesh", "dp=2,tp=2"]
    parse = _cli.train_parser().parse_args
    straight = train.train(parse(_args(tmp_path / "a", data, *common)))
    first = train.train(parse(_args(tmp_path / "b", data, *common, "--stop-after", "10")))
    assert first["steps"] == 10 and checkpoint.list_steps(tmp_path / "b" / "ckpt") == [5, 10]
    second = train.train(parse(_args(tmp_path / "b", data, *common, "--resume")))
    assert second["steps"] == 20
    assert first["losses"] + second["losses"] == straight["losses"]  # bitwise: floats compared exactly
    a, b = _rows(tmp_path / "a" / "out" / "metrics.csv"), _rows(tmp_path / "b" / "out" / "metrics.csv")
    assert [(r["step"], r["train_loss"], r["val_loss"]) for r in a] == [
        (r["step"], r["train_loss"], r["val_loss"]) for r in b
    ]
    pa, pb = fs.device_get(straight["params"]), fs.device_get(second["params"])
    for x, y in zip(optree.tree_leaves(pa), optree.tree_leaves(pb), strict=True):
        assert torch.equal(x, y)


def _bad(tmp: Path, data: Path, empty: Path) -> list[tuple[list[str], str]]:
    base = ["train", *_args(tmp, data, "--steps", "2")]
    return [
        ([*base, "--mesh", "dp2"], "--mesh"),
        ([*base, "--mesh", "dp=2,mp=2"], "'mp'"),  # (an ep axis is a data axis for the Llama)
        ([*base, "--mesh", "tp=3"], "n_heads"),
        # (a vocabulary tp does not divide is split unevenly: the next size tp=3 must divide is ffn_dim's)
        ([*base, "--dim", "24", "--heads", "3", "--kv-heads", "3", "--mesh", "tp=3"], "ffn_dim"),
        ([*base, "--mesh", "dp=3"], "--batch"),
        ([*base, "--data", str(empty)], "no text"),
        ([*base, "--data", str(tmp / "nowhere")], "no such file"),
        ([*base, "--mesh", "pp=3", "--layers", "2"], "n_layers=2"),  # a ConfigError (4 layers: uneven stages)
        ([*base, "--mesh", "cp=4", "--seq", "3"], "--seq 3"),  # (63 on cp=2 is split 32 + 31)
        ([*base, "--steps", "many"], "--steps"),
        (["generate", "--ckpt-dir", str(tmp / "nothing")], "no checkpoint"),
        (["bogus"], "unknown command"),
    ]


def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write_corpus(tmp_path / "data")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "zero.bin").write_bytes(b"\0" * 64)
    for argv, needle in _bad(tmp_path, data, empty):
        code = cli_main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (argv, err)


def test_uneven_sequence_on_cp_trains_as_one_device(tmp_path: Path) -> None:
    """``--seq 31`` on ``cp=2`` (16 + 15 positions, zigzag chunks 8 + 8 and 8 + 7): the losses of one device."""
    data = _write_corpus(tmp_path / "data")
    runs = {}
    for mesh in ("dp=1", "cp=2"):
        argv = _args(tmp_path / mesh, data, "--steps", "3", "--seq", "31", "--mesh", mesh)
        runs[mesh] = train.train(_cli.train_parser().parse_args(argv))["losses"]
    torch.testing.assert_close(torch.tensor(runs["cp=2"]), torch.tensor(runs["dp=1"]), rtol=1e-5, atol=1e-6)
    assert runs["cp=2"][-1] < runs["cp=2"][0]


def test_module_entry_runs_without_warnings(tmp_path: Path) -> None:
    data = _write_corpus(tmp_path / "data")
    cmd = [sys.executable, "-W", "default", "-m", "funcshard", "train", *_args(tmp_path, data, "--steps", "2")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Warning" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "val loss" in p.stdout and (tmp_path / "out" / "loss.png").is_file()


@pytest.mark.slow
@pytest.mark.dist
def test_train_under_torchrun_matches_sim(tmp_path: Path) -> None:
    """The same command under torchrun (4 gloo processes, dp=2 x tp=2) gives the simulated run's losses."""
    data = _write_corpus(tmp_path / "data")
    common = [*TINY, "--data", str(data), "--steps", "3", "--eval-every", "3", "--mesh", "dp=2,tp=2", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FUNCSHARD_TIMEOUT": "120"}
    dist_out = tmp_path / "dist"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "funcshard",
        "train",
        *common,
        "--ckpt-dir",
        str(dist_out / "ckpt"),
        "--out",
        str(dist_out),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim_out = tmp_path / "sim"
    assert cli_main(["train", *common, "--ckpt-dir", str(sim_out / "ckpt"), "--out", str(sim_out)]) == 0
    dist_rows, sim_rows = _rows(dist_out / "metrics.csv"), _rows(sim_out / "metrics.csv")
    for d, s in zip(dist_rows, sim_rows, strict=True):
        assert abs(float(d["train_loss"] or 0) - float(s["train_loss"] or 0)) < 1e-4, (d, s)
        assert abs(float(d["val_loss"] or 0) - float(s["val_loss"] or 0)) < 1e-4, (d, s)


def test_the_header_says_when_the_cpu_has_no_native_low_precision_matmul(monkeypatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    note = train.slow_matmul_note("bf16")
    assert note is not None and "no native bf16 matmul" in note and "--dtype bf16" in note
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert train.slow_matmul_note("bf16") is None
    assert train.slow_matmul_note("fp32") is None
