"""Issue #12, "nothing lost, no hang": each test reproduces one failure a user met and checks the fix.

1 a fresh run never deletes an earlier run's checkpoints; 2 FUNCSHARD_TIMEOUT bounds every wait (gloo groups
and simulated devices) and the error names the axis and the rank; 3 Ctrl-C stops with one line and exit code
130; 6 --data is streamed; 7 bad input is one line before the first step; 8 ``import funcshard`` gives every
subpackage, the install gives what the job needs, and --help documents every flag and setting. (4 and 5,
checksums and a full disk, are in tests/checkpoint/test_checkpoint_roundtrip_reshard.py.)
"""

from __future__ import annotations

import _thread
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard import P, checkpoint
from funcshard.__main__ import main as cli_main
from funcshard.job import cli as _cli

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq", "32", "--batch", "4"]
STOPPED = re.compile(r"stopped at step (\d+); the checkpoint of step (\d+) is intact; --resume continues")


def _corpus(d: Path, n_files: int = 24) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (d / f"m{i:02d}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} - {i}\n\n" for j in range(12)))
    return d


def _argv(tmp: Path, data: Path, *extra: str) -> list[str]:
    return ["train", *TINY, "--data", str(data), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"), *extra]


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


# -- 1: a fresh run refuses a folder holding an earlier run ------------------------------------------------


def test_fresh_run_never_deletes_earlier_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Re-running the command from the shell history used to wipe every checkpoint of the earlier run."""
    data = _corpus(tmp_path / "data")
    run = _argv(tmp_path, data, "--steps", "2", "--ckpt-every", "1")
    assert cli_main(run) == 0
    ckpt = tmp_path / "ckpt"
    assert checkpoint.list_steps(ckpt) == [1, 2]
    before = {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
    capsys.readouterr()

    assert cli_main(run) == 2  # the same command again
    line = _one_error_line(capsys.readouterr().err)
    assert f"--ckpt-dir '{ckpt}' already holds 2 checkpoint(s)" in line and "--resume" in line, line
    assert "--overwrite" in line, line
    assert {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()} == before  # nothing touched

    (ckpt / "notes.txt").write_text("mine")  # --overwrite deletes only what train wrote
    assert cli_main([*run, "--overwrite"]) == 2
    assert "'notes.txt'" in _one_error_line(capsys.readouterr().err)
    assert (ckpt / "notes.txt").read_text() == "mine" and checkpoint.list_steps(ckpt) == [1, 2]
    (ckpt / "notes.txt").unlink()

    assert cli_main([*run, "--overwrite", "--seed", "1"]) == 0  # said explicitly: a new run replaces the old
    assert checkpoint.list_steps(ckpt) == [1, 2]
    assert (ckpt / "step_00000002" / "funcshard.json").read_bytes() != before[ckpt / "step_00000002" / "funcshard.json"]


# -- 2: FUNCSHARD_TIMEOUT bounds every wait ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sim_stuck_device_is_reported_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device stuck in its own code used to be reported only when it finished (60 s and more)."""
    monkeypatch.setenv("FUNCSHARD_TIMEOUT", "2")
    release = threading.Event()
    timer = threading.Timer(20.0, release.set)  # the old code waits for the stuck device: let it end
    timer.daemon = True
    timer.start()
    mesh = fs.make_mesh({"dp": 4}, backend="sim")

    def f(x: torch.Tensor) -> torch.Tensor:
        if int(fs.axis_index("dp")) == 1:
            release.wait()  # stuck (a blocking call that never returns)
        return fs.psum(x, "dp")

    t0 = time.monotonic()
    try:
        with pytest.raises(fs.ShardingError) as e:
            fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P())(torch.ones(4))
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        timer.cancel()
    msg = str(e.value)
    assert 2.0 <= elapsed < 4.0, elapsed
    assert "waited 2 s (FUNCSHARD_TIMEOUT) for device(s) (dp=1)" in msg and "('dp',)" in msg, msg
    from funcshard.process import abandoned_threads

    for t in abandoned_threads():
        t.join(5.0)
    assert abandoned_threads() == []  # released, the stuck device ends at its next collective


_LOOP = r"""
import os, sys, time, torch, funcshard as fs
from funcshard import P
torch.set_num_threads(1)
mesh = fs.make_mesh({"dp": 2, "tp": 2}, backend="dist")

@fs.shard_map(mesh=mesh, in_specs=(P("dp", "tp"),), out_specs=P())
def step(x):
    return fs.psum(fs.psum(x.sum(), "tp"), "dp")

step(torch.ones(4, 4))
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").close()
t0 = time.monotonic()
while time.monotonic() - t0 < 120:
    step(torch.ones(4, 4))
    time.sleep(0.01)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_stopped_gloo_process_every_other_exits_naming_axis_and_rank(tmp_path: Path) -> None:
    """One of 4 gloo processes SIGSTOPped: the per-axis groups ignored FUNCSHARD_TIMEOUT (torch's 30 minutes)."""
    port, ready = _free_port(), tmp_path / "ready"
    ready.mkdir()
    procs = []
    for r in range(4):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "4"}
        env.update(LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="4", FUNCSHARD_TIMEOUT="10")
        cmd = [sys.executable, "-c", _LOOP, str(ready)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    victim = procs[3]
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(ready)) < 4:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
            time.sleep(0.1)
        victim.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        for r, p in enumerate(procs[:3]):
            _, err = p.communicate(timeout=max(1.0, 30 - (time.monotonic() - stopped_at)))
            assert p.returncode != 0, (r, err[-2000:])
            found = re.search(r"PeerError: (\w+) over axis '(dp|tp)' \(ranks [\d, ]+\): rank (\d) .*", err)
            assert found, (r, err[-2000:])
            assert int(found.group(3)) == r and "rank 3" in found.group(0), found.group(0)
        assert time.monotonic() - stopped_at < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends the stopped process too
            p.communicate()


# -- 3: Ctrl-C ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_ctrl_c_stops_with_one_line_and_exit_130(tmp_path: Path) -> None:
    """Ctrl-C on a sim train job used to abort with SIGABRT ("terminate called without an active exception")."""
    data = _corpus(tmp_path / "data")
    argv = _argv(tmp_path, data, "--steps", "1000", "--ckpt-every", "2", "--eval-every", "1000")
    cmd = [sys.executable, "-m", "funcshard", *argv]
    p = subprocess.Popen(cmd, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not checkpoint.list_steps(tmp_path / "ckpt"):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            time.sleep(0.1)
        time.sleep(0.5)  # in the middle of a later step
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    found = STOPPED.fullmatch(last)
    assert found, err[-2000:]
    n, k = int(found.group(1)), int(found.group(2))
    assert checkpoint.list_steps(tmp_path / "ckpt")[-1] == k and k <= n
    assert len([ln for ln in err.splitlines() if "stopped" in ln]) == 1
    # --resume continues from step k
    assert cli_main([*argv, "--resume", "--stop-after", "1"]) == 0
    assert checkpoint.list_steps(tmp_path / "ckpt")[-1] == k + 1


@pytest.mark.timeout(60)
def test_ctrl_c_in_sim_stops_every_device_before_it_goes_on() -> None:
    """The abort came from device threads still running torch code when the interpreter shut down."""
    mesh = fs.make_mesh({"dp": 4}, backend="sim")

    def f(x: torch.Tensor) -> torch.Tensor:
        if int(fs.axis_index("dp")) == 0:
            time.sleep(1.0)  # busy in its own code when Ctrl-C comes; the others wait in the psum
        return fs.psum(x, "dp")

    with pytest.raises(KeyboardInterrupt):
        threading.Timer(0.3, _thread.interrupt_main).start()  # Ctrl-C, as the terminal sends it
        fs.shard_map(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P())(torch.ones(4))
    assert [t.name for t in threading.enumerate() if t.name.startswith("funcshard-sim")] == []


# -- 6: --data is streamed ---------------------------------------------------------------------------------

_MEASURE = r"""
import resource, sys
from funcshard.job.data import load_corpus
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
corpus = load_corpus(sys.argv[1], max_bytes=int(sys.argv[2]), seq=32)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown * 1024, len(corpus.train) + len(corpus.val), corpus.train[:16].tolist())
"""


def test_data_file_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    """A 1.5 GB --data file used to be read whole (3.16 GB peak) before being cut to --max-bytes."""
    big, line, max_bytes = tmp_path / "big.txt", b"def f(x):\n    return x + 1\n\n", 1_000_000
    block = line * ((1 << 20) // len(line))  # about 1 MiB
    try:
        with open(big, "wb") as f:
            for _ in range(160):  # 160 MiB of text
                f.write(block)
        cmd = [sys.executable, "-c", _MEASURE, str(big), str(max_bytes)]
        p = subprocess.run(cmd, env=_env(), capture_output=True)
    finally:
        big.unlink()
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    grown, n_bytes, head = p.stdout.decode().split(maxsplit=2)
    assert int(grown) < 48 << 20, f"memory grew by {int(grown) >> 20} MiB to read {max_bytes} bytes of a 160 MiB file"
    assert int(n_bytes) == max_bytes and head.strip() == str(list(block[:16]))


@pytest.mark.timeout(60)
def test_folder_skips_binary_and_special_files(tmp_path: Path) -> None:
    d = _corpus(tmp_path / "data", n_files=3)
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 10)
    (d / "noise.bin").write_bytes(bytes(range(1, 256)) * 40)  # no NUL byte, but not text
    os.mkfifo(d / "pipe")  # reading it would block for ever
    from funcshard.job.data import load_corpus

    corpus = load_corpus(str(d), max_bytes=1_000_000, seq=32)
    assert corpus.n_files == 3


# -- 7: one line before the first step ---------------------------------------------------------------------


def _read_only(d: Path) -> Path | None:
    """A folder nobody can write to: a read-only tmpfs as root (permission bits do not stop root), else 0o555."""
    d.mkdir(parents=True)
    if os.geteuid() == 0:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True)
        return d if p.returncode == 0 else None
    d.chmod(0o555)
    return d


def _bad_inputs(tmp: Path, data: Path, ro: Path | None) -> list[tuple[list[str], str]]:
    noise, weights = tmp / "noise.txt", tmp / "weights.txt"
    noise.write_bytes(bytes(range(1, 256)) * 400)  # no NUL byte, not UTF-8
    torch.save(torch.arange(100.0), weights)
    base = _argv(tmp, data, "--steps", "2")
    default_model = ["train", "--data", str(data), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "out")]
    cases = [
        ([*base, "--lr", "inf"], "--lr must be a finite number > 0, found inf."),
        ([*base, "--lr", "nan"], "--lr must be a finite number > 0, found nan."),
        ([*base, "--lr", "-0.1"], "--lr must be a finite number > 0, found -0.1."),
        ([*base, "--final-lr", "nan"], "--final-lr must be a finite number >= 0, found nan."),
        ([*base, "--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, found inf."),
        ([*base, "--clip", "0"], "--clip must be a finite number > 0, found 0.0."),
        ([*base, "--peak-tflops", "inf"], "--peak-tflops must be a finite number > 0, found inf."),
        ([*default_model, "--batch", "100000000"], "--batch 100000000 x --seq 128: one training step needs about"),
        ([*default_model, "--seq", "100000"], "--batch 16 x --seq 100000: one training step "),
        ([*base, "--data", str(weights)], f"--data '{weights}' is not text: it has NUL bytes"),
        ([*base, "--data", str(noise)], f"--data '{noise}' is not text: it is not UTF-8"),
        ([*base, "--resume", "--overwrite"], "pass one of them"),
        ([*base, "--out", str(data / "m00.py" / "out")], "is not writable (Not a directory)"),
    ]
    if ro is not None:
        why = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
        cases += [
            ([*base, "--out", str(ro / "out")], f"--out '{ro / 'out'}' is not writable ({why})"),
            ([*base, "--ckpt-dir", str(ro / "ckpt")], f"--ckpt-dir '{ro / 'ckpt'}' is not writable ({why})"),
        ]
    return cases


def test_bad_input_is_one_line_before_the_first_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these used to train first (a read-only --out failed only at the end, with a traceback), allocate
    26 GB, run for ever, or train on NaN."""
    data = _corpus(tmp_path / "data")
    ro = _read_only(tmp_path / "ro")
    try:
        for argv, needle in _bad_inputs(tmp_path, data, ro):
            code = cli_main(argv)
            out, err = capsys.readouterr()
            assert code == 2, (argv, out[-500:], err[-2000:])
            line = _one_error_line(err)
            assert needle in line, (needle, line)
            assert "val loss" not in out, (argv, out)  # refused before the first evaluation
            assert not checkpoint.list_steps(tmp_path / "ckpt"), argv
    finally:
        if ro is not None and os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False)


def test_bad_timeout_setting_is_one_line(tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FUNCSHARD_TIMEOUT", "soon")
    assert cli_main(_argv(tmp_path, _corpus(tmp_path / "data"), "--steps", "2")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "FUNCSHARD_TIMEOUT='soon': expected a positive number of seconds" in line, line


# -- 8: everything from one import, what the job needs installed, every flag and setting documented --------


def test_import_funcshard_gives_every_subpackage() -> None:
    code = "import funcshard as fs; print(fs.ops.__name__, fs.checkpoint.__name__, fs.models.__name__, fs.pipeline)"
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("funcshard.ops funcshard.checkpoint funcshard.models <module 'funcshard.pipeline'")


def test_install_line_gives_the_loss_plot_and_numpy() -> None:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower(): d for d in deps}
    assert {"torch", "numpy", "matplotlib", "optree", "tqdm"} <= names.keys(), deps
    assert all(re.search(r"[<>=~]=?\s*\d", d) for d in deps), f"every runtime requirement has a version: {deps}"


def _environment_names() -> set[str]:
    """Every environment variable funcshard's own code reads."""
    pattern = re.compile(
        r"""environ(?:\.get)?[\[(]\s*["']([A-Z_]+)["']|["']([A-Z_]+)["']\s+(?:not\s+)?in\s+os\.environ"""
    )
    names = set()
    for f in (ROOT / "funcshard").rglob("*.py"):
        for m in pattern.finditer(f.read_text()):
            names.add(m.group(1) or m.group(2))
    return names


@pytest.mark.parametrize("command", ["train", "generate", "demo"])
def test_help_shows_every_flag_its_default_and_the_settings(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = {"train": _cli.train_parser, "generate": _cli.generate_parser, "demo": _cli.demo_parser}[command]()
    assert cli_main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]} has no help line"
        flag = " ".join(action.option_strings)
        assert flag.split()[0] in text
        if action.default is not None and action.nargs != 0:
            assert f"(default: {action.default})" in text, f"{flag}: no default shown"
    names = _environment_names()
    assert "FUNCSHARD_TIMEOUT" in names and "RANK" in names
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert name in text, f"--help does not document {name}"
        assert name in readme, f"README does not document {name}"
