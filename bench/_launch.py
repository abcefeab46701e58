"""Starting a benchmark on gloo processes: under torchrun as it is, else ``world`` processes spawned here.

Example:
    >>> # in bench/x.py:  launch(run, args, world=2)   # run(args) on every rank, a gloo group around it
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: Callable[[Any], None], args: Any, world: int, timeout_s: float = 120) -> None:
    """``run(args)`` on ``world`` gloo ranks: this process's under torchrun (RANK and WORLD_SIZE set), else on
    ``world`` processes spawned here (CPU only)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _rank_main(run, args, world, timeout_s)
    else:
        mp.spawn(_spawned, args=(free_port(), run, args, world, timeout_s), nprocs=world, join=True)


def _spawned(rank: int, port: int, run: Callable[[Any], None], args: Any, world: int, timeout_s: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        CUDA_VISIBLE_DEVICES="",
    )
    _rank_main(run, args, world, timeout_s)


def _rank_main(run: Callable[[Any], None], args: Any, world: int, timeout_s: float) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != world:
        raise SystemExit(f"this benchmark runs on {world} processes, found {dist.get_world_size()}")
    run(args)
    dist.barrier()
    dist.destroy_process_group()
    # funcshard keeps its per-axis process groups in a module-level cache; a gloo group still referenced at
    # interpreter teardown sometimes aborts the process ("terminate called without an active exception").
    # Leave without the teardown: the run is complete and its output written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
