"""A shut-down process keeps no process group alive: gloo can abort at the interpreter's exit while Python
objects still hold its groups (seen as a SIGABRT of one rank after the last step of a torchrun job)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import funcshard as fs
    from funcshard import P
    from funcshard._src.shard_map import executor as _executor

    mesh = fs.make_mesh({"dp": 1}, backend="dist")
    f = fs.shard_map(lambda x: fs.psum(x * 2, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    out = fs.device_get(f(torch.arange(4.0)))
    assert torch.equal(out, torch.arange(4.0) * 2), out  # the unsharded reference: x * 2 summed over one device
    held = list(_executor._CONTEXTS.values())  # what a shard_map call leaves cached in the process
    assert held, "no cached context: nothing to check"
    fs.process.shutdown()
    left = sum(len(c.device._groups) + len(c.device._order) for c in held)
    print("GROUPS LEFT", left)
    sys.exit(0 if left == 0 else 3)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_shutdown_leaves_no_group_in_cached_devices() -> None:
    """After ``fs.process.shutdown()`` no device a shard_map cached still holds a process group (fails before
    ``_drop_groups`` emptied the shared group dicts: the cached context's device kept its dp group)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(_free_port())
    import os

    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=240
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "GROUPS LEFT 0" in p.stdout
