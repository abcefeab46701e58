"""The MoE layer's experts: grouped matmuls (``funcshard.ops.moe``) against a per-expert loop, in one process.

Part ``experts`` (the acceptance: the grouped path at least 1.5x faster than the loop): a top-k MoE layer over
``--tokens`` tokens with ``--experts`` SwiGLU experts of ``[--f, --d]``, forward alone and forward + backward (the
gradients of the tokens and of every weight). Every variant routes by :func:`funcshard.ops.moe.route` (the same
expert ids); they differ in how the experts run:

    (a) loop     : Hugging Face's ``MixtralExperts.forward`` (transformers 5): per expert, ``torch.where`` over its
                   one-hot mask, gather its tokens, gate / up / down ``F.linear``, times the routing weights,
                   ``index_add_`` into the output -- the baseline every ratio is taken against
    (b) torch    : ``moe_ffn(axis=None, impl="torch")`` (``torch._grouped_mm``): one stable sort of the
                   assignments, one gather, one grouped matmul per projection (the three and the gating in one
                   autograd Function, on CPU in blocks of whole experts of ~4 MiB), one weighted ``index_add``
    (c) segments : the same with ``impl="segments"`` (one ``torch.mm`` per expert over ``x.split(counts)``)
    (d) triton   : the same with ``impl="triton"`` (only on CUDA)
    (e) matmuls  : the matmuls alone (CPU): the rows already sorted, per expert the forward's 3 ``torch.mm`` (and
                   the backward's 6) into preallocated buffers, nothing else -- a floor under any implementation:
                   ``loop / matmuls`` is the most a grouped path could gain at this shape

then the acceptance line (the grouped layer against the loop, and what the floor allows), then a grid over
``--grid-tokens`` x ``--grid-experts`` (default 128, 512, 1024, 4096 tokens x 8, 64 experts; ``--grid-rounds``
rounds each; ``--grid-tokens ''`` skips it): the loop's CPU ms, the grouped layer's ratio (CPU, and wall) and the
floor's, forward and forward + backward -- where grouping wins (few rows per expert; and any backward, where the
loop's per-expert weight slices each give a zero gradient of the whole ``[E, f, d]`` weight) and where both are
bound by the same matmuls.

Part ``mm`` (for reference): one projection alone, ``grouped_mm`` against a Python loop of
``x[rows of e] @ w[e].T`` over the same sorted rows (no gather, no scatter: the matmuls themselves, so here the
grouped call can only save the loop's overhead, which is small at these sizes on CPU).

Part ``ep`` (expert parallelism, dispatch by ``ragged_all_to_all``, CPU): the Mixtral train step
(``mixtral.value_and_grad``, ``--layers`` layers of width ``--d``, ``--experts`` experts of ``--f``, top-``--k``,
``--tokens`` tokens in sequences of ``--seq``) on ``ep=2`` -- sim (two threads of this process) and dist (two gloo
processes spawned here, or ``torchrun --nproc-per-node 2 bench/moe.py --parts ep --dim 256 --ffn 512`` for that row
alone, without a ratio) -- against
the same step on one process, as ratios (one thread per device; one process with 2 threads for reference). The
router is made device-balanced (:func:`balance_router`), so the exchange is the theory's uniform routing; then the
exact counters: each device's ``ragged_all_to_all`` bytes per layer and direction (forward dispatch and combine,
backward combine and dispatch) and their sum from ``fs.comm_stats``, against ``tokens x k x dim x 4 B x
(ep-1)/ep`` (the device's tokens).

Method: every variant is run once (warmup), then ``--rounds`` rounds, each round every variant once in a rotating
order; a ratio is the baseline's median time over the variant's (forward alone, and forward + backward), for the
wall time and for the process's CPU time (on a shared host the wall time of a round depends on the other jobs as
much as on the code: ``--threads 1`` and the CPU figures are the steadier measure there). The variants are first
checked to agree (rtol 1e-4).

Usage:
    python bench/moe.py                                   # 4096 tokens x top-2, d=512, f=1024, 8 experts
    python bench/moe.py --parts experts --rounds 9 --threads 1 --grid-experts 8   # acceptance run, grid of 8 experts
    python bench/moe.py --tokens 1024 --d 256 --f 512 --rounds 10
    python bench/moe.py --parts mm
    python bench/moe.py --parts ep --tokens 2048 --d 256 --f 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import funcshard as fs
from funcshard import P
from funcshard.extend import axis_index_int, capture
from funcshard.models import mixtral
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
        return _med(times, name, bwd, which)

    print(f"\n{title}")
    head = "".join(f"{f'{p} {u} ms':>16}{'x ' + base:>8}" for p in ("fwd", "fwd+bwd") for u in ("wall", "cpu"))
    print(f"{'variant':<10}{head}")
    for n in times:
        cells = [(med(n, b, w), med(base, b, w) / med(n, b, w)) for b in (False, True) for w in (0, 1)]
        print(f"{n:<10}" + "".join(f"{v * 1e3:>16.1f}{r:>8.2f}" for v, r in cells))


def matmul_floor(x: torch.Tensor, p: dict[str, torch.Tensor], k: int) -> Callable[[bool], object]:
    """The matmuls alone, a floor under any implementation of the experts: the rows already sorted by expert, per
    expert the forward's three ``torch.mm`` (gate, up, down) and, with the backward, its six (``dact``, ``dx`` from
    gate and up, the three weight gradients), each into a preallocated buffer (``out=``): no routing, no gather, no
    elementwise work, no combine, no allocation. ``loop / floor`` is the most any grouped path could gain."""
    n_experts, f = p["w1"].shape[:2]
    ids = moe.route(x, p["router"], k)[1].reshape(-1)
    rows = x.index_select(0, torch.sort(ids, stable=True).indices // k)  # [T*k, d], by expert
    counts = torch.bincount(ids, minlength=n_experts).tolist()
    bounds = [sum(counts[:e]) for e in range(n_experts + 1)]
    act, gate, dx = x.new_empty(rows.shape[0], f), x.new_empty(rows.shape[0], f), torch.empty_like(rows)
    y, dws = torch.empty_like(rows), {n: torch.empty_like(p[n]) for n in ("w1", "w3", "w2")}

    def go(bwd: bool) -> object:
        for e in range(n_experts):
            s = slice(bounds[e], bounds[e + 1])
            xe, ae, ge, ye, dxe = rows[s], act[s], gate[s], y[s], dx[s]
            torch.mm(xe, p["w1"][e].T, out=ge)  # [c, d] @ [d, f] -> [c, f]
            torch.mm(xe, p["w3"][e].T, out=ae)  # [c, d] @ [d, f] -> [c, f]
            torch.mm(ae, p["w2"][e].T, out=ye)  # [c, f] @ [f, d] -> [c, d]
            if bwd:  # (ye stands for dy, ge for dact / dgate, ae for dup: the shapes, not the values)
                torch.mm(ye, p["w2"][e], out=ge)  # [c, d] @ [d, f] -> [c, f]
                torch.mm(ye.T, ae, out=dws["w2"][e])  # [d, c] @ [c, f] -> [d, f]
                torch.mm(ge, p["w1"][e], out=dxe)  # [c, f] @ [f, d] -> [c, d]
                torch.mm(ae, p["w3"][e], out=dxe)  # [c, f] @ [f, d] -> [c, d]
                torch.mm(ge.T, xe, out=dws["w1"][e])  # [f, c] @ [c, d] -> [f, d]
                torch.mm(ae.T, xe, out=dws["w3"][e])  # [f, c] @ [c, d] -> [f, d]
        return y

    return go


def bench_experts(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    """The acceptance shape in full (every implementation, the matmul floor), then the grid of token and expert
    counts (:func:`experts_grid`)."""
    x, p = make(args)
    fns = {"loop": loop_layer} | {i: grouped_layer(i) for i in _impls(args)}
    ref = loop_layer(x, p, args.k)
    for n, fn in fns.items():
        torch.testing.assert_close(fn(x, p, args.k), ref, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    variants = {n: _step(fn, x, p, args.k) for n, fn in fns.items()}
    if args.device == "cpu":
        variants["matmuls"] = matmul_floor(x, p, args.k)
    times = measure(variants, args.rounds, sync)
    report(f"layer: {args.tokens} tokens x top-{args.k}, {args.experts} experts, d={args.d}, f={args.f}", times, "loop")
    if "matmuls" in times:
        grouped = "torch" if "torch" in times else "segments"
        print(acceptance(times, grouped))
    experts_grid(args, sync)


def _med(times: dict, name: str, bwd: bool, which: int) -> float:
    return statistics.median(t[which] for t in times[name][bwd])


def acceptance(times: dict, grouped: str) -> str:
    """The acceptance line: the grouped layer against the loop (>= 1.5x at 8 experts), and what the matmul floor
    allows at this shape (``loop / matmuls``: no implementation that does the same matmuls can do better)."""
    cells = []
    for bwd, what in ((False, "fwd"), (True, "fwd+bwd")):
        got = [_med(times, "loop", bwd, w) / _med(times, grouped, bwd, w) for w in (0, 1)]
        best = [_med(times, "loop", bwd, w) / _med(times, "matmuls", bwd, w) for w in (0, 1)]
        cells.append(f"{what} {got[0]:.2f}x wall / {got[1]:.2f}x cpu (floor allows {best[0]:.2f}x / {best[1]:.2f}x)")
    reach = max(_med(times, "loop", b, 1) / _med(times, "matmuls", b, 1) for b in (False, True))
    verdict = "within reach" if reach >= 1.5 else "out of reach of ANY implementation of these matmuls"
    return f"acceptance (grouped >= 1.5x the loop): {grouped} " + "; ".join(cells) + f" -> 1.5x is {verdict} here"


def experts_grid(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    """The grouped layer (``impl="auto"``) and the matmul floor against the loop over ``--grid-tokens`` x
    ``--grid-experts`` (d, f, k as given; ``--grid-rounds`` rounds each): where grouping wins and by how much the
    floor allows. CPU ms are this process's CPU time (the steadier figure on a shared host)."""
    tokens, experts = _ints(args.grid_tokens), _ints(args.grid_experts)
    if not tokens or not experts:
        return
    print(f"\ngrid: d={args.d}, f={args.f}, top-{args.k}, {args.grid_rounds} rounds; ratio = loop time / variant time")
    head = "".join(f"{f'{w} loop ms':>17}{'grouped x':>11}{'(wall)':>8}{'floor x':>9}" for w in ("fwd", "fwd+bwd"))
    print(f"{'tokens':>7}{'experts':>8}{head}")
    for e in experts:
        for t in tokens:
            sub = argparse.Namespace(**{**vars(args), "tokens": t, "experts": e})
            x, p = make(sub)
            variants = {"loop": _step(loop_layer, x, p, args.k), "grouped": _step(grouped_layer("auto"), x, p, args.k)}
            if args.device == "cpu":
                variants["matmuls"] = matmul_floor(x, p, args.k)
            times = measure(variants, args.grid_rounds, sync)
            row = f"{t:>7}{e:>8}"
            for bwd in (False, True):
                loop = _med(times, "loop", bwd, 1)
                floor = f"{loop / _med(times, 'matmuls', bwd, 1):>9.2f}" if "matmuls" in times else f"{'-':>9}"
                wall = _med(times, "loop", bwd, 0) / _med(times, "grouped", bwd, 0)
                row += f"{loop * 1e3:>17.1f}{loop / _med(times, 'grouped', bwd, 1):>11.2f}{wall:>8.2f}{floor}"
            print(row, flush=True)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


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


def ep_config(args: argparse.Namespace) -> mixtral.Config:
    """The Mixtral of part ``ep``: ``--layers`` layers of width ``--d``, ``--experts`` experts of ``--f``, top-``--k``
    (8 query / 4 kv heads, byte vocabulary)."""
    return mixtral.Config(
        vocab_size=256, dim=args.d, n_layers=args.layers, n_heads=8, n_kv_heads=4, ffn_dim=args.f,
        max_seq_len=args.seq, n_experts=args.experts, experts_per_token=args.k,
    )  # fmt: skip


def balance_router(params: dict, ep: int) -> dict:
    """``params`` with each layer's router made device-balanced over ``ep`` devices: its ``E / ep`` rows repeated on
    every device's block (expert ``j`` of each device has the same logit), so each token picks its top ``k / ep``
    local experts on EVERY device (``torch.topk`` takes all tied copies when ``k`` is a multiple of ``ep``) and
    exactly ``(ep - 1) / ep`` of its ``k`` assignments leave its device: the theory's uniform routing.

    A zero router is no such router: equal logits tie, and ``torch.topk`` resolves ties to the lowest expert ids,
    so every token would go to experts ``0 .. k-1``, all on device 0."""
    router = params["layers"]["router"]  # [L, E, d]
    e_local = router.shape[1] // ep
    layers = {**params["layers"], "router": router[:, :e_local].repeat(1, ep, 1)}  # [L, E/ep, d] -> [L, E, d]
    return {**params, "layers": layers}


def ep_data(args: argparse.Namespace, ep: int) -> tuple[mixtral.Config, dict, torch.Tensor, torch.Tensor]:
    """``(cfg, params, tokens [b, s], targets [b, s])`` of part ``ep``: ``--tokens`` tokens in sequences of
    ``--seq``, the router device-balanced over ``ep`` (:func:`balance_router`)."""
    cfg = ep_config(args)
    params = balance_router(mixtral.init(fs.random.key(0), cfg), ep)
    tokens = torch.randint(0, 256, (args.tokens // args.seq, args.seq), generator=torch.Generator().manual_seed(1))
    return cfg, params, tokens, tokens.roll(-1, dims=1)


def ep_step(cfg: mixtral.Config, mesh: fs.Mesh | None) -> Callable[..., tuple]:
    """The train step's ``(loss, grads)``: on full tensors (``mesh=None``), or inside ``shard_map`` over ``mesh``."""
    if mesh is None:
        return lambda p, t, y: mixtral.value_and_grad(p, t, y, cfg)
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    return fs.shard_map(
        lambda p, t, y: mixtral.value_and_grad(p, t, y, cfg), mesh=mesh, in_specs=(specs, bs, bs),
        out_specs=(P(), specs),
    )  # fmt: skip


def _median_s(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warmup
    return statistics.median(_time(fn, lambda: None)[0] for _ in range(rounds))


def ep_counters(args: argparse.Namespace, ep: int) -> None:
    """One step on a sim ``ep`` mesh: the ``ragged_all_to_all`` bytes of every device per layer and direction (the
    body's own log, :func:`funcshard.extend.capture`, in program order) and their sum (``fs.comm_stats``), against
    ``tokens x k x dim x bytes x (ep-1)/ep`` (``tokens`` the device's)."""
    cfg, params, tokens, targets = ep_data(args, ep)
    mesh = fs.make_mesh({"ep": ep}, backend="sim")
    specs, bs = mixtral.param_specs(cfg, mesh), mixtral.batch_spec(mesh)
    logs: dict[int, list] = {}

    def body(p: dict, t: torch.Tensor, y: torch.Tensor) -> tuple:
        with capture() as log:
            out = mixtral.value_and_grad(p, t, y, cfg)
        logs[axis_index_int("ep")] = [b for _, name, _, b in log if name == "ragged_all_to_all"]
        return out

    step = fs.shard_map(body, mesh=mesh, in_specs=(specs, bs, bs), out_specs=(P(), specs))
    with fs.comm_stats() as st:
        step(fs.device_put(params, mesh, specs), tokens, targets)
    theory = args.tokens // ep * args.k * args.d * 4 * (ep - 1) // ep  # per device, layer and direction
    names = ("fwd dispatch", "fwd combine", "bwd combine", "bwd dispatch")
    print(f"\nep counters (sim ep={ep}, device-balanced router; theory per device, layer, direction: "
          f"{args.tokens // ep} tokens x k={args.k} x d={args.d} x 4 B x {ep - 1}/{ep} = {theory:,} B)")  # fmt: skip
    for r in sorted(logs):
        got, n = logs[r], args.layers
        fwd, bwd = got[: 2 * n], got[2 * n :][::-1]  # the backward runs the layers in reverse, combine first
        for layer in range(n):
            cells = (fwd[2 * layer], fwd[2 * layer + 1], bwd[2 * layer + 1], bwd[2 * layer])
            row = "  ".join(f"{nm} {c:,}" for nm, c in zip(names, cells))
            ok = all(c == theory for c in cells)
            print(f"  device {r} layer {layer}: {row}  {'= theory' if ok else '!= theory'}")
        total = st.bytes("ragged_all_to_all", "ep", device=r)
        print(f"  device {r} comm_stats: {st.calls('ragged_all_to_all', 'ep', device=r)} calls, {total:,} B "
              f"({'= ' if total == 4 * n * theory else '!= '}4 x {n} layers x theory)")  # fmt: skip


def _ep_dist(args: argparse.Namespace) -> None:
    """On each of 2 gloo processes (one thread each): the step on a dist ``ep=2`` mesh; rank 0 prints its time
    against the one-process time of this run (``BENCH_ONE_S``)."""
    torch.set_num_threads(1)
    cfg, params, tokens, targets = ep_data(args, 2)
    mesh = fs.make_mesh({"ep": 2}, backend="dist")
    sharded = fs.device_put(params, mesh, mixtral.param_specs(cfg, mesh))
    step = ep_step(cfg, mesh)
    t = _median_s(lambda: step(sharded, tokens, targets), args.rounds)
    if int(os.environ["RANK"]) == 0:  # (under torchrun alone: no one-process time, no ratio)
        one = os.environ.get("BENCH_ONE_S")
        ratio = f"{float(one) / t:>10.2f}" if one else f"{'-':>10}"
        print(f"{'dist ep=2, 2 gloo processes x 1 thread':<44}{t * 1e3:>10.1f}{ratio}")


def bench_ep(args: argparse.Namespace, sync: Callable[[], None]) -> None:
    """Part ``ep``: the Mixtral train step (``value_and_grad``) on ``ep=2`` (sim: 2 threads of one process; dist: 2
    gloo processes) against the same step on one process, as ratios (one process's median time over the
    variant's), then the exchange's bytes against theory (:func:`ep_counters`). CPU only."""
    if args.device != "cpu":
        raise SystemExit("bench/moe.py: part ep runs on CPU (sim threads and gloo processes)")
    cfg, params, tokens, targets = ep_data(args, 2)
    load = os.getloadavg()[0]
    print(f"\nep: Mixtral train step, {args.layers} layers, d={args.d}, {args.experts} experts of f={args.f}, "
          f"top-{args.k}, {tokens.shape[0]} x {tokens.shape[1]} tokens; host load {load:.1f}")  # fmt: skip
    print(f"{'variant':<44}{'ms':>10}{'x one':>10}")
    torch.set_num_threads(1)
    one = _median_s(lambda: ep_step(cfg, None)(params, tokens, targets), args.rounds)
    print(f"{'one process, 1 thread (baseline)':<44}{one * 1e3:>10.1f}{1.0:>10.2f}")
    torch.set_num_threads(2)
    two = _median_s(lambda: ep_step(cfg, None)(params, tokens, targets), args.rounds)
    print(f"{'one process, 2 threads':<44}{two * 1e3:>10.1f}{one / two:>10.2f}")
    torch.set_num_threads(1)
    mesh = fs.make_mesh({"ep": 2}, backend="sim")
    sharded, step = fs.device_put(params, mesh, mixtral.param_specs(cfg, mesh)), ep_step(cfg, mesh)
    sim = _median_s(lambda: step(sharded, tokens, targets), args.rounds)
    print(f"{'sim ep=2, 2 threads of one process':<44}{sim * 1e3:>10.1f}{one / sim:>10.2f}")
    from _launch import launch

    os.environ["BENCH_ONE_S"] = str(one)
    launch(_ep_dist, args, world=2)
    ep_counters(args, 2)
    torch.set_num_threads(args.threads)


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
    ap.add_argument("--d", "--dim", dest="d", type=int, default=512)  # (--dim under torchrun: --d is ambiguous there)
    ap.add_argument("--f", "--ffn", dest="f", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2, help="part ep: the Mixtral's layers")
    ap.add_argument("--seq", type=int, default=256, help="part ep: tokens per sequence")
    ap.add_argument("--parts", default="experts,mm", help="comma-separated: experts, mm, ep")
    ap.add_argument(
        "--grid-tokens", default="128,512,1024,4096", help="part experts: the grid's token counts ('' none)"
    )
    ap.add_argument("--grid-experts", default="8,64", help="part experts: the grid's expert counts ('' none)")
    ap.add_argument("--grid-rounds", type=int, default=3, help="part experts: rounds per grid cell")
    args = ap.parse_args()
    if "RANK" in os.environ:  # under torchrun --nproc-per-node 2: part ep's dist row, against BENCH_ONE_S
        from _launch import launch

        launch(_ep_dist, args, world=2)
        return
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {args.device}, {args.threads} threads, {args.rounds} rounds")
    parts = {"experts": bench_experts, "mm": bench_mm, "ep": bench_ep}
    for part in args.parts.split(","):
        parts[part](args, sync)


if __name__ == "__main__":
    main()
