"""The dist backend's point-to-point path: what one message costs in Python (counted, not timed), and that a
receive whose sender never sends still ends, within ``FUNCSHARD_TIMEOUT``, with an error naming the
operation, the peer and the axis.

- Per message, ``DistDevice.p2p`` makes one Python call (the work's constructor) beyond a fixed few per
  batch, and ``wait()`` none beyond itself: no generator context manager, no message built, no timeout
  parsed (those happen once per batch, or only on failure).
- A gloo process waiting on a receive that never comes: ``PeerError: p2p recv from rank 0 (tag 9) over axis
  'pp' (ranks 0, 1): rank 1 got no answer within 2 s ...``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.counters

ROOT = Path(__file__).resolve().parents[3]


def _python_calls(fn: Any) -> tuple[Any, list[str]]:
    """``fn()``'s result and the Python functions it entered (C calls not counted), in order."""
    names: list[str] = []

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, names[:-1] if names and names[-1] == "setprofile" else names


def _counted_exchange(mesh: Any) -> dict[str, Any]:
    """Both ranks of a pp=2 mesh exchange blocks through ``DistDevice.p2p``: batches of 1 and 3 sends (plus
    as many receives), each work waited; the Python calls each part made."""
    from funcshard._src.runtime.backends.dist import device_for
    from funcshard._src.runtime.comm import P2POp

    dev = device_for(mesh)
    me = dev.coords["pp"]
    peer = 1 - me

    def batch(k: int, tag: int) -> list[P2POp]:
        sends = [P2POp("send", torch.full((4,), 10.0 * me + i), peer, tag + i) for i in range(k)]
        return sends + [P2POp("recv", torch.empty(4), peer, tag + i) for i in range(k)]

    for w in dev.p2p(batch(1, 1), ("pp",)):  # warm: the group's first use
        w.wait()  # (a send's work must be kept until waited: dropping it may cancel the send)
    out: dict[str, Any] = {}
    for k in (1, 3):
        ops = batch(k, 10 * k)
        works, post_calls = _python_calls(lambda ops=ops: dev.p2p(ops, ("pp",)))
        got = []
        wait_calls: list[str] = []
        for w in works:
            t, names = _python_calls(w.wait)
            wait_calls += names
            if t is not None:
                got.append(t.tolist())
        out[k] = {"post": post_calls, "wait": wait_calls, "got": got}
    return out


@pytest.mark.dist
def test_dist_p2p_python_calls_per_message() -> None:
    from _dist_pool import run_body

    for me, got in enumerate(run_body("dist", _counted_exchange, {"pp": 2})):
        peer = 1 - me
        for k in (1, 3):
            assert got[k]["got"] == [[10.0 * peer + i] * 4 for i in range(k)]
            # wait(): the method itself, nothing below it in Python (one C++ wait per work)
            assert got[k]["wait"] == ["wait"] * (2 * k), got[k]["wait"]
        one, three = got[1]["post"], got[3]["post"]
        # per op: exactly one Python call (its work's constructor); none of torch's per-op Python (P2POp checks,
        # isend's group-rank lookups) nor a context manager per batch
        assert len(three) - len(one) == 4, (one, three)
        assert three.count("__init__") == 6, three
        assert len(one) <= 10, one
        for name in ("_waiting", "__enter__", "isend", "irecv", "batch_isend_irecv", "default_timeout"):
            assert name not in one + three, (name, one, three)


_SILENT = r"""
import os, sys, time, torch, funcshard as fs
from funcshard._src.runtime.comm import P2POp
from funcshard._src.runtime.backends.dist import device_for
torch.set_num_threads(1)
mesh = fs.make_mesh({"pp": 2}, backend="dist")
dev = device_for(mesh)
first = P2POp("send", torch.ones(3), 1, 1) if dev.rank == 0 else P2POp("recv", torch.empty(3), 0, 1)
dev.p2p([first], ("pp",))[0].wait()
if dev.rank == 1:
    os.environ["FUNCSHARD_TIMEOUT"] = "2"
    t0 = time.monotonic()
    try:
        dev.p2p([P2POp("recv", torch.empty(3), 0, tag=9)], ("pp",))[0].wait()
    except fs.ShardingError as e:
        print(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        os._exit(0)
    print("no error", flush=True)
    os._exit(1)
time.sleep(12)  # rank 0 never sends tag 9, and stays alive (busy elsewhere) while rank 1 waits
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_dist_p2p_receive_that_never_comes_ends_naming_op_and_peer() -> None:
    port = _free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FUNCSHARD_TIMEOUT": "60"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r))
        cmd = [sys.executable, "-c", _SILENT]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[1].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[1].returncode == 0, (out, err[-2000:])
    line = out.strip().splitlines()[-1]
    assert line.startswith("PeerError after "), line
    waited = float(line.split()[2])
    assert 2.0 <= waited < 30.0, line  # FUNCSHARD_TIMEOUT=2 (read when the receive was posted), not 60
    assert "p2p recv from rank 0 (tag 9) over axis 'pp' (ranks 0, 1): rank 1 got no answer within 2 s" in line, line
    assert "waiting for rank 0" in line, line
