"""The step during which a checkpoint save starts, against a step without one: synchronous vs asynchronous saves.

The train job's own step (``funcshard.job.step.build_step``: loss, gradients and the AdamW update in one
``shard_map``, params and state donated) on a Llama of about 112 MB of float32 parameters (336 MB with the AdamW
moments: what a checkpoint holds), on ``fsdp=2`` over 2 gloo processes. Steps alternate in rounds: a plain step,
a step that starts with ``checkpoint.save(...)`` (synchronous: returns when the checkpoint is in place), a plain
step, a step that starts with ``checkpoint.save(..., async_save=True)`` (returns once the blocks are copied to host
memory; written in the background), then the step after it (still overlapping the write), and the wait for it.
Each row is the median over rounds of rank 0's wall time, and its multiple of the plain step's (the plain steps
interleaved with the saves, so a slow spell on the host weighs on both alike).

Usage:
    python bench/async_ckpt.py                 # spawns 2 gloo processes (~3 minutes on 2 shared cores)
    torchrun --nproc-per-node 2 bench/async_ckpt.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import funcshard as fs
from funcshard import checkpoint
from funcshard.job.cli import train_parser
from funcshard.job.step import build_step, model_config
from funcshard.models import llama

MODEL = ["--dim", "768", "--layers", "4", "--heads", "12", "--kv-heads", "4", "--ffn", "2048", "--seq", "64"]


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    job = train_parser().parse_args([*MODEL, "--batch", "4", "--mesh", "fsdp=2", "--steps", "1000"])
    cfg = model_config(job)
    mesh = fs.make_mesh({"fsdp": 2})
    step = build_step(job, cfg, mesh)
    init = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(fs.P(),), out_specs=step.specs)
    params = init(fs.random.key(0))
    state = step.opt_init(params)
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    root = Path(mesh.broadcast_object(tempfile.mkdtemp(prefix="async-ckpt-")))
    carry = [params, state]
    children: list[int] = []

    def one(save: str | None, k: int) -> tuple[float, float]:
        mesh.barrier()
        t0 = time.perf_counter()
        if save == "fork":  # a child that writes nothing: what copy-on-write alone costs the step
            pid = os.fork()
            if pid == 0:
                time.sleep(3.0)
                os._exit(0)
            children.append(pid)
        elif save is not None:
            tree = {"params": carry[0], "opt_state": carry[1]}
            checkpoint.save(root / f"{save}_{k}", tree, step=k, async_save=save == "async")
        t_call = time.perf_counter() - t0  # the save call alone (async: the host copy)
        loss, carry[0], carry[1] = step.step(carry[0], carry[1], tokens, tokens)
        float(fs.device_get(loss))
        return time.perf_counter() - t0, t_call

    for k in range(2):  # warmup
        one(None, k)
    first = one("async", -1)[0]  # the first asynchronous save starts the writer process: timed apart
    handle = checkpoint.in_flight()
    if handle is not None:
        handle.wait()
    rows: dict[str, list[float]] = {k: [] for k in ("plain", "sync", "async", "async+1", "wait", "call", "fork")}
    for k in range(args.rounds):
        rows["plain"].append(one(None, k)[0])
        rows["sync"].append(one("sync", k)[0])
        rows["plain"].append(one(None, k)[0])
        total, call = one("async", k)
        rows["async"].append(total)
        rows["call"].append(call)
        rows["async+1"].append(one(None, k)[0])
        t0 = time.perf_counter()
        handle = checkpoint.in_flight()
        if handle is not None:
            handle.wait()
        rows["wait"].append(time.perf_counter() - t0)
        rows["fork"].append(one("fork", k)[0])
        for pid in children:
            os.waitpid(pid, 0)
        children.clear()
    if mesh.process_index() == 0:
        _report(rows, cfg, args.rounds)
        plain = statistics.median(rows["plain"])
        print(f"  (the first asynchronous save, which starts the writer process: {first / plain:.2f}x)")
        shutil.rmtree(root, ignore_errors=True)


def _report(rows: dict[str, list[float]], cfg: Any, rounds: int) -> None:
    plain = statistics.median(rows["plain"])
    mb = cfg.num_params() * 4 / 1e6
    print(f"Llama {cfg.num_params() / 1e6:.1f}M params ({mb:.0f} MB fp32; checkpoint {3 * mb:.0f} MB with AdamW's")
    print(f"moments) on fsdp=2, 2 gloo processes, 1 thread each; medians of {rounds} rounds, rank 0")
    what = {
        "plain": "a step without a save",
        "sync": "the step that starts a synchronous save",
        "async": "the step that starts an asynchronous save",
        "async+1": "the step after it (the write still going)",
        "fork": "a step after a fork whose child writes nothing",
    }
    for key, text in what.items():
        t = statistics.median(rows[key])
        print(f"  {text:<45} {t * 1e3:8.0f} ms  {t / plain:5.2f}x")
    print(f"  (async_save=True returned after {statistics.median(rows['call']) * 1e3:.0f} ms: the host copy; the")
    print(f"   write still needed {statistics.median(rows['wait']) * 1e3:.0f} ms after the next step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import launch

    launch(_run, args, world=2, timeout_s=600)


if __name__ == "__main__":
    main()
