"""funcshard's pipeline runtime against ``torch.distributed.pipelining`` on the same stages, 4 gloo processes.

The same model chunks run under both libraries in the same job, step after step (the order alternates):

    funcshard : ``fs.pipeline.run`` inside ``fs.shard_map`` over a ``{"pp": 4}`` dist mesh
                (``one_f_one_b`` / ``interleaved_1f1b(v=2)``)
    torch     : ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (looped placement, the
                same chunk on the same rank): the baseline

Case A, stages that only sleep: a custom ``torch.autograd.Function`` sleeps F = 10 ms in its forward and
B = 20 ms in its backward per stage (each of the v chunks of a stage sleeps F / v and B / v, so both
schedules do the same work), so both libraries pay the same compute and what differs is how well each
follows its schedule. For each of 1F1B and interleaved, m = 8 and 16 microbatches, it prints the median wall
time of a step (the slowest rank's) of each library, the ideal time (the makespan ``Schedule.simulate`` gives
with those costs and free communication: ``(m + p - 1)(F + B)`` for 1F1B, ``(m + (p - 1) / v)(F + B)`` for
interleaved), wall / ideal for each library, the ratio funcshard / torch and the CPU time of the 4 ranks; then
interleaved / 1F1B per library. Targets: wall / ideal within 5% of torch's; interleaved faster than 1F1B.

Case B, small real stages: each stage two residual-MLP layers ``x + gelu(x @ W1) @ W2`` (D = 128, H = 512),
m = 8 microbatches of 32 rows, 1F1B and interleaved, ``check_vma`` on and off: it prints the step time of each
library, funcshard / torch (target <= 1.10 for 1F1B), the CPU time of the 4 ranks and its ratio, the
point-to-point messages sent / received per step on both sides (target: equal) and the load. Before timing,
both libraries' loss and gradients are checked against each other.

Case P (``--case P``), one point-to-point message: rank pairs ping-pong a [32, 128] block through funcshard's
``device.p2p`` and its works' ``wait()``, torch's ``batch_isend_irecv`` (what its pipelining calls), and the
process group's own ``send`` / ``recv`` (the floor); it prints per message the wall time, the CPU of all ranks
and the main threads' CPU.

Messages are counted where both libraries end, the process group's ``send`` / ``recv`` (patched only while
counting), so the counts do not depend on which Python layer each library goes through. Untimed warm-up steps of
both libraries come first (whichever configuration runs first is otherwise measured slower).

Measured figures and their history: ``docs/guides/speed.md``.

Usage:
    torchrun --nproc-per-node 4 bench/pipeline_vs_torch.py [--steps 7] [--steps-b 21] [--case A|B|AB|P]
        [--f-ms 10 --b-ms 20]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

import funcshard as fs
import funcshard.process
from funcshard import P
from funcshard.pipeline import interleaved_1f1b, one_f_one_b, run, stage_order

F_S, B_S = 0.010, 0.020  # per stage (all its chunks together)
D, H, LAYERS, ROWS = 128, 512, 2, 32  # case B
TARGET_A, TARGET_B = 1.05, 1.10


# ---------------------------------------------------------------- the stages, shared by both libraries


class Sleep(torch.autograd.Function):
    """Identity that sleeps ``f`` seconds in its forward and ``b`` in its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:
        if f:
            time.sleep(f)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.b:
            time.sleep(ctx.b)
        return g, None, None


def sleep_layer(w: torch.Tensor, x: torch.Tensor, v: int) -> torch.Tensor:
    return Sleep.apply(x + w, F_S / v, B_S / v)  # [rows, d] + [d] -> [rows, d]


def mlp_layers(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    for a, b in zip(w1, w2, strict=True):
        x = x + F.gelu(x @ a) @ b  # [rows, D] @ [D, H] @ [H, D] -> [rows, D]
    return x


class SleepChunk(nn.Module):
    def __init__(self, w: torch.Tensor, v: int) -> None:
        super().__init__()
        self.w, self.v = nn.Parameter(w.clone()), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sleep_layer(self.w, x, self.v)


class MLPChunk(nn.Module):
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_layers(self.w1, self.w2, x)


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


# ---------------------------------------------------------------- one configuration, both libraries


class Case:
    """One model and schedule under both libraries: ``step[lib]()`` runs a step; ``check()`` compares them."""

    def __init__(self, kind: str, schedule: str, m: int, mesh: fs.Mesh, check_vma: bool = True) -> None:
        self.p, self.rank = dist.get_world_size(), dist.get_rank()
        self.v = 2 if schedule == "interleaved" else 1
        self.kind, self.name, self.m = kind, schedule, m
        p, v, n = self.p, self.v, self.p * self.v
        self.sched = one_f_one_b(p, m) if v == 1 else interleaved_1f1b(p, m, v)
        g = torch.Generator().manual_seed(0)  # every process builds the same full tensors
        d = 16 if kind == "A" else D
        rows = 4 if kind == "A" else ROWS
        if kind == "A":
            layers: tuple[torch.Tensor, ...] = (torch.randn(n, d, generator=g) * 0.1,)  # [virtual stage, d]
        else:
            layers = (
                torch.randn(n, LAYERS, D, H, generator=g) / D**0.5,  # [virtual stage, layer, D, H]
                torch.randn(n, LAYERS, H, D, generator=g) / H**0.5,  # [virtual stage, layer, H, D]
            )
        self.x = torch.randn(m, rows, d, generator=g)
        self.t = torch.randn(m, rows, d, generator=g)
        self.layers = layers
        # funcshard: the chunks stacked in the schedule's placement, sharded over pp
        order = stage_order(self.sched)
        self.fs_params = fs.device_put(tuple(w[order] for w in layers), mesh, P("pp"))
        self.fs_x, self.fs_t = fs.device_put((self.x, self.t), mesh, P())
        sched, vv = self.sched, v
        if kind == "A":

            def stage_fn(params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
                return sleep_layer(params[0], x, vv)
        else:

            def stage_fn(params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
                return mlp_layers(params[0], params[1], x)

        def body(params: Any, xs: torch.Tensor, ts: torch.Tensor) -> Any:
            return run(sched, stage_fn, params, xs, targets=ts, loss_fn=mse)

        self.fs_step = fs.shard_map(
            body, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")), check_vma=check_vma
        )
        # torch: chunk c of rank r is virtual stage c * p + r (looped), as in funcshard's interleaved_1f1b
        self.modules = []
        stages = []
        for c in range(v):
            vs = c * p + self.rank
            mod = SleepChunk(layers[0][vs], v) if kind == "A" else MLPChunk(layers[0][vs], layers[1][vs])
            self.modules.append(mod)
            stages.append(PipelineStage(mod, vs, n, torch.device("cpu")))
        if v == 1:
            self.torch_sched: Any = Schedule1F1B(stages[0], m, loss_fn=mse)
        else:
            self.torch_sched = ScheduleInterleaved1F1B(stages, m, loss_fn=mse)
        self.step: dict[str, Callable[[], Any]] = {"fs": self.run_fs, "torch": self.run_torch}

    def run_fs(self) -> Any:
        return self.fs_step(self.fs_params, self.fs_x, self.fs_t)

    def run_torch(self) -> Any:
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.torch_sched.step(self.x.reshape(-1, self.x.shape[-1]))
        elif self.rank == self.p - 1:
            self.torch_sched.step(target=self.t.reshape(-1, self.t.shape[-1]), losses=losses)
        else:
            self.torch_sched.step()
        return losses

    def check(self) -> None:
        """Loss and every local gradient of the two libraries agree."""
        loss, grads = self.run_fs()
        losses = self.run_torch()
        if self.rank == self.p - 1:
            t_loss = torch.stack(losses).mean()
            if not torch.allclose(loss.local, t_loss, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"{self.kind} {self.name}: loss fs {loss.local.item()} vs torch {t_loss.item()}")
        for c, mod in enumerate(self.modules):  # local index c holds chunk c (looped placement)
            for k, (param, g) in enumerate(zip(mod.parameters(), grads, strict=True)):
                if not torch.allclose(g.local[c], param.grad, rtol=1e-3, atol=1e-6):
                    err = (g.local[c] - param.grad).abs().max().item()
                    raise AssertionError(f"{self.kind} {self.name}: grad {k} of chunk {c} differs by {err:.2e}")


# ---------------------------------------------------------------- measuring


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Seconds of one step on the slowest rank (the ranks start together), and the CPU seconds the step took
    on all ranks together (``time.process_time``: this process's threads, gloo's included; far less noisy
    than the wall clock on a shared host)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - c0
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    got = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(got)
    return dt.item(), got.item()


def medians(case: Case, steps: int, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """Median step time and median CPU time (all ranks) per library, the two interleaved (the order alternates
    every step)."""
    libs = ["fs", "torch"]
    for _ in range(warmup):
        for lib in libs:
            timed(case.step[lib])
    times: dict[str, list[tuple[float, float]]] = {lib: [] for lib in libs}
    for i in range(steps):
        for lib in libs if i % 2 == 0 else libs[::-1]:
            times[lib].append(timed(case.step[lib]))
    return {lib: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for lib, t in times.items()}


_COUNT = {"send": 0, "recv": 0}


def messages(fn: Callable[[], Any]) -> tuple[int, int]:
    """(sends, receives) of one step, summed over the ranks: the point-to-point messages each library hands
    to torch.distributed, counted where both end, the process group's ``send`` / ``recv`` (torch's pipelining
    reaches them through ``batch_isend_irecv`` and ``isend`` / ``irecv``, funcshard's dist backend directly)."""
    pg = dist.ProcessGroup
    send, recv = pg.send, pg.recv  # the functions (for the calls below)
    send_attr, recv_attr = vars(pg)["send"], vars(pg)["recv"]  # pybind11's method descriptors (to restore)

    def counted_send(self: Any, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> Any:
        _COUNT["send"] += 1
        return send(self, tensors, peer, tag)

    def counted_recv(self: Any, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> Any:
        _COUNT["recv"] += 1
        return recv(self, tensors, peer, tag)

    _COUNT.update(send=0, recv=0)
    dist.barrier()
    pg.send, pg.recv = counted_send, counted_recv  # type: ignore[method-assign]
    try:
        fn()
    finally:
        pg.send, pg.recv = send_attr, recv_attr  # type: ignore[method-assign]
    got = torch.tensor([_COUNT["send"], _COUNT["recv"]])
    dist.all_reduce(got)
    return int(got[0]), int(got[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7, help="timed steps per library and configuration (A, P)")
    ap.add_argument(
        "--steps-b", type=int, default=21, help="case B's timed steps (its ~10 ms steps are noisier than A's)"
    )
    ap.add_argument("--f-ms", type=float, default=10.0, help="case A: forward sleep per stage (ms)")
    ap.add_argument("--b-ms", type=float, default=20.0, help="case A: backward sleep per stage (ms)")
    ap.add_argument("--case", choices=("A", "B", "AB", "P"), default="AB")
    args = ap.parse_args()
    global F_S, B_S
    F_S, B_S = args.f_ms / 1e3, args.b_ms / 1e3
    torch.set_num_threads(1)
    mesh = fs.make_mesh({"pp": int(os.environ.get("WORLD_SIZE", "4"))}, backend="dist")
    lead = dist.get_rank() == 0

    def say(*a: Any) -> None:
        if lead:
            print(*a, flush=True)

    if args.case == "P":
        case_p(args.steps, mesh, say)
    if "A" in args.case:
        case_a(args.steps, mesh, say)
    if "B" in args.case:
        case_b(args.steps_b, mesh, say)
    dist.barrier()
    fs.process.shutdown()


def warm_up(case: Case, steps: int) -> None:
    """Untimed steps of both libraries: whichever configuration ran first was measured up to 1.2x slower
    (funcshard's CPU time too), whichever it was; a throwaway configuration takes that place."""
    for _ in range(steps):
        for lib in ("fs", "torch"):
            timed(case.step[lib])


def case_p(steps: int, mesh: fs.Mesh, say: Callable[..., None], n: int = 300) -> None:
    """Per point-to-point message: ranks 2k and 2k+1 ping-pong one [32, 128] block ``n`` times, through
    funcshard's ``device.p2p`` and its works' ``wait()``, torch's ``batch_isend_irecv`` (what its pipelining
    calls), and the process group's own ``send`` / ``recv`` (the floor); the three interleaved, ``steps``
    rounds. Per message (one send and its receive, both waited): wall, CPU of all ranks (``process_time``:
    gloo's threads too) and the main threads' CPU (``thread_time``)."""
    from funcshard._src.runtime.backends.dist import device_for
    from funcshard._src.runtime.comm import P2POp

    dev = device_for(mesh)
    me = dist.get_rank()
    peer = me ^ 1
    x, buf = torch.randn(32, 128), torch.empty(32, 128)
    g = dev.process_group(("pp",))
    first = me % 2 == 0

    def fs_round() -> None:
        for kind in ("send", "recv") if first else ("recv", "send"):
            dev.p2p([P2POp(kind, x if kind == "send" else buf, peer)], ("pp",))[0].wait()

    def torch_round() -> None:
        for fn in (dist.isend, dist.irecv) if first else (dist.irecv, dist.isend):
            dist.batch_isend_irecv([dist.P2POp(fn, x if fn is dist.isend else buf, peer, group=g)])[0].wait()

    timeout = datetime.timedelta(seconds=60)

    def raw_round() -> None:
        for kind in ("send", "recv") if first else ("recv", "send"):
            (g.send([x], peer, 0) if kind == "send" else g.recv([buf], peer, 0)).wait(timeout)

    rounds = {"fs": fs_round, "torch": torch_round, "raw": raw_round}
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in rounds}
    for i in range(steps + 1):
        for k, fn in rounds.items() if i % 2 else reversed(rounds.items()):
            dist.barrier()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(n):
                fn()
            t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0])
            dist.all_reduce(t)
            if i:  # the first round warms up
                world = dist.get_world_size()
                per = n * world  # messages, all pairs: 2 per round trip, world / 2 pairs
                got[k].append((t[0].item() / world / (2 * n) * 1e6, t[1].item() / per * 1e6, t[2].item() / per * 1e6))
    say(f"case P: ping-pong of a [32, 128] block between rank pairs, {n} round trips x {steps} (medians, per message)")
    for k, rows in got.items():
        w, c, m = (statistics.median(r[j] for r in rows) for j in range(3))
        say(f"  P {k:5s}: wall {w:6.1f} us | CPU (all ranks) {c:6.1f} us | main threads {m:6.1f} us")


def case_a(steps: int, mesh: fs.Mesh, say: Callable[..., None]) -> None:
    say(f"case A: sleeping stages, F={F_S * 1e3:g} ms B={B_S * 1e3:g} ms per stage, p={mesh.shape['pp']}")
    walls: dict[tuple[str, int], dict[str, float]] = {}
    warm_up(Case("A", "1f1b", 8, mesh), steps)
    for m in (8, 16):
        for name in ("1f1b", "interleaved"):
            case = Case("A", name, m, mesh)
            case.check()
            got = medians(case, steps)
            med = {lib: w for lib, (w, _) in got.items()}
            walls[(name, m)] = med
            v = case.v
            ideal = case.sched.simulate({"F": F_S / v, "B": B_S / v}).makespan
            rf, rt = med["fs"] / ideal, med["torch"] / ideal
            ok = "ok" if rf <= rt * TARGET_A else "MISS"
            say(
                f"  A {name:11s} m={m:<2d}: wall fs {med['fs']:.3f} s, torch {med['torch']:.3f} s, ideal {ideal:.3f} s"
                f" | wall/ideal fs {rf:.3f}x, torch {rt:.3f}x | fs/torch {med['fs'] / med['torch']:.3f}x [{ok}]"
                f" | CPU (4 ranks) fs {got['fs'][1] * 1e3:.0f} ms, torch {got['torch'][1] * 1e3:.0f} ms"
            )
    for m in (8, 16):
        for lib in ("fs", "torch"):
            r = walls[("interleaved", m)][lib] / walls[("1f1b", m)][lib]
            say(f"  A interleaved / 1f1b m={m:<2d} {lib:5s}: {r:.3f}x [{'ok' if r < 1 else 'MISS'}]")


def case_b(steps: int, mesh: fs.Mesh, say: Callable[..., None]) -> None:
    say(f"case B: residual MLP stages, D={D} H={H}, {LAYERS} layers per chunk, m=8 microbatches of {ROWS} rows")
    warm_up(Case("B", "1f1b", 8, mesh), 2 * steps)
    for name in ("1f1b", "interleaved"):
        for check_vma in (True, False):
            case = Case("B", name, 8, mesh, check_vma=check_vma)
            case.check()
            got = medians(case, steps)
            (fw, fc), (tw, tc) = got["fs"], got["torch"]
            r = fw / tw
            ok = "ok" if r <= TARGET_B or name != "1f1b" else "MISS"
            (fs_s, fs_r), (t_s, t_r) = messages(case.run_fs), messages(case.run_torch)
            same = "ok" if (fs_s, fs_r) == (t_s, t_r) else "MISS"
            say(
                f"  B {name:11s} check_vma={check_vma!s:5s}: step fs {fw * 1e3:.1f} ms, torch {tw * 1e3:.1f} ms, "
                f"fs/torch {r:.3f}x [{ok}] | CPU (4 ranks) fs {fc * 1e3:.0f} ms, torch {tc * 1e3:.0f} ms, "
                f"{fc / tc:.3f}x | messages sent/received fs {fs_s}/{fs_r}, torch {t_s}/{t_r} [{same}] | "
                f"load {os.getloadavg()[0]:.1f}"
            )


if __name__ == "__main__":
    main()
