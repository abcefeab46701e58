"""funcshard against what a torchrun user would pick instead: the Llama train step on 2 or 4 gloo processes.

Each case runs one funcshard step and its torch peer on the same processes, from the same weights:

- ``dp``: mesh ``{"dp": procs}`` vs ``DistributedDataParallel``;
- ``fsdp``: mesh ``{"fsdp": procs}`` (``Config()``: remat none, reshard after forward: each layer's weights
  gathered again for its backward) vs FSDP2 ``fully_shard`` on every block and on the root, its default (blocks
  reshard after forward);
- ``fsdp_keep``: ``Config(reshard_after_forward=False)`` (the gathered weights kept for the backward) vs FSDP2
  with ``reshard_after_forward=False``;
- ``tp``: mesh ``{"tp": procs}`` vs DTensor ``parallelize_module`` (torchtitan's plan, ``loss_parallel``);

the peers on the ``nn.Module`` twin of ``bench/_memory_peers.py``, funcshard's initial weights loaded into it
(``bench/_peers_twin.py``). ``--size small`` is the train job's model (3.1M parameters, batch 16 x 128), ``--size
large`` the 13.2M-parameter one (batch 8 x 256).

The funcshard step is what the train job runs: ``shard_map`` of ``llama.value_and_grad`` and AdamW's update,
donating params and moments (check_vma on). The peer step is ``loss.backward()``, ``torch.optim.AdamW.step()`` with
the same hyper-parameters, then ``zero_grad(set_to_none=True)`` (at the end, so that the peer holds no gradients
while the interleaved funcshard step runs, which would otherwise have to fault in fresh heap pages).

Method: before timing, both losses are checked to agree at step 0 and after one AdamW step (rtol 1e-4; the
script exits if not). Then per repeat: ``--warmup`` steps each, then ``--steps`` steps each, A/B interleaved (the
order flips every step), each step timed from a barrier to a barrier on every rank (the max over ranks of the
wall time; the sum over ranks of the CPU time, every thread); the repeat's ratio is median(funcshard) /
median(peer).

Prints, per case: the losses at steps 0 and 1 of both sides; the gloo calls each side issues per step (seen by
``torch.profiler``) and funcshard's ``fs.comm_stats`` table; ``--ops N``: the N torch ops whose self CPU time
differs most between the two sides' steps; ``--profile CASE``: a cProfile of rank 0's funcshard steps; then
``funcshard / peer = ratio`` with every repeat's ratio, the median step times, the CPU-time ratio and the load
(``os.getloadavg()``) before and after. At the end, one table of every case: ratio (the median over repeats,
THE number), spread (min-max over repeats), CPU ratio, median ms of each side, gloo calls per step (funcshard /
peer) and load. Lower is better; the CPU ratio is the steadier measure on a loaded host.

Measured figures and their history: ``docs/guides/speed.md``.

Usage:
    python bench/vs_peers.py --size small --procs 2 --steps 3 --repeats 1       # 1-2 min on a quiet host
    python bench/vs_peers.py --size large --procs 2 --cases dp,fsdp,tp
    python bench/vs_peers.py --size large --procs 4 --cases fsdp
    FUNCSHARD_OVERLAP=0 python bench/vs_peers.py ...                              # overlap off
    python bench/vs_peers.py --profile fsdp                                       # cProfile of rank 0's funcshard steps
    torchrun --nproc-per-node 2 bench/vs_peers.py --procs 2
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import _memory_peers as peers
import _peers_twin as twin
import torch
import torch.distributed as dist
from _launch import launch

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CASES = ("dp", "fsdp", "fsdp_keep", "tp")
MESH_AXIS = {"dp": "dp", "fsdp": "fsdp", "fsdp_keep": "fsdp", "tp": "tp"}
PEER = {"dp": "DDP", "fsdp": "FSDP2", "fsdp_keep": "FSDP2(keep)", "tp": "DTensor TP"}
# --size -> (dim, layers, heads, kv heads, ffn, seq, global batch): the train job's 3.1M Llama, the 13.2M one
SIZES = {"small": (256, 4, 8, 4, 704, 128, 16), "large": (384, 8, 8, 4, 1024, 256, 8)}
LR = 1e-3


def _config(size: str) -> llama.Config:
    dim, layers, heads, kv, ffn, seq, _ = SIZES[size]
    return llama.Config(
        vocab_size=256, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, max_seq_len=seq
    )


class Side:
    """One side of a case: ``step()`` takes one train step on the fixed batch and returns its (global) loss
    as a float when ``read`` is set (a collective: every rank calls it)."""

    def __init__(self, name: str, step: Callable[[bool], float | None]) -> None:
        self.name, self.step = name, step


def _funcshard(case: str, cfg: llama.Config, tokens: torch.Tensor, targets: torch.Tensor, args: Any) -> Side:
    mesh = fs.make_mesh({MESH_AXIS[case]: args.procs}, backend="dist")
    if case == "fsdp_keep":  # the gathered weights kept for the backward, as the peer's reshard_after_forward=False
        cfg = dataclasses.replace(cfg, reshard_after_forward=False)
    specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
    opt = fs.optim.adamw(LR, b2=0.95)  # as the torch baseline below
    sspecs = opt.state_specs(specs)
    params = fs.device_put(llama.init(fs.random.key(0), cfg), mesh, specs)
    state = fs.shard_map(opt.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs)(params)
    x, y = (fs.device_put(t, mesh, bs) for t in (tokens, targets))

    def body(p: Any, s: Any, t: torch.Tensor, u: torch.Tensor) -> tuple[Any, Any, Any]:
        loss, grads = llama.value_and_grad(p, t, u, cfg)
        p, s = opt.update(grads, s, p)
        return loss, p, s

    compile_opt = {"backend": args.compile} if args.compile else False
    train = fs.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, sspecs, bs, bs),
        out_specs=(P(), specs, sspecs),
        donate=(0, 1),
        compile=compile_opt,
    )
    box = [params, state]

    def step(read: bool) -> float | None:
        loss, box[0], box[1] = train(box[0], box[1], x, y)
        return float(fs.device_get(loss)) if read else None

    return Side("funcshard", step)


def _peer(case: str, cfg: llama.Config, tokens: torch.Tensor, targets: torch.Tensor, args: Any) -> Side:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = twin.load_params(peers.build(cfg), llama.init(fs.random.key(0), cfg))
    if case == "tp":
        from torch.distributed.tensor.parallel import loss_parallel

        model = twin.tp_parallelize(model, world)
        local = (tokens, targets)  # every rank sees the whole batch
    else:
        per = tokens.shape[0] // world
        local = (tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per])
        if case == "dp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            kw = {"reshard_after_forward": False} if case == "fsdp_keep" else {}
            for block in model.layers:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step(read: bool) -> float | None:
        if case == "tp":
            with loss_parallel():
                loss = twin.tp_loss(model, *local)
                loss.backward()
        else:
            loss = peers.module_loss(model, *local)
            loss.backward()
        opt.step()
        # zeroed at the end of the step (HF Trainer's order; the same arithmetic as zeroing first): the peer holds no
        # gradients while funcshard's step runs in between, which would make that step fault in fresh heap pages
        opt.zero_grad(set_to_none=True)
        if not read:
            return None
        value = loss.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if case != "tp":  # each rank's loss is over its own (equal-sized) slice: the global mean is their mean
            value = value.clone()
            dist.all_reduce(value)
            value /= world
        return float(value)

    return Side(PEER[case], step)


def _timed(side: Side) -> tuple[float, float]:
    """One step from a barrier to a barrier: (the max over ranks of its wall seconds, the sum over ranks of the
    CPU seconds the processes used in it, every thread: compute, Python and gloo's)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    side.step(False)
    c1 = time.process_time()
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([c1 - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu)


def _profiled(side: Side) -> tuple[Counter[str], dict[str, tuple[int, float]]]:
    """One step of ``side`` under torch.profiler on this rank: the gloo collectives it issues (``gloo:*``
    events), and per torch op its (calls, self CPU ms), every thread."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step(False)
    calls = Counter(e.name.removeprefix("gloo:") for e in prof.events() if e.name.startswith("gloo:"))
    ops = {a.key: (a.count, a.self_cpu_time_total / 1e3) for a in prof.key_averages()}
    return calls, ops


def _op_diff(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]], top: int) -> str:
    """The ``top`` ops whose self CPU time differs most between ``a`` (funcshard) and ``b`` (the peer)."""
    keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1]))
    lines = [f"  {'op':<44} {'fs calls':>8} {'fs ms':>8} {'peer calls':>10} {'peer ms':>8}"]
    for k in keys[:top]:
        (ca, ta), (cb, tb) = a.get(k, (0, 0.0)), b.get(k, (0, 0.0))
        lines.append(f"  {k[:44]:<44} {ca:>8} {ta:>8.1f} {cb:>10} {tb:>8.1f}")
    tot_a, tot_b = sum(t for _, t in a.values()), sum(t for _, t in b.values())
    lines.append(f"  {'total self CPU (this rank, one step)':<44} {'':>8} {tot_a:>8.1f} {'':>10} {tot_b:>8.1f}")
    return "\n".join(lines)


def _fmt_calls(c: Counter[str]) -> str:
    return f"{sum(c.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) + ")"


def _case(case: str, args: Any, out: list[dict[str, Any]]) -> None:
    lead = dist.get_rank() == 0
    cfg = _config(args.size)
    seq, batch = SIZES[args.size][5], SIZES[args.size][6]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, seq), generator=g)
    targets = tokens.roll(-1, dims=1)
    fs_side = _funcshard(case, cfg, tokens, targets, args)
    peer_side = _peer(case, cfg, tokens, targets, args)
    sides = (fs_side, peer_side)

    # -- the same numbers: loss at step 0 (before any update) and at step 1 (after one AdamW step)
    losses = [[s.step(True) for _ in range(2)] for s in sides]
    ok = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses[0], losses[1], strict=True))
    if lead:
        print(
            f"[{case}] losses step0 / step1: funcshard {losses[0][0]:.6f} / {losses[0][1]:.6f}, "
            f"{peer_side.name} {losses[1][0]:.6f} / {losses[1][1]:.6f}: {'equal (rtol 1e-4)' if ok else 'DIFFER'}",
            flush=True,
        )
    if not ok:
        raise SystemExit(f"[{case}] funcshard and {peer_side.name} disagree: {losses}")

    # -- the collectives per step
    prof = [_profiled(s) for s in sides]
    calls = [c for c, _ in prof]
    with fs.comm_stats() as stats:
        fs_side.step(False)
    if lead:
        both = f"funcshard {_fmt_calls(calls[0])}; {peer_side.name} {_fmt_calls(calls[1])}"
        print(f"[{case}] gloo calls per step: {both}")
        print(f"[{case}] fs.comm_stats of one step:\n{stats.table()}", flush=True)
        if args.ops:
            print(f"[{case}] torch ops, rank 0, one step each:\n{_op_diff(prof[0][1], prof[1][1], args.ops)}")

    if args.profile == case:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            fs_side.step(False)
        prof.disable()
        if lead:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(f"[{case}] cProfile of rank 0, {args.steps} funcshard steps, by own time:\n{s.getvalue()[:6000]}")

    # -- timing: per repeat, warm-up, then interleaved steps (the order flips every step)
    load0 = os.getloadavg()
    ratios, meds, cpu_ratios = [], [], []
    for _ in range(args.repeats):
        for _ in range(args.warmup):
            for s in sides:
                _timed(s)
        times: list[list[float]] = [[], []]
        cpus: list[list[float]] = [[], []]
        for i in range(args.steps):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for j in order:
                wall, cpu = _timed(sides[j])
                times[j].append(wall)
                cpus[j].append(cpu)
        med = [statistics.median(t) for t in times]
        meds.append(med)
        ratios.append(med[0] / med[1])
        cpu_ratios.append(statistics.median(cpus[0]) / statistics.median(cpus[1]))
    load1 = os.getloadavg()
    row = {
        "case": case,
        "procs": args.procs,
        "size": args.size,
        "params": cfg.num_params(),
        "ratio": statistics.median(ratios),
        "spread": (min(ratios), max(ratios)),
        "cpu_ratio": statistics.median(cpu_ratios),
        "fs_ms": statistics.median(m[0] for m in meds) * 1e3,
        "peer_ms": statistics.median(m[1] for m in meds) * 1e3,
        "peer": peer_side.name,
        "load": (load0[0], load1[0]),
        "calls": (sum(calls[0].values()), sum(calls[1].values())),
    }
    out.append(row)
    if lead:
        print(
            f"[{case}] funcshard / {peer_side.name} = {row['ratio']:.3f}  (repeats: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f"; medians {row['fs_ms']:.1f} / {row['peer_ms']:.1f} ms; CPU time ratio {row['cpu_ratio']:.3f}; "
            f"load {load0[0]:.2f} -> {load1[0]:.2f})",
            flush=True,
        )


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out: list[dict[str, Any]] = []
    for case in args.cases:
        _case(case, args, out)
    if dist.get_rank() == 0:
        overlap = os.environ.get("FUNCSHARD_OVERLAP", "1")
        print(
            f"\n{args.size} Llama ({out[0]['params']:,} params), {args.procs} gloo procs, {args.steps} steps x "
            f"{args.repeats} repeats, FUNCSHARD_OVERLAP={overlap}, compile={args.compile or 'off'}"
        )
        head = f"{'case':<10} {'peer':<12} {'ratio':>6} {'spread':>13} {'cpu':>6} {'fs ms':>8} {'peer ms':>8}"
        print(f"{head} {'calls':>9} load")
        for r in out:
            lo, hi = r["spread"]
            print(
                f"{r['case']:<10} {r['peer']:<12} {r['ratio']:>6.3f} {lo:>6.3f}-{hi:<6.3f} {r['cpu_ratio']:>6.3f} "
                f"{r['fs_ms']:>8.1f} "
                f"{r['peer_ms']:>8.1f} {r['calls'][0]:>4}/{r['calls'][1]:<4} {r['load'][0]:.2f}->{r['load'][1]:.2f}"
            )
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--procs", type=int, choices=(2, 4), default=2)
    ap.add_argument("--cases", default="dp,fsdp,tp", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per side and repeat (the median is taken)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--compile", default="", help="a torch.compile backend for funcshard's step (default: eager)")
    ap.add_argument("--profile", default="", help="a case: cProfile rank 0's funcshard steps of it")
    ap.add_argument("--ops", type=int, default=0, help="print the N torch ops whose CPU time differs most per case")
    args = ap.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}; use some of {', '.join(CASES)}")
    launch(run, args, world=args.procs, timeout_s=600)


if __name__ == "__main__":
    main()
