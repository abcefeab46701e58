"""Tokens/s of the Llama train step (loss + grads + AdamW in one ``shard_map``) per mesh, against the unsharded step.

The step, for every mesh below and for the unsharded reference (the same model, batch and optimiser on plain full
tensors, no shard_map):

    loss, grads = fs.value_and_grad(llama.loss)(params, tokens, targets)
    params, state = fs.optim.adamw(lr).update(grads, state, params)

Meshes (4 devices): dp=4, fsdp=4, tp=4, tp=4 + sequence parallel, dp=2 x tp=2, fsdp=2 x tp=2.

All meshes use the ``sim`` backend: the 4 devices are threads of THIS process, sharing this machine's CPU cores.
Sim tokens/s therefore measure the library's overhead plus the compute on a shared CPU: they are NOT a measure of
parallel scaling, and a ratio below 1 does not mean the parallel style is slow on real devices. What they do show
is the cost of the machinery (shard_map, vma tracking, collectives through the in-process exchange) relative to
the plain torch step, measured in the same process.

Method: each mesh's step is first checked against the unsharded step (same loss, same gradients). Then,
after warmup, unsharded and sharded steps alternate (A/B interleaved, the order flipping every step), each a
real training step fed the previous step's params and optimiser state; the table shows medians. The ratio uses
the unsharded steps interleaved with that mesh, so a slow spell on the host weighs on both sides alike. The
communication per step is counted by ``fs.comm_stats`` on device 0 (forward and backward collectives, payload
= the size of one device's input tensor).

Prints: a banner saying the devices are simulated, the model, then one row per mesh (and the unsharded step):
ms per step, tokens/s, the interleaved unsharded ms, the tokens/s ratio to the unsharded step (> 1: faster), the
collectives one device makes per step and the MB it passes in; then each mesh's collectives by kind and axis.

Usage:
    python bench/train_step.py                 # ~2 minutes on 2 cores
    python bench/train_step.py --steps 20 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

MESHES: dict[str, tuple[dict[str, int], bool]] = {
    "dp=4": ({"dp": 4}, False),
    "fsdp=4": ({"fsdp": 4}, False),
    "tp=4": ({"tp": 4}, False),
    "tp=4 +SP": ({"tp": 4}, True),
    "dp=2 x tp=2": ({"dp": 2, "tp": 2}, False),
    "fsdp=2 x tp=2": ({"fsdp": 2, "tp": 2}, False),
}
B1 = 0.9  # AdamW's first-moment decay (the check reads the gradients off the first moment)


def make_step(cfg: llama.Config, opt: fs.optim.Optimizer) -> Callable[..., Any]:
    """The train step as one pure function: ``(params, state, tokens, targets) -> (loss, params, state)``."""

    def step(params: Any, state: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any, Any]:
        loss, grads = fs.value_and_grad(lambda p: llama.loss(p, tokens, targets, cfg))(params)
        params, state = opt.update(grads, state, params)
        return loss, params, state

    return step


def _max_diff(a: Any, b: Any) -> float:
    la, lb = fs.pytree.leaves_with_path(a), fs.pytree.leaves_with_path(b)
    return max((x - y).abs().max().item() for (_, x), (_, y) in zip(la, lb, strict=True))


def _comm_summary(stats: fs.CommStats) -> str:
    """``psum[dp] 23`` style summary of the calls per (collective, axis) on device 0."""
    rows = stats.rows()
    return ", ".join(f"{n}[{a}] {c}" for (n, a), (c, _) in rows.items()) if rows else "-"


def bench_mesh(
    name: str,
    shape: dict[str, int],
    sp: bool,
    base_cfg: llama.Config,
    args: argparse.Namespace,
    params0: Any,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> dict[str, Any]:
    cfg = dataclasses.replace(base_cfg, sequence_parallel=sp)
    opt = fs.optim.adamw(args.lr, b1=B1)
    mesh = fs.make_mesh(shape, backend="sim")
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    sspecs = opt.state_specs(specs)
    sharded = fs.shard_map(
        make_step(cfg, opt),
        mesh=mesh,
        in_specs=(specs, sspecs, bs, bs),
        out_specs=(P(), specs, sspecs),
        check_vma=not args.no_check_vma,
    )
    unsharded = make_step(base_cfg, opt)

    # inputs laid out once, as a training loop would keep them; outputs come back in the same layouts
    tok_a, tgt_a = fs.device_put(tokens, mesh, bs), fs.device_put(targets, mesh, bs)
    p_sh = fs.device_put(params0, mesh, specs)
    s_sh = opt.init(p_sh)
    p_un, s_un = params0, opt.init(params0)

    # correctness first: one step from the same state gives the same loss, gradients and new params. The
    # gradients are read off AdamW's first moment (mu = (1 - b1) * grads after one step); the params are only
    # reported: Adam's first step moves each weight by ~lr * sign(grad), so a gradient within rounding of 0
    # may legitimately move the other way.
    loss_un, p1_un, s1_un = unsharded(p_un, s_un, tokens, targets)
    loss_sh, p1_sh, s1_sh = sharded(p_sh, s_sh, tok_a, tgt_a)
    loss_err = abs(fs.device_get(loss_sh).item() - loss_un.item())
    grad_err = _max_diff(fs.device_get(s1_sh.mu), s1_un.mu) / (1 - B1)
    param_err = _max_diff(fs.device_get(p1_sh), p1_un)
    if loss_err > 1e-5 or grad_err > 1e-5:
        raise AssertionError(f"{name}: sharded step differs from unsharded (loss {loss_err:.2e}, grads {grad_err:.2e})")

    with fs.comm_stats() as stats:
        sharded(p_sh, s_sh, tok_a, tgt_a)

    state = {"un": (p_un, s_un), "sh": (p_sh, s_sh)}

    def run_un() -> None:
        _, p, s = unsharded(*state["un"], tokens, targets)
        state["un"] = (p, s)

    def run_sh() -> None:
        _, p, s = sharded(*state["sh"], tok_a, tgt_a)
        state["sh"] = (p, s)

    for _ in range(args.warmup):
        run_un()
        run_sh()
    times: dict[str, list[float]] = {"un": [], "sh": []}
    for i in range(args.steps):
        order = (("un", run_un), ("sh", run_sh)) if i % 2 == 0 else (("sh", run_sh), ("un", run_un))
        for key, fn in order:
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {
        "name": name,
        "ms_un": statistics.median(times["un"]) * 1e3,
        "ms_sh": statistics.median(times["sh"]) * 1e3,
        "calls": stats.calls(),
        "mb": stats.bytes() / 1e6,
        "summary": _comm_summary(stats),
        "loss_err": loss_err,
        "grad_err": grad_err,
        "param_err": param_err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant and mesh (>= 10)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (each simulated device runs with this many)"
    )
    ap.add_argument("--no-check-vma", action="store_true", help="shard_map(check_vma=False)")
    ap.add_argument("--mesh", action="append", choices=list(MESHES), help="only these meshes (repeatable)")
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be at least 10")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = llama.Config(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
    )
    params0 = llama.init(fs.random.key(0), cfg)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    tok_per_step = args.batch * args.seq

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print("=" * 100)
    print(f"SIMULATED DEVICES: every mesh runs its 4 devices as threads of this one process on {cores} CPU core(s).")
    print("Sim tokens/s = library overhead + compute on a shared CPU; NOT real parallel scaling. A ratio < 1 is")
    print("expected here and says nothing about these parallel styles on real devices.")
    print("=" * 100)
    print(
        f"Llama vocab {cfg.vocab_size}, dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / "
        f"{cfg.n_kv_heads} kv heads, ffn {cfg.ffn_dim}: {cfg.num_params():,} params, float32"
    )
    print(
        f"global batch {args.batch} x seq {args.seq} = {tok_per_step} tokens/step; step = loss + grads + AdamW in one "
        f"shard_map (check_vma={not args.no_check_vma}); torch {torch.__version__}, {args.threads} intra-op thread(s)"
    )
    print(
        f"{args.steps} timed steps per variant after {args.warmup} warmup, unsharded and sharded interleaved "
        "(order flips every step); medians"
    )
    print()

    rows = []
    for name in args.mesh or list(MESHES):
        shape, sp = MESHES[name]
        t0 = time.perf_counter()
        rows.append(bench_mesh(name, shape, sp, cfg, args, params0, tokens, targets))
        r = rows[-1]
        print(
            f"  {name:<14} done in {time.perf_counter() - t0:5.1f} s  (check vs unsharded: loss diff "
            f"{r['loss_err']:.1e}, grads {r['grad_err']:.1e}, params after 1 step {r['param_err']:.1e})",
            flush=True,
        )
    print()

    ms_un_all = statistics.median(r["ms_un"] for r in rows)
    header = (
        f"{'mesh':<15} {'ms/step':>9} {'tokens/s':>10} {'unsharded ms':>13} {'tok/s ratio':>12}"
        f" {'comm calls':>11} {'comm MB/dev':>12}"
    )
    print(header)
    print("-" * len(header))
    print(
        f"{'unsharded':<15} {ms_un_all:>9.1f} {tok_per_step / ms_un_all * 1e3:>10,.0f} {ms_un_all:>13.1f} "
        f"{1.0:>12.3f} {0:>11} {0.0:>12.3f}"
    )
    for r in rows:
        ratio = r["ms_un"] / r["ms_sh"]  # sharded tokens/s over the interleaved unsharded tokens/s
        print(
            f"{r['name']:<15} {r['ms_sh']:>9.1f} {tok_per_step / r['ms_sh'] * 1e3:>10,.0f} {r['ms_un']:>13.1f} "
            f"{ratio:>12.3f} {r['calls']:>11} {r['mb']:>12.3f}"
        )
    print("-" * len(header))
    print("tok/s ratio = sharded tokens/s / tokens/s of the unsharded steps interleaved with that mesh (>1: faster)")
    print("unsharded row: median over the meshes' unsharded medians")
    print("comm: collectives one device makes per step (fwd + bwd + optimiser) and the MB it passes in (fs.comm_stats)")
    print()
    print("collectives per step on device 0, calls per (collective[axis]):")
    for r in rows:
        print(f"  {r['name']:<15} {r['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
