"""A pool of gloo processes that runs many test bodies: one process-group start per test session.

``run_body(backend, body, mesh_shape, *args)`` runs ``body(mesh, *args)`` on a mesh of that shape: in this
process under ``"sim"``, or on every process of a pool of ``prod(mesh_shape)`` gloo workers under
``"dist"``; it returns the list of per-rank results (one entry under ``"sim"``). A failure on any rank is
re-raised here with the remote traceback; a rank that does not answer in time ends the pool (a new one
starts for the next body), so a broken body never hangs the suite.
"""

from __future__ import annotations

import atexit
import faulthandler
import math
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
import warnings
from typing import Any

BODY_TIMEOUT = float(os.environ.get("FUNCSHARD_TEST_BODY_TIMEOUT", "180"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn: Any, sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's stack to the test's stderr
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        FUNCSHARD_TIMEOUT=os.environ.get("FUNCSHARD_TIMEOUT", "60"),
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        body, shape, args = msg
        try:
            import funcshard as fs

            mesh = fs.make_mesh(shape, backend="dist")
            conn.send(("ok", body(mesh, *args)))
        except BaseException as e:  # noqa: BLE001 - sent to the parent, which re-raises it
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class RemoteError(AssertionError):
    """A test body failed on a dist worker."""


class WorkerDied(RemoteError):
    """A dist worker process ended (a crash in torch or gloo, a kill) while running a test body."""


class Pool:
    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.n = n
        self.conns = []
        self.procs = []
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, n, port, child, list(sys.path)), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120):
                self.close()
                raise RuntimeError(f"dist pool of {n}: a worker did not start within 120 s")
            c.recv()

    def run(self, body: Any, shape: dict[str, int], args: tuple[Any, ...]) -> list[Any]:
        for c in self.conns:
            c.send((body, shape, args))
        results: list[Any] = [None] * self.n
        pending = set(range(self.n))
        deadline = time.monotonic() + BODY_TIMEOUT
        first_err = None
        while pending:
            now = time.monotonic()
            if now > deadline:
                self.close()
                if first_err:
                    break
                raise RemoteError(
                    f"dist body {body.__name__} did not finish within {BODY_TIMEOUT:.0f} s on ranks {sorted(pending)}"
                )
            for r in list(pending):
                if self.conns[r].poll(0.01):
                    try:
                        kind, val = self.conns[r].recv()
                    except EOFError:
                        proc = self.procs[r]
                        proc.join(timeout=5)
                        code = proc.exitcode
                        self.close()
                        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                        raise WorkerDied(
                            f"dist worker {r} died ({how}) while running {body.__name__}; its stack, if it crashed,"
                            " is in the captured stderr"
                        ) from None
                    pending.discard(r)
                    if kind == "err" and first_err is None:
                        first_err = (r, val)
                        deadline = min(deadline, time.monotonic() + 10)
                    results[r] = (kind, val)
        if first_err:
            if pending:
                self.close()
            r, (name, msg, tb) = first_err
            raise RemoteError(f"rank {r} raised {name}: {msg}\n--- remote traceback ---\n{tb}")
        return [v for _, v in results]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self.procs = []
        self.conns = []
        _POOLS.pop(self.n, None)


_POOLS: dict[int, Pool] = {}
DIST_BODIES = 0  # bodies run under "dist" so far (conftest checks that a test that runs one is marked ``dist``)


def _close_all() -> None:
    for p in list(_POOLS.values()):
        p.close()


atexit.register(_close_all)


def run_body(backend: str, body: Any, shape: dict[str, int], *args: Any) -> list[Any]:
    """Run ``body(mesh, *args)`` on a mesh of ``shape`` under ``backend`` ("sim" or "dist")."""
    import funcshard as fs

    if backend == "sim":
        return [body(fs.make_mesh(shape, backend="sim"), *args)]
    global DIST_BODIES
    DIST_BODIES += 1
    n = math.prod(shape.values())
    try:
        return _pool(n).run(body, shape, args)
    except WorkerDied as e:
        # A process that ends without raising (once in a few thousand bodies on an oversubscribed host, inside
        # gloo) is not an answer of the body: run it again once on a fresh pool, loudly. A body that kills its
        # worker every time still fails.
        warnings.warn(f"{e}; running {body.__name__} again on a fresh pool", stacklevel=2)
    return _pool(n).run(body, shape, args)


def _pool(n: int) -> Pool:
    """The pool of ``n`` workers, started if there is none (a pool that lost a worker has removed itself)."""
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = Pool(n)
    return pool
