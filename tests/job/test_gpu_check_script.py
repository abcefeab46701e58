"""``bench/gpu_check.sh``, the GPU machine's checklist: it is there, executable, valid bash, and its dry mode
(``--dry`` / ``GPU_CHECK_DRY=1``) lists every part its header describes, with a command whose script exists, without
running any (a real run is a minute here: too slow for the suite)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
PARTS = ("env", "dist_nccl", "triton", "plan", "train_gpu", "nccl_dry", "train_dry")


def _header_parts() -> list[str]:
    """The part names the script's header comment lists (``#   name  gpu|cpu  ...``)."""
    return re.findall(r"^#   (\w+)\s+(?:gpu|cpu)\s", SCRIPT.read_text(), flags=re.M)


def test_exists_executable_and_valid_bash() -> None:
    assert SCRIPT.is_file()
    assert os.access(SCRIPT, os.X_OK), "chmod +x bench/gpu_check.sh"
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_dry_mode_lists_every_part_and_runs_none() -> None:
    assert tuple(_header_parts()) == PARTS
    env = {**os.environ, "PYTHON": "false"}  # a part that ran would fail at once; none may run
    for args, extra in ((["--dry"], {}), ([], {"GPU_CHECK_DRY": "1"})):
        done = subprocess.run(
            ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env={**env, **extra}, check=False
        )
        assert done.returncode == 0, done.stderr
        listed = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.strip()}
        assert tuple(listed) == PARTS, done.stdout
        for name, line in listed.items():
            kind = line.split()[1]
            assert kind in ("cpu", "gpu", "cpu-nogpu"), line
            for script in re.findall(r"bench/\w+\.py", line):  # the scripts the parts run are there
                assert (ROOT / script).is_file(), (name, script)
