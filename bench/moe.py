"""The MoE layer's experts: grouped matmuls (``funcshard.ops.moe``) against a per-expert loop, in one process.

Part ``experts`` (the acceptance: the grouped path at least 1.5x faster than the loop): a top-k MoE layer over
``--tokens`` tokens with ``--experts`` SwiGLU experts of ``[--f, --d]``, forward alone and forward + backward (the
gradients of the tokens and of every weight). Every variant routes by :func:`funcshard.ops.moe.route` (the same
expert ids); they differ in how the experts run:

    (a) loop     : Hugging Face's ``MixtralExperts.forward`` (transformers 5): per expert, ``torch.where`` over its
                   one-hot mask, gather its tokens, gate / up / down ``F.linear``, times the routing weights,
                   ``index_add_`` into the output -- the baseline every ratio is taken against
    (b) torch    : ``moe_ffn(axis=None, impl="torch")`` (``torch._grouped_mm``): one stable sort of the
                   assignments, one gather, one grouped matmul per projection, one weighted sum
    (c) segments : the same with ``impl="segments"`` (one ``torch.mm`` per expert over ``x.split(counts)``)
    (d) triton   : the same with ``impl="triton"`` (only on CUDA)

Part ``mm`` (for reference): one projection alone, ``grouped_mm`` against a Python loop of
``x[rows of e] @ w[e].T`` over the same sorted rows (no gather, no scatter: the matmuls themselves, so here the
grouped call can only save the loop's overhead, which is small at these sizes on CPU).

Part ``ep`` (expert parallelism over a mesh, dispatch by ``ragged_all_to_all``): a seam, :func:`bench_ep`, for the
Mixtral work to fill.

Method: every variant is run once (warmup), then ``--rounds`` rounds, each round every variant once in a rotating
order; a ratio is the baseline's median time over the variant's (forward alone, and forward + backward), for the
wall time and for the process's CPU time (on a shared host the wall time of a round depends on the other jobs as
much as on the code: ``--threads 1`` and the CPU figures are the steadier measure there). The variants are first
checked to agree (rtol 1e-4).

Usage:
    python bench/moe.py                                   # 4096 tokens x top-2, d=512, f=1024, 8 experts
    python bench/moe.py --tokens 1024 --d 256 --f 512 --rounds 10
    python bench/moe.py --parts mm
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from funcshard.ops import moe

Fn = Callable[..., torch.Tensor]


def make(args: argparse.Namespace) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tokens ``[T, d]`` and the layer's params (``router``, ``w1``, ``w3``, ``w2``)."""
    g = torch.Generator().manual_seed(0)
    e, d, f = args.experts, args.d, args.f
    x = torch.randn(args.tokens, d, generator=g)
    p = {
        "router": torch.randn(e, d, generator=g) * 0.05,
        "w1": torch.randn(e, f, d, generator=g) * d**-0.5,
        "w3": torch.randn(e, f, d, generator=g) * d**-0.5,
        "w2": torch.randn(e, d, f, generator=g) * f**-0.5,
    }
    return x.to(args.device), {n: t.to(args.device) for n, t in p.items()}


def loop_layer(x: torch.Tensor, p: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """(a) the router, then Hugging Face's ``MixtralExperts.forward``: one masked gather, three matmuls and a
    scatter per expert."""
    n_experts = p["w1"].shape[0]
    weights, ids, _ = moe.route(x, p["router"], k)
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(ids, n_experts).permute(2, 1, 0)  # [E, k, T]
    for e in range(n_experts):
        slot, tok = torch.where(mask[e])
        h = x[tok]  # [T_e, d]
        y = F.linear(F.silu(F.linear(h, p["w1"][e])) * F.linear(h, p["w3"][e]), p["w2"][e])  # [T_e, d]
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def grouped_layer(impl: str) -> Fn:
    """(b)-(d) ``moe_ffn(axis=None, impl=impl)``: the router, one sort, one gather, one grouped matmul per
    projection, one weighted sum."""
    return lambda x, p, k: moe.moe_ffn(x, p, k, axis=None, impl=impl)


def _time(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[float, float]:
    """``(wall s, CPU s of this process)`` of one call."""
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(variants: dict[str, Callable[[bool], object]], rounds: int, sync: Callable[[], None]) -> dict:
    """``{name: {False: [fwd (wall, cpu) s], True: [fwd+bwd ...]}}``: one warmup each, then rounds in rotating
    order."""
    times: dict[str, dict[bool, list[tuple[float, float]]]] = {n: {False: [], True: []} for n in variants}
    names = list(variants)
    for bwd in (False, True):
        for n in names:
            _time(lambda n=n, b=bwd: variants[n](b), sync)
        for r in range(rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                times[n][bwd].append(_time(lambda n=n, b=bwd: variants[n](b), sync))
    return times


def _step(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor], k: int) -> Callable[[bool], object]:
    def go(bwd: bool) -> object:
        xx = x.detach().requires_grad_(bwd)
        pp = {n: t.detach().requires_grad_(bwd) for n, t in p.items()}
        y = fn(xx, pp, k)
        if bwd:
            torch.autograd.grad(y.square().sum(), [xx, *pp.values()])
        return y

    return go


def report(title: str, times: dict, base: str) -> None:
    """Per variant: the median wall ms and CPU ms (this process: steadier on a shared host) of the forward and of
    forward + backward, each with its ratio to ``base`` (the baseline's median over the variant's)."""

    def med(name: str, bwd: bool, which: int) -> float:
        return statistics.median(t[which] for t in times[name][bwd])

    print(f"\n{title}")
    head = "".join(f"{f'{p} {u} ms':>16}{'x ' + base:>8}" for p in ("fwd", "fwd+bwd") for u in ("wall", "cpu"))
    print(f"{'variant':<10}{head}")
    for n in times:
        cells = [(med(n, b, w), med(base, b, w) / med(n, b, w)) for b in (False, True) for w in (0, 1)]
        print(f"{n:<10}" + "".join(f"{v * 1e3:>16.1f}{r:>8.2f}" for v, r in cells))


def bench_experts(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    x, p = make(args)
    fns = {"loop": loop_layer} | {i: grouped_layer(i) for i in _impls(args)}
    ref = loop_layer(x, p, args.k)
    for n, fn in fns.items():
        torch.testing.assert_close(fn(x, p, args.k), ref, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    times = measure({n: _step(fn, x, p, args.k) for n, fn in fns.items()}, args.rounds, sync)
    report(f"layer: {args.tokens} tokens x top-{args.k}, {args.experts} experts, d={args.d}, f={args.f}", times, "loop")


def bench_mm(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    x, p = make(args)
    flat = moe.route(x, p["router"], args.k)[1].reshape(-1)
    rows = x.index_select(0, torch.sort(flat, stable=True).indices // args.k)  # [T*k, d], by expert
    counts = torch.bincount(flat, minlength=args.experts)

    def loop(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):
            out.append(xs[start : start + c] @ w[e].T)  # [c, d] @ [d, f] -> [c, f]
            start += c
        return torch.cat(out)

    fns: dict[str, Callable] = {"loop": loop} | {i: (lambda xs, w, i=i: moe.grouped_mm(xs, w, counts, impl=i))
                                                  for i in _impls(args)}  # fmt: skip

    def step(fn: Callable) -> Callable[[bool], object]:
        def go(bwd: bool) -> object:
            xs, w = rows.detach().requires_grad_(bwd), p["w1"].detach().requires_grad_(bwd)
            y = fn(xs, w)
            if bwd:
                torch.autograd.grad(y.square().sum(), [xs, w])
            return y

        return go

    times = measure({n: step(fn) for n, fn in fns.items()}, args.rounds, sync)
    title = f"mm: one projection, {rows.shape[0]} rows [d={args.d}] x {args.experts} experts [f={args.f}]"
    report(title, times, "loop")


def bench_ep(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    """Expert parallelism (``moe_ffn(axis="ep")`` over a mesh, against ``axis=None`` on the whole batch): a seam for
    the Mixtral work (a sim mesh, or gloo processes as bench/shard_map_overhead.py launches them)."""
    raise SystemExit("bench/moe.py: the ep part is not written yet (see bench_ep)")


def _impls(args: argparse.Namespace) -> list[str]:
    out = ["torch", "segments"]
    if args.device == "cuda":
        out.append("triton")
    x, w = torch.zeros(1, args.d, device=args.device), torch.zeros(1, args.f, args.d, device=args.device)
    return [i for i in out if i != "torch" or moe.pick_impl(x, w) == "torch" or args.device == "cuda"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--f", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", default="experts,mm", help="comma-separated: experts, mm, ep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {args.device}, {args.threads} threads, {args.rounds} rounds")
    parts = {"experts": bench_experts, "mm": bench_mm, "ep": bench_ep}
    for part in args.parts.split(","):
        parts[part](args, sync)


if __name__ == "__main__":
    main()
