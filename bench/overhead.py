"""What the machinery costs on the Llama train step: a one-device ``sim`` mesh vs the eager step, and ``check_vma``
on vs off on 2 gloo processes.

The step, the same pure function in every row (loss, gradients and the AdamW update):

    loss, grads = fs.value_and_grad(lambda p: llama.loss(p, tokens, targets, cfg))(params)
    params, state = adamw.update(grads, state, params)

1. ``sim {"dp": 1}`` vs eager: the step run as it is on plain full tensors (no shard_map: the eager torch step,
   the baseline) and inside ``fs.shard_map`` over a simulated mesh of one device (``check_vma=True``, the
   default). Same math, same process, one thread; the ratio is what shard_map, the vma tracking and the
   collectives (over a group of one) cost. Target: <= 1.05.
2. ``check_vma`` on vs off under ``dist``: the step in ``fs.shard_map`` over ``--mesh`` (default tp=2) on 2 gloo
   processes, with ``check_vma=True`` and against ``check_vma=False`` (the baseline; each ``fs.pvary`` the model
   writes for the untracked case). Target: <= 1.03.

Both rows first check that the two steps agree (loss and params after one step, to 1e-5), then time them A/B
interleaved (the order flips every step) after warmup, each a real training step fed its own previous params and
state. The default model is the 13.2M-parameter Llama (dim 384, 8 layers, batch 4 x 128).

Prints: the model and host (load average at launch), then per row a check line (loss and params differences)
and the median wall ms of the baseline and of funcshard, their ratio, the median CPU ms of each (the process's
for sim; the calling thread's for dist, which leaves out waiting for the peer: the steadier measure on a shared
host), their ratio and the target.

Measured figures and their history: ``docs/guides/speed.md``.

Usage:
    python bench/overhead.py                      # both rows at the ~13M-parameter Llama (a few minutes)
    python bench/overhead.py --rows sim --batch 2 --seq 64
    python bench/overhead.py --rows dist --mesh dp=2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
from _launch import launch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

WORLD = 2
TARGETS = {"sim": 1.05, "dist": 1.03}


def _config(args: argparse.Namespace) -> llama.Config:
    return llama.Config(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads // 2,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
    )


def _data(cfg: llama.Config, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def make_step(cfg: llama.Config, opt: fs.optim.Optimizer) -> Callable[..., Any]:
    """The train step: ``(params, state, tokens, targets) -> (loss, params, state)``."""

    def step(params: Any, state: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any, Any]:
        loss, grads = fs.value_and_grad(lambda p: llama.loss(p, tokens, targets, cfg))(params)
        params, state = opt.update(grads, state, params)
        return loss, params, state

    return step


def _interleaved(
    runs: dict[str, Callable[[], None]], steps: int, warmup: int, clock: Callable[[], float]
) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and CPU (``clock``) seconds of each run, A/B interleaved, the order flipping every step."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
    out: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for i in range(steps):
        for n in names if i % 2 == 0 else names[::-1]:
            c0, t0 = clock(), time.perf_counter()
            runs[n]()
            out[n][0].append(time.perf_counter() - t0)
            out[n][1].append(clock() - c0)
    return out


def _max_diff(a: Any, b: Any) -> float:
    return max((x - y).abs().max().item() for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True))


def _row(label: str, base: str, other: str, t: dict[str, tuple[list[float], list[float]]], target: float) -> str:
    wall = {n: statistics.median(v[0]) * 1e3 for n, v in t.items()}
    cpu = {n: statistics.median(v[1]) * 1e3 for n, v in t.items()}
    return (
        f"{label:<34} {wall[base]:>9.1f} {wall[other]:>9.1f} {wall[other] / wall[base]:>7.3f} "
        f"{cpu[base]:>9.1f} {cpu[other]:>9.1f} {cpu[other] / cpu[base]:>7.3f} {'<= ' + format(target, '.2f'):>8}"
    )


HEADER = (
    f"{'row':<34} {'base ms':>9} {'fs ms':>9} {'ratio':>7} {'base cpu':>9} {'fs cpu':>9} {'cpu r.':>7} {'target':>8}"
)


def sim_row(args: argparse.Namespace) -> str:
    """Row 1: the eager step vs the same step in shard_map over a one-device sim mesh."""
    torch.set_num_threads(1)
    cfg = _config(args)
    tokens, targets = _data(cfg, args)
    opt = fs.optim.adamw(1e-3)
    step = make_step(cfg, opt)
    mesh = fs.make_mesh({"dp": 1}, backend="sim")
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    sspecs = opt.state_specs(specs)
    sharded = fs.shard_map(step, mesh=mesh, in_specs=(specs, sspecs, bs, bs), out_specs=(P(), specs, sspecs))
    params = llama.init(fs.random.key(0), cfg)
    state = {"eager": (params, opt.init(params))}
    p_sh = fs.device_put(params, mesh, specs)
    state["sim"] = (p_sh, opt.init(p_sh))
    tok_a, tgt_a = fs.device_put(tokens, mesh, bs), fs.device_put(targets, mesh, bs)

    loss_e, p_e, _ = step(*state["eager"], tokens, targets)
    loss_s, p_s, _ = sharded(*state["sim"], tok_a, tgt_a)
    loss_err, param_err = abs(loss_e.item() - fs.device_get(loss_s).item()), _max_diff(p_e, fs.device_get(p_s))
    if loss_err > 1e-5 or param_err > 1e-5:
        raise AssertionError(f"sim step differs from the eager one: loss {loss_err:.2e}, params {param_err:.2e}")

    def run_eager() -> None:
        _, p, s = step(*state["eager"], tokens, targets)
        state["eager"] = (p, s)

    def run_sim() -> None:
        _, p, s = sharded(*state["sim"], tok_a, tgt_a)
        state["sim"] = (p, s)

    t = _interleaved({"eager": run_eager, "sim": run_sim}, args.steps, args.warmup, time.process_time)
    print(f"  sim check: loss diff {loss_err:.1e}, params after one step {param_err:.1e}", flush=True)
    return _row('sim {"dp": 1} vs eager', "eager", "sim", t, TARGETS["sim"])


def _mesh_shape(text: str) -> dict[str, int]:
    shape = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    if math.prod(shape.values()) != WORLD:
        raise SystemExit(f"--mesh {text}: this row runs on {WORLD} processes; give axes multiplying to {WORLD}")
    return shape


def dist_row(args: argparse.Namespace) -> None:
    """Row 2 (on each of the 2 gloo ranks): check_vma=True vs False; rank 0 prints the row."""
    torch.set_num_threads(1)
    cfg = _config(args)
    tokens, targets = _data(cfg, args)
    mesh = fs.make_mesh(_mesh_shape(args.mesh), backend="dist")
    opt = fs.optim.adamw(1e-3)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    sspecs = opt.state_specs(specs)
    init = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=specs)
    opt_init = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)
    steps = {
        vma: fs.shard_map(
            make_step(cfg, opt),
            mesh=mesh,
            in_specs=(specs, sspecs, bs, bs),
            out_specs=(P(), specs, sspecs),
            check_vma=vma == "on",
        )
        for vma in ("off", "on")
    }
    state = {}
    for n in steps:
        p = init(fs.random.key(0))
        state[n] = (p, opt_init(p))
    tok_a, tgt_a = fs.device_put(tokens, mesh, bs), fs.device_put(targets, mesh, bs)
    first = {n: steps[n](*state[n], tok_a, tgt_a) for n in steps}
    loss_err = abs(fs.device_get(first["on"][0]).item() - fs.device_get(first["off"][0]).item())
    param_err = _max_diff(fs.device_get(first["on"][1]), fs.device_get(first["off"][1]))
    if loss_err > 1e-5 or param_err > 1e-5:
        raise AssertionError(f"check_vma on and off differ: loss {loss_err:.2e}, params {param_err:.2e}")

    def runner(n: str) -> Callable[[], None]:
        def go() -> None:
            _, p, s = steps[n](*state[n], tok_a, tgt_a)
            state[n] = (p, s)

        return go

    dist.barrier()
    t = _interleaved({n: runner(n) for n in steps}, args.steps, args.warmup, time.thread_time)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, t)
    if dist.get_rank() == 0:  # the slower rank's medians (each waits for the other in the collectives)
        worst = {n: max(g[n] for g in gathered) for n in ("on", "off")}
        med = {n: (statistics.median(worst[n][0]), statistics.median(worst[n][1])) for n in worst}
        merged = {n: ([med[n][0]], [med[n][1]]) for n in med}
        print(f"  dist check: loss diff {loss_err:.1e}, params after one step {param_err:.1e}", flush=True)
        print(_row(f"dist {args.mesh}: vma on vs off", "off", "on", merged, TARGETS["dist"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="sim,dist", help="which rows: sim, dist or both (default)")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mesh", default="tp=2", help="the dist row's mesh over 2 processes (default tp=2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (>= 4)")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error("--steps must be at least 4")
    rows = {r.strip() for r in args.rows.split(",")}
    if not rows <= {"sim", "dist"}:
        ap.error(f"--rows: sim and/or dist, found {args.rows!r}")
    cfg = _config(args)
    load = os.getloadavg()[0]
    print(
        f"Llama dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, ffn {cfg.ffn_dim}, "
        f"vocab 256: {cfg.num_params():,} params; batch {args.batch} x seq {args.seq}; torch {torch.__version__}"
    )
    print(
        f"{args.steps} interleaved steps per variant after {args.warmup} warmup, medians; host: {os.cpu_count()} "
        f"cpus, 1-min load average {load:.1f} at launch"
    )
    print(HEADER)
    print("-" * len(HEADER))
    if "sim" in rows:
        print(sim_row(args), flush=True)
    if "dist" in rows:
        launch(dist_row, args, WORLD, timeout_s=600)
    print("ratio = fs / base (median wall); cpu r. = the same on CPU time (process for sim, rank thread for dist)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
