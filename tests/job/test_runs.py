"""Issue #31, real runs: ``--resume`` on an empty folder starts afresh and a resume loads into the abstract
layout (no init), ``--async-ckpt``, a torchrun restart after a killed worker continues bit for bit, and the
errors a user meets name what they wrote (a peer lost in ``checkpoint.save``, ``fs.device_get`` on one rank)."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _train_job import TINY, _args, _write_corpus

from funcshard import checkpoint
from funcshard.__main__ import main as cli_main
from funcshard.job import cli as _cli
from funcshard.job import preflight, train
from funcshard.models import llama

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _losses(out: Path) -> list[str]:
    with open(out / "metrics.csv", newline="") as f:
        return [r["train_loss"] for r in csv.DictReader(f) if r["train_loss"]]


def test_resume_starts_afresh_then_loads_without_init(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--resume`` on an empty --ckpt-dir trains from scratch; the next --resume loads into shapes only."""
    data = _write_corpus(tmp_path / "data")
    common = ["--steps", "4", "--ckpt-every", "1", "--eval-every", "2", "--mesh", "dp=2,tp=2"]
    parse = _cli.train_parser().parse_args
    straight = train.train(parse(_args(tmp_path / "a", data, *common)))
    assert cli_main(["train", *_args(tmp_path / "b", data, *common, "--resume", "--stop-after", "2")]) == 0
    assert "no checkpoint in" in capsys.readouterr().out  # said, then started afresh
    real_init, drawn = llama.init, []

    def init(key, cfg):  # a random init draws on real tensors; fs.eval_shape's runs on meta ones
        drawn.append(not key.is_meta)
        return real_init(key, cfg)

    monkeypatch.setattr(llama, "init", init)
    second = train.train(parse(_args(tmp_path / "b", data, *common, "--resume", "--async-ckpt")))
    assert not any(drawn), drawn  # the resume drew nothing: it loaded into the abstract layout
    assert second["steps"] == 4 and checkpoint.list_steps(tmp_path / "b" / "ckpt") == [3, 4]
    assert _losses(tmp_path / "b" / "out") == [repr(x) for x in straight["losses"]]  # bit for bit


_PEERS = """
import os, sys, time, torch
import funcshard as fs
from funcshard import P, checkpoint
from funcshard.process import PeerError
mode, root = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
mesh = fs.make_mesh({"dp": 2})
w = fs.device_put(torch.arange(8.0), mesh, P("dp"))
if mode == "save" and rank == 1:  # dies inside torch.distributed.checkpoint's write
    import torch.distributed.checkpoint as dcp
    dcp.FileSystemWriter.write_data = lambda *a, **k: os._exit(0)
if mode == "device_get" and rank == 1:
    time.sleep(4)  # never calls device_get
    os._exit(0)
try:
    if mode == "save":
        checkpoint.save(root, {"w": w})
    else:
        fs.device_get(w)
except PeerError as e:
    print("PEER", e, flush=True)
    os._exit(3)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["device_get", "save"])
def test_peer_lost_names_the_users_call(mode: str, tmp_path: Path) -> None:
    """A collective left by a peer names the call the user wrote, not an inner all_gather or DCP's gloo error."""
    port = _free_port()
    procs = []
    for r in range(2):
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2", FUNCSHARD_TIMEOUT="20")
        cmd = [sys.executable, "-c", _PEERS, mode, str(tmp_path / "ck")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert procs[0].returncode == 3, (out, err[-3000:])
    line = out.strip().splitlines()[-1]
    name = "fs.device_get" if mode == "device_get" else "checkpoint.save"
    assert line.startswith(f"PEER {name} (a collective: every process calls it at the same point)"), line
    assert "rank 1" in line, line
    assert not checkpoint.list_steps(tmp_path) and not (tmp_path / "ck").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_restart_after_a_killed_worker_continues_bit_for_bit(tmp_path: Path) -> None:
    """torchrun --max-restarts 1 ... train --resume, rank 1 SIGKILLed once the checkpoint of step 2 is complete:
    exit 0 and the per-step losses of an uninterrupted run, bit for bit."""
    data = _write_corpus(tmp_path / "data")
    common = [*TINY, "--data", str(data), "--steps", "4", "--ckpt-every", "2", "--eval-every", "4", "--mesh", "dp=2"]
    losses = {}
    for name, extra in (("killed", {"FUNCSHARD_TEST_KILL_AFTER_CKPT": "1:2"}), ("straight", {})):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["--max-restarts", "1", "-m", "funcshard", "train", *common, "--threads", "1", "--resume"]
        cmd += ["--ckpt-dir", str(out / "ckpt"), "--out", str(out)]
        p = subprocess.run(cmd, env=_env(FUNCSHARD_TIMEOUT="60", **extra), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        losses[name] = _losses(out)
        if name == "killed":
            assert "starting afresh" in p.stdout and "steps 2 -> 4" in p.stdout, p.stdout[-3000:]  # two generations
    assert len(losses["straight"]) == 4 and losses["killed"] == losses["straight"]


def _shared_body(mesh, root: str) -> list[str]:
    """The same folder on every rank passes; a folder of each rank's own is refused on every rank."""
    preflight.check_shared_ckpt_dir(Path(root), mesh)
    try:
        preflight.check_shared_ckpt_dir(Path(root) / f"rank{mesh.process_index()}", mesh)
    except _cli.UsageError as e:
        return [str(e)]
    return []


def test_every_rank_must_see_the_same_ckpt_dir(run, backend: str, tmp_path: Path) -> None:
    for r in range(2):
        (tmp_path / f"rank{r}").mkdir()
    for errors in run(_shared_body, {"dp": 2}, str(tmp_path)):
        if backend == "sim":  # one process: nothing to check
            assert errors == []
            continue
        assert len(errors) == 1 and "is not shared: rank(s) 1 do not see" in errors[0], errors
        assert "filesystem every node mounts" in errors[0]
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]  # the probe is gone


@pytest.mark.slow
@pytest.mark.dist
def test_two_torchrun_agents_give_the_sim_losses_with_tp_inside_a_node(tmp_path: Path) -> None:
    """torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d, two agents on this host, --mesh tp=2,dp=2: the
    job runs it as dp=2,tp=2 (tp inside a node) and gives the simulated run's losses."""
    data = _write_corpus(tmp_path / "data")
    common = [*TINY, "--data", str(data), "--steps", "3", "--eval-every", "3", "--mesh", "tp=2,dp=2", "--threads", "1"]
    out, port = tmp_path / "dist", _free_port()
    agents = []
    for _ in range(2):  # two agents, one "node" each
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "funcshard-test"]
        cmd += ["-m", "funcshard", "train", *common, "--ckpt-dir", str(out / "ckpt"), "--out", str(out)]
        env = _env(FUNCSHARD_TIMEOUT="120")
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [a.communicate(timeout=600) for a in agents]
    for a, (_, se) in zip(agents, outputs, strict=True):
        assert a.returncode == 0, se[-4000:]
    said = "".join(so for so, _ in outputs)
    assert "nodes: 2 of 2 processes; axes inside a node: tp" in said, said[-3000:]
    assert "--mesh tp=2,dp=2 ran as dp=2,tp=2" in said, said[-3000:]
    sim = tmp_path / "sim"
    assert cli_main(["train", *common, "--ckpt-dir", str(sim / "ckpt"), "--out", str(sim)]) == 0
    for d, s in zip(_losses(out), _losses(sim), strict=True):
        assert abs(float(d) - float(s)) < 1e-4, (d, s)
