"""Overhead of ``shard_map`` over hand-written torch.distributed code: a tensor-parallel MLP step on 2 gloo processes.

The step (Megatron's tensor-parallel MLP, forward + backward):

    x  [batch, d]   replicated                 (requires grad, as the output of an earlier layer would)
    w1 [h, d]       column-parallel P("tp", None)
    w2 [d, h]       row-parallel    P(None, "tp")
    out  = psum_tp(gelu(x @ w1_local.T) @ w2_local.T)           # [b, d]
    loss = mean(out ** 2);  grads of (x, w1, w2)

Five variants, measured in the same job, interleaved step by step (the order rotates every iteration); (a) is the
baseline every ratio is taken against:

    (a) manual : torch.distributed + two ``torch.autograd.Function``s (Megatron's f and g: identity forward /
                 all-reduce backward on the input of the column-parallel layer, all-reduce forward / identity
                 backward on the output of the row-parallel layer)
    (b) fs     : ``fs.shard_map(check_vma=False)`` with ``fs.pvary`` + ``fs.psum``, ``torch.autograd.grad`` inside
    (c) fs+vma : ``fs.shard_map(check_vma=True)``, the same body without the hand-written ``fs.pvary``
    (d) vag    : the step as the README teaches it: ``fs.value_and_grad(loss_fn, argnums=(0, 1, 2))`` inside
                 ``fs.shard_map(check_vma=False)`` (``fs.pvary`` written), ``x`` passed as a plain full tensor
                 each call, ``w1`` / ``w2`` as the ``fs.Array``s a training loop keeps, ``fs.Array``s out
    (e) vag+vma: the same with ``check_vma=True`` (no ``fs.pvary`` written)

All five make the same two all-reduces of a [batch, d] tensor per step, on the same three blocks (one storage
each: a matmul's speed here depends on where its operands lie, +-5% between two copies of one block). (a) calls
``dist.all_reduce`` (gloo's ring); funcshard's synchronous sums whose gathered copies fit in
``FUNCSHARD_ONE_SHOT_BYTES`` are one-shot (``FUNCSHARD_ONE_SHOT_BYTES=0`` compares ring with ring).

Method: the script first checks that the variants agree with each other and with the unsharded model (rtol 1e-4),
and that each funcshard step makes exactly two all-reduces of the expected bytes; then, after ``--warmup``, it
times ``--steps`` rounds, each round every variant once, back to back. The wall time of one step is set by when
the peer process is scheduled as much as by the code (about +-5% a launch at 100 steps on a shared 2-core host),
so each wall ratio comes with a 95% interval (a paired bootstrap over the rounds; it narrows as 1/sqrt(steps)).

Prints: the check line; per variant the median wall ms (the slower rank's), p10, p90, the ratio to (a), its 95%
interval, the target (``TARGETS``: at the small size ``--batch 8 --d 128 --h 512`` and the default 64 x 512 x
2048), the median CPU ms of the calling thread (which leaves out waiting for the peer: steadier on a busy host)
and its ratio to (a); a verdict per target (met: the interval below it; NOT met: above it; else undecided); the
overhead per step over (a), wall and CPU; whether the sums are one-shot; and ``fs.comm_stats()`` of one step.

Measured figures and their history: ``docs/guides/speed.md``.

Usage:
    python bench/shard_map_overhead.py                                 # the large size; spawns 2 gloo processes
    python bench/shard_map_overhead.py --batch 8 --d 128 --h 512 --steps 1000   # the small size
    torchrun --nproc-per-node 2 bench/shard_map_overhead.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import launch

import funcshard as fs
from funcshard import P

WORLD = 2
#: the ratio to (a) each variant should stay under, at the small (--batch 8 --d 128 --h 512) and the default size
TARGETS = {
    "small": {"fs": 1.05, "fs+vma": 1.25, "vag": 1.10, "vag+vma": 1.25},
    "large": {"fs": 1.05, "fs+vma": 1.25, "vag": 1.03, "vag+vma": 1.03},
}


# ---------------------------------------------------------------- (a) hand-written, Megatron style


class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)  # [b, d] -> [b, d]
        return g


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)  # [b, d] -> [b, d]
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def manual_step(x, w1, w2):
    """x, w1, w2: this process's blocks (leaves that require grad)."""
    h = F.gelu(F.linear(CopyToTP.apply(x), w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
    out = ReduceFromTP.apply(F.linear(h, w2))  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
    loss = (out**2).mean()
    grads = torch.autograd.grad(loss, (x, w1, w2))
    return loss.detach(), grads


# ---------------------------------------------------------------- (b), (c) funcshard


def fs_body(explicit_pvary: bool) -> Callable[..., Any]:
    def body(x, w1, w2):
        xin = fs.pvary(x, "tp") if explicit_pvary else x  # check_vma=True inserts this pvary itself
        h = F.gelu(F.linear(xin, w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
        out = fs.psum(F.linear(h, w2), "tp")  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
        loss = (out**2).mean()
        grads = torch.autograd.grad(loss, (x, w1, w2))
        return loss.detach(), grads

    return body


def vag_body(explicit_pvary: bool) -> Callable[..., Any]:
    """The step written with ``fs.value_and_grad``, as the README teaches (no autograd leaves needed)."""

    def loss_fn(x, w1, w2):
        xin = fs.pvary(x, "tp") if explicit_pvary else x  # check_vma=True inserts this pvary itself
        h = F.gelu(F.linear(xin, w1))  # [b, d] @ [d, h/tp] -> [b, h/tp]
        out = fs.psum(F.linear(h, w2), "tp")  # [b, h/tp] @ [h/tp, d] -> [b, d], all-reduce over tp
        return (out**2).mean()

    def body(x, w1, w2):
        return fs.value_and_grad(loss_fn, argnums=(0, 1, 2))(x, w1, w2)

    return body


IN_SPECS = (P(), P("tp", None), P(None, "tp"))
OUT_SPECS = (P(), IN_SPECS)


def reference(x, w1, w2):
    """The unsharded model on full tensors."""
    x, w1, w2 = (t.detach().clone().requires_grad_(True) for t in (x, w1, w2))
    loss = (F.linear(F.gelu(F.linear(x, w1)), w2) ** 2).mean()
    return loss.detach(), torch.autograd.grad(loss, (x, w1, w2))


# ---------------------------------------------------------------- the job


def ratio_interval(
    times_by_rank: list[dict[str, list[float]]], base: str, resamples: int = 400, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """A 95% interval of each variant's median-wall-clock ratio to ``base``, by a paired bootstrap over rounds.

    Round ``i`` ran every variant once, back to back, on every rank; a resample draws rounds with replacement and
    keeps each round whole (the variants' steps of one round share the host's load at that moment), then takes
    each variant's median per rank and the slower rank's, as the printed ratios do.

    Example:
        >>> t = [{"a": [1.0, 1.1, 0.9, 1.0], "b": [1.1, 1.2, 1.0, 1.1]}]
        >>> lo, hi = ratio_interval(t, "a")["b"]
        >>> 1.0 < lo <= hi < 1.25
        True
    """
    rng = random.Random(seed)
    names = list(times_by_rank[0])
    n = min(len(t[base]) for t in times_by_rank)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        med = {name: max(statistics.median([t[name][i] for i in pick]) for t in times_by_rank) for name in names}
        for name in names:
            ratios[name].append(med[name] / med[base])
    out = {}
    for name, rs in ratios.items():
        rs.sort()
        out[name] = (rs[int(0.025 * (len(rs) - 1))], rs[int(0.975 * (len(rs) - 1))])
    return out


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
        raise AssertionError(f"{what}: max abs difference {(a - b).abs().max().item():.3e}")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    lead = rank == 0
    mesh = fs.make_mesh({"tp": WORLD}, backend="dist")

    g = torch.Generator().manual_seed(0)  # every process builds the same full tensors
    b, d, h = args.batch, args.d, args.h
    x_full = torch.randn(b, d, generator=g)
    w1_full = torch.randn(h, d, generator=g) / d**0.5
    w2_full = torch.randn(d, h, generator=g) / h**0.5

    # Every variant computes on the same three blocks (one storage each): the matmuls' speed on this CPU depends on
    # where their operands lie (alignment, cache sets; +-5% between two copies of one block), so separate copies
    # per variant would add a per-launch bias that has nothing to do with the code around the matmuls.
    # device_put under "dist" keeps views of the full tensor (w2's block of P(None, "tp") is a strided column slice):
    # the blocks are made compact unless --view-shards asks for device_put's own.
    arrays = fs.device_put((x_full, w1_full, w2_full), mesh, IN_SPECS)
    if not args.view_shards:
        for a in arrays:
            for c, t in a.shards.items():
                a.shards[c] = t.clone(memory_format=torch.contiguous_format)
    blocks = tuple(a.local.detach() for a in arrays)
    for a in arrays:  # (b), (c): the blocks as leaves needing grad (torch.autograd.grad inside)
        for c, t in a.shards.items():
            a.shards[c] = t.detach().requires_grad_(True)
    # (a): the same storage as its own leaves (compact copies when --view-shards leaves funcshard device_put's views)
    local = tuple(
        (t.clone(memory_format=torch.contiguous_format) if args.view_shards else t.detach()).requires_grad_(True)
        for t in blocks
    )

    step_fs = fs.shard_map(fs_body(True), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=False)
    step_vma = fs.shard_map(fs_body(False), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=True)
    # (d), (e): params kept as Arrays (no autograd leaves: value_and_grad differentiates), x a plain full tensor
    params = fs.device_put((w1_full, w2_full), mesh, IN_SPECS[1:])
    if not args.view_shards:  # the same blocks (storage) as the other variants'
        for a, blk in zip(params, blocks[1:], strict=True):
            for c in a.shards:
                a.shards[c] = blk
    x_in = blocks[0]  # x is replicated: this process's block is the full x
    step_vag = fs.shard_map(vag_body(True), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=False)
    step_vag_vma = fs.shard_map(vag_body(False), mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=True)
    variants: dict[str, Callable[[], Any]] = {
        "manual": lambda: manual_step(*local),
        "fs": lambda: step_fs(*arrays),
        "fs+vma": lambda: step_vma(*arrays),
        "vag": lambda: step_vag(x_in, *params),
        "vag+vma": lambda: step_vag_vma(x_in, *params),
    }
    fs_names = ("fs", "fs+vma", "vag", "vag+vma")

    # -- correctness first: the three variants agree with each other and with the unsharded model
    ref_loss, ref_grads = reference(x_full, w1_full, w2_full)
    m_loss, m_grads = variants["manual"]()
    _close(m_loss, ref_loss, "manual loss vs unsharded")
    for name in fs_names:
        loss, grads = variants[name]()
        _close(loss.local, m_loss, f"{name} loss vs manual")
        for k, gr, gm, gref in zip(("x", "w1", "w2"), grads, m_grads, ref_grads, strict=True):
            _close(gr.local, gm, f"{name} grad {k} (local block) vs manual")
            _close(fs.device_get(gr), gref, f"{name} grad {k} (gathered) vs unsharded")
    for k, gm, gref, a in zip(("x", "w1", "w2"), m_grads, ref_grads, arrays, strict=True):
        # the manual variant's block vs this process's block of the unsharded gradient
        _close(gm, fs.device_put(gref, mesh, a.spec).local, f"manual grad {k} (local block) vs unsharded")
    if lead:
        print(f"check: manual, {', '.join(fs_names)} agree (loss {m_loss.item():.6f}; unsharded {ref_loss.item():.6f})")

    # -- communication of one funcshard step
    all_stats = []
    for name in fs_names:
        with fs.comm_stats() as s:
            variants[name]()
        all_stats.append(s)
    stats = all_stats[0]
    payload = b * d * x_full.element_size()  # one [b, d] fp32 all-reduce
    for s in all_stats:
        assert s.calls("psum", "tp") == 2, s.table()  # forward psum + backward psum of the pvary on x
        assert s.bytes("psum", "tp") == 2 * payload, s.table()
        assert s.calls() == 2, s.table()

    # -- timing: warmup, then interleaved steps (the order rotates so no variant always runs first)
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}  # wall clock
    cpu: dict[str, list[float]] = {n: [] for n in names}  # CPU time of this thread (excludes waiting)
    for _ in range(args.warmup):
        for n in names:
            variants[n]()
    dist.barrier()
    for i in range(args.steps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            c0, t0 = time.thread_time(), time.perf_counter()
            variants[n]()
            t1, c1 = time.perf_counter(), time.thread_time()
            times[n].append(t1 - t0)
            cpu[n].append(c1 - c0)
    # every rank waits for the other in the all-reduces; report the slower rank's medians
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, cpu))
    med = {n: max(statistics.median(t[n]) for t, _ in every) * 1e3 for n in names}
    med_cpu = {n: max(statistics.median(c[n]) for _, c in every) * 1e3 for n in names}
    interval = ratio_interval([t for t, _ in every], "manual")

    if lead:
        print()
        print(
            f"TP MLP step (fwd + bwd), tp={WORLD} gloo processes, 1 thread each; "
            f"batch {b}, d {d}, h {h}; torch {torch.__version__}"
        )
        print(f"{args.steps} interleaved steps per variant after {args.warmup} warmup; median (max over ranks)")
        if args.view_shards:
            print("funcshard inputs: device_put's shards as they are (views of the full tensors)")
        load, ncpu = args.load_before, os.cpu_count() or 1
        busy = "  (busy host: expect noisy wall-clock ratios; the cpu columns are steadier)" if load > ncpu else ""
        print(f"host: {ncpu} cpus, 1-min load average {load:.1f} at launch{busy}")
        print()
        print(
            f"{'variant':<34} {'median ms':>10} {'p10':>7} {'p90':>7} {'/ (a)':>7} {'95% interval':>13}"
            f" {'target':>8} {'cpu ms':>8} {'cpu / (a)':>9}"
        )
        print("-" * 111)
        labels = {
            "manual": "(a) torch.distributed + Functions",
            "fs": "(b) shard_map(check_vma=False)",
            "fs+vma": "(c) shard_map(check_vma=True)",
            "vag": "(d) value_and_grad, vma off",
            "vag+vma": "(e) value_and_grad, vma on",
        }
        small = (b, d, h) == (8, 128, 512)
        targets = TARGETS["small" if small else "large"] if small or (b, d, h) == (64, 512, 2048) else {}
        for n in names:
            q = statistics.quantiles(times[n], n=10)
            target = f"<= {targets[n]:.2f}" if n in targets else ""
            lo, hi = interval[n]
            print(
                f"{labels[n]:<34} {med[n]:>10.3f} {q[0] * 1e3:>7.2f} {q[-1] * 1e3:>7.2f} {med[n] / med['manual']:>7.3f}"
                f" {f'{lo:.3f}-{hi:.3f}':>13} {target:>8} {med_cpu[n]:>8.3f} {med_cpu[n] / med_cpu['manual']:>9.3f}"
            )
        verdicts = []
        for n in fs_names:
            if n in targets:
                lo, hi = interval[n]
                word = "met" if hi <= targets[n] else "NOT met" if lo > targets[n] else "undecided (widen --steps)"
                verdicts.append(f"{labels[n][:3]} {word}")
        if verdicts:
            print("targets by the 95% interval of the wall ratio: " + ";  ".join(verdicts))
        print()
        print(
            "ratios (median wall clock): "
            + "   ".join(f"{labels[n][:3]}/(a) = {med[n] / med['manual']:.3f}" for n in fs_names)
        )
        print(
            "overhead per step: "
            + ";  ".join(
                f"{labels[n][:3]} {med[n] - med['manual']:+.3f} ms wall, {med_cpu[n] - med_cpu['manual']:+.3f} ms cpu"
                for n in fs_names
            )
        )
        print("(cpu = CPU time of the calling thread, which leaves out waiting for the peer: steadier on a busy host)")
        from funcshard._src.runtime.backends import dist as dist_backend

        limit = dist_backend._ONE_SHOT_BYTES
        print(
            f"funcshard's all-reduces whose gathered copies take <= {limit:,} bytes are one-shot (gather, then sum in"
            " order); FUNCSHARD_ONE_SHOT_BYTES=0 runs gloo's ring all-reduce, as (a) does"
            if limit
            else "funcshard's all-reduces: gloo's ring all-reduce, as (a)'s (FUNCSHARD_ONE_SHOT_BYTES=0)"
        )
        print()
        print("communication of one funcshard step (rank 0; the same for every funcshard variant):")
        print(stats.table())
        print(f"expected: 2 all-reduces of [{b}, {d}] fp32 = 2 x {payload:,} bytes (the manual variant makes the same)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--d", "--dim", dest="d", type=int, default=512)  # (--dim under torchrun: it takes --d as its own)
    ap.add_argument("--h", "--hidden", dest="h", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--steps",
        type=int,
        default=400,
        help="timed steps per variant (>= 20; the 95%% interval of a wall ratio narrows as 1/sqrt(steps))",
    )
    ap.add_argument(
        "--view-shards",
        action="store_true",
        help="give funcshard the shards exactly as fs.device_put makes them (views of the full tensors)",
    )
    args = ap.parse_args(argv)
    if args.steps < 20:
        ap.error("--steps must be at least 20")
    args.load_before = os.getloadavg()[0]
    launch(run, args, WORLD, timeout_s=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
