"""How exact ``step.lower(...)`` is: predicted against measured per-device memory, communication and FLOPs of the
Llama train step, under ``sim`` and on 4 gloo processes.

The step is the train job's (``funcshard.job.train.build_step``: ``llama.value_and_grad``, clipping, AdamW on a
warmup-cosine schedule, params and moments donated, in one ``shard_map``), for a Llama of dim 128, 4 layers, 4 heads
(2 kv), ffn 384, vocabulary 512 (0.92M parameters), global batch 8 x seq 128, float32, with remat ``none`` /
``full`` / ``selective``, on these meshes:

- ``sim dp=1``: one simulated device in this process;
- ``dist dp=2,tp=2``, ``dist fsdp=4``, ``dist pp=2,dp=2`` (1F1B, 4 microbatches): 4 gloo processes started here
  (``bench/_launch.py``), one device each, every case run on the same processes.

Per case:

- predicted: ``step.lower(params, state, tokens, targets)`` on the abstract twin of the mesh (made by rank 0 under
  dist: it is abstract) -> ``memory_analysis()["peak"]`` (the largest device's peak of live tensor bytes),
  ``cost_analysis()["flops"]`` and ``comm_rows(device=r)`` per rank;
- measured: one real step whose body (the function ``build_step`` hands to ``fs.shard_map``; ``fs.shard_map`` is
  patched while the step is built, to wrap it) runs under ``LiveBytes`` (``tests/support/_live_bytes.py``: exact
  live tensor bytes of every aten op's new storages until freed). A device's measured peak is the bytes of its
  input blocks (params, moments, tokens, targets) plus the LiveBytes peak of its body, as the abstract run counts
  them; the row's measured peak is the max over devices (the prediction is the largest device's). The same
  step's ``fs.comm_stats().rows()`` on every rank is compared with the prediction's rows of that rank (equal or
  not). A second step runs under torch's ``FlopCounterMode`` with formulas added for the CPU flash-attention
  kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward: torch's SDPA formulas; torch has
  none for them), whose total is compared with the prediction's FLOPs of that rank.

Each case starts with the dist backend's pool of gradient buckets emptied (``BucketPool``, kept from one backward
to the next as DDP keeps its buckets), so every measured step is a first step, whatever case ran before.

Prints one row per case: predicted MiB, measured MiB (max over devices), ratio predicted / measured (the
number: 1.0 is exact), the per-rank ratios of each rank's own prediction (``memory_analysis(device=r)``), ``pool``:
the MiB of gradient buckets the dist backend's pool keeps after the step (they stay allocated from step to step;
the prediction replays that pool on its meta buckets: ``BackendImpl.keeps_buckets``), the comm rows equal or not,
the number of collectives, FLOPs predicted and counted; then the worst ratio. ``--trace CASE`` (e.g.
``"dist fsdp=4/none"``) also prints, for rank 0 of that case, the aten ops of the real body and of the abstract
run with the bytes each allocates, where they differ (how a gap is found: a kernel or a buffer taken in one run
and not the other).

Usage:
    python bench/plan_accuracy.py                  # every case: 20-80 s on 2 cores (by their load)
    python bench/plan_accuracy.py --remat none     # one remat policy
    python bench/plan_accuracy.py --no-dist        # the sim row only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from _launch import launch
from _live_bytes import LiveBytes, _plain_tensors

import funcshard as fs
from funcshard import P
from funcshard._src.collectives import prims
from funcshard._src.runtime.context import maybe_current
from funcshard.job import train
from funcshard.job.cli import train_parser
from funcshard.models import llama

REMATS = ("none", "full", "selective")
DIST_MESHES = ({"dp": 2, "tp": 2}, {"fsdp": 4}, {"pp": 2, "dp": 2})
MIB = 2**20
aten = torch.ops.aten


def _flash_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:  # torch's SDPA forward formula
    return sdpa_flop_count(q, k, v)


def _flash_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:  # torch's SDPA backward formula
    return sdpa_backward_flop_count(grad_out, q, k, v)


CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward,
}


def mesh_name(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def job_args(a: argparse.Namespace) -> argparse.Namespace:
    """The train job's options for the model of this benchmark."""
    return train_parser().parse_args(
        ["--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
         "--ffn", str(a.ffn), "--seq", str(a.seq), "--batch", str(a.batch)]
    )  # fmt: skip


class Watch:
    """The context the step body runs under, set before each call (None: nothing)."""

    def __init__(self) -> None:
        self.ctx: Any = None

    def wrap(self, f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def body(*args: Any) -> Any:
            ctx = self.ctx
            if ctx is None:
                return f(*args)
            with ctx:
                return f(*args)

        return body


@contextlib.contextmanager
def _body_wrapped(watch: Watch) -> Iterator[None]:
    """``fs.shard_map`` wraps the train step's body (``build_step``'s ``step_fn``) in ``watch`` while it is on."""
    real = fs.shard_map
    seen = []

    def patched(f: Callable[..., Any], /, **kw: Any) -> Any:
        if getattr(f, "__name__", "") == "step_fn":
            seen.append(f)
            f = watch.wrap(f)
        return real(f, **kw)

    fs.shard_map = patched
    try:
        yield
    finally:
        fs.shard_map = real
    if len(seen) != 1:
        raise SystemExit(f"plan_accuracy: expected build_step to shard_map one step_fn, found {len(seen)}")


def _setup(a: argparse.Namespace, shape: dict[str, int], remat: str, backend: str, watch: Watch | None) -> tuple:
    args = job_args(a)
    cfg = dataclasses.replace(train.model_config(args), vocab_size=a.vocab, remat=remat)
    mesh = fs.make_mesh(shape, backend=backend)
    with _body_wrapped(watch) if watch is not None else contextlib.nullcontext():
        built = train.build_step(args, cfg, mesh)
    # sharded init, as the train job's: each device draws its own blocks (owned, so updated in place)
    init = fs.shard_map(lambda k: llama.init(k, cfg), mesh=mesh, in_specs=(P(),), out_specs=built.specs)
    params = init(fs.random.key(0))
    state = built.opt_init(params)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
    x, y = (fs.device_put(t, mesh, built.batch_spec) for t in (tokens, targets))
    return mesh, built, params, state, x, y


def _held(tree: Any, mesh: fs.Mesh) -> dict[int, int]:
    """Per device of this process: the bytes of its blocks of ``tree``'s Arrays."""
    out: dict[int, int] = {}
    leaves = optree.tree_leaves(tree, is_leaf=lambda t: isinstance(t, fs.Array))
    for coords in leaves[0].shards:
        rank = mesh.rank_of(dict(zip(mesh.axis_names, coords, strict=True)))
        out[rank] = sum(leaf.shards[coords].numel() * leaf.shards[coords].element_size() for leaf in leaves)
    return out


class OpTrace(TorchDispatchMode):
    """Each aten op's name and the bytes of the new storages it made (the ``--trace`` listing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ctx = maybe_current()
        if ctx is not None and ctx.device.rank != 0:  # (the abstract run of another class of devices)
            return out
        n = 0
        if not any(r.alias_info is not None for r in func._schema.returns):
            n = sum(t.untyped_storage().nbytes() for t in _plain_tensors(optree.tree_leaves(out)))
        self.ops.append((str(func.overloadpacket.__name__), n))
        return out


def _predict(step: Any, args: tuple, ranks: list[int]) -> dict[str, Any]:
    lowered = step.lower(*args)
    return {
        "peak": lowered.memory_analysis()["peak"],
        "peak_by_rank": {r: lowered.memory_analysis(device=r)["peak"] for r in ranks},
        "flops_by_rank": {r: lowered.cost_analysis(device=r)["flops"] for r in ranks},
        "rows_by_rank": {r: lowered.comm_rows(device=r) for r in ranks},
    }


def _abstract_trace(step: Any, args: tuple) -> list[tuple[str, int]]:
    """The aten ops of the abstract run of rank 0 (``lower`` under an op trace; meta storages have sizes)."""
    trace = OpTrace()
    with trace:
        step.lower(*args)
    return trace.ops


def measure(a: argparse.Namespace, shape: dict[str, int], remat: str, backend: str, trace: bool) -> dict[str, Any]:
    """One case on this process's devices: prediction (where ``predict``), memory, comm rows, FLOPs."""
    watch = Watch()
    prims.BUCKETS.clear()  # no gradient bucket kept from an earlier case: each case's step is a first step
    mesh, built, params, state, x, y = _setup(a, shape, remat, backend, watch)
    lead = backend == "sim" or torch.distributed.get_rank() == 0
    out: dict[str, Any] = {}
    if lead:
        t0 = time.perf_counter()
        out["predicted"] = _predict(built.step, (params, state, x, y), list(range(mesh.size)))
        out["lower_s"] = time.perf_counter() - t0
        if trace:
            out["abstract_ops"] = _abstract_trace(built.step, (params, state, x, y))
    held = _held((params, state, x, y), mesh)
    if len(held) != 1:
        raise SystemExit(f"plan_accuracy: one device per process/run expected, found {len(held)}")
    [(rank, held_bytes)] = held.items()
    live = LiveBytes()
    watch.ctx = live
    t0 = time.perf_counter()
    with fs.comm_stats() as stats:
        _, params, state = built.step(params, state, x, y)
    out["step_s"] = time.perf_counter() - t0
    out["rank"], out["held"], out["body_peak"] = rank, held_bytes, live.peak
    out["rows"] = stats.rows()
    out["pool"] = sum(b.numel() * b.element_size() for kept in prims.BUCKETS.kept.values() for b, _ in kept)
    flops = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    watch.ctx = flops
    _, params, state = built.step(params, state, x, y)
    out["flops"] = flops.get_total_flops()
    if trace:  # (every device takes the step: it communicates)
        ops = OpTrace()
        watch.ctx = ops
        built.step(params, state, x, y)
        if rank == 0:
            out["real_ops"] = ops.ops
    watch.ctx = None
    return out


def _row(case: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's row from the per-rank results (the lead's holds the prediction)."""
    pred = next(r["predicted"] for r in per_rank if "predicted" in r)
    measured = {r["rank"]: r["held"] + r["body_peak"] for r in per_rank}
    rows_equal = all(pred["rows_by_rank"][r["rank"]] == r["rows"] for r in per_rank)
    flops_equal = all(pred["flops_by_rank"][r["rank"]] == r["flops"] for r in per_rank)
    worst = max(measured, key=measured.__getitem__)
    return {
        "case": case,
        "predicted": pred["peak"],
        "measured": measured[worst],
        "ratio": pred["peak"] / measured[worst],
        "per_rank": {r: pred["peak_by_rank"][r] / m for r, m in sorted(measured.items())},
        "pool": next(r["pool"] for r in per_rank if r["rank"] == worst),
        "comm_equal": rows_equal,
        "n_collectives": sum(c for c, _ in pred["rows_by_rank"][worst].values()),
        "flops_predicted": pred["flops_by_rank"][worst],
        "flops_counted": next(r["flops"] for r in per_rank if r["rank"] == worst),
        "flops_equal": flops_equal,
        "comm_diff": None if rows_equal else _comm_diff(pred, per_rank),
    }


def _comm_diff(pred: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in per_rank:
        want, got = pred["rows_by_rank"][r["rank"]], r["rows"]
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                lines.append(f"rank {r['rank']} {key}: predicted {want.get(key)} measured {got.get(key)}")
    return lines


def _trace_pair(per_rank: list[dict[str, Any]]) -> tuple[list, list]:
    """(the real body's ops of rank 0, the abstract run's ops)."""
    real = next(r for r in per_rank if "real_ops" in r)["real_ops"]
    return real, next(r for r in per_rank if "abstract_ops" in r)["abstract_ops"]


def _print_trace(case: str, real: list, abstract: list) -> None:
    print(f"\n--trace {case}: aten ops of rank 0, real body vs abstract run (count, MiB allocated), where they differ")
    count_r, count_a = Counter(n for n, _ in real), Counter(n for n, _ in abstract)
    bytes_r, bytes_a = Counter(), Counter()
    for n, b in real:
        bytes_r[n] += b
    for n, b in abstract:
        bytes_a[n] += b
    for name in sorted(set(count_r) | set(count_a)):
        if (count_r[name], bytes_r[name]) != (count_a[name], bytes_a[name]):
            print(
                f"  {name:<52} real {count_r[name]:>5} {bytes_r[name] / MIB:>8.2f}   "
                f"abstract {count_a[name]:>5} {bytes_a[name] / MIB:>8.2f}"
            )


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'case':<26} {'pred MiB':>9} {'meas MiB':>9} {'ratio':>6}  {'per rank':<27} {'pool':>5} "
        f"{'comm':<5} {'coll':>5} {'GFLOP pred':>10} {'counted':>8} {'flops':<5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        per = " ".join(f"{v:.3f}" for v in r["per_rank"].values())
        print(
            f"{r['case']:<26} {r['predicted'] / MIB:>9.2f} {r['measured'] / MIB:>9.2f} {r['ratio']:>6.3f}  {per:<27} "
            f"{r['pool'] / MIB:>5.2f} "
            f"{'equal' if r['comm_equal'] else 'DIFF':<5} {r['n_collectives']:>5} {r['flops_predicted'] / 1e9:>10.3f} "
            f"{r['flops_counted'] / 1e9:>8.3f} {'equal' if r['flops_equal'] else 'DIFF':<5}"
        )
        for line in r["comm_diff"] or ():
            print("    " + line)
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print("-" * len(head))
    print(f"worst ratio: {worst['ratio']:.3f} ({worst['case']}); ", end="")
    print(f"comm rows equal in {sum(r['comm_equal'] for r in rows)}/{len(rows)}, ", end="")
    print(f"FLOPs equal in {sum(r['flops_equal'] for r in rows)}/{len(rows)}")


def _dist(job: tuple[argparse.Namespace, str | None]) -> None:
    """Every dist case on this rank; rank 0 writes the rows (and traces) to ``job[1]``, or prints them (torchrun)."""
    a, path = job
    torch.set_num_threads(1)
    dist = torch.distributed
    rows, traces = [], []
    for shape in DIST_MESHES:
        for remat in a.remat:
            case = f"dist {mesh_name(shape)}/{remat}"
            t0 = time.perf_counter()
            mine = measure(a, shape, remat, "dist", trace=case == a.trace)
            got: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(got, mine)
            if dist.get_rank() == 0:
                rows.append(_row(case, got))
                if case == a.trace:
                    traces.append((case, _trace_pair(got)))
                print(f"  {case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if dist.get_rank() != 0:
        return
    if path is None:  # under torchrun: no parent to hand the rows to
        for case, pair in traces:
            _print_trace(case, *pair)
        print_table(rows)
    else:
        Path(path).write_text(json.dumps({"rows": rows, "traces": traces}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--remat", type=lambda s: s.split(","), default=list(REMATS), help="comma-separated policies")
    ap.add_argument("--no-dist", action="store_true", help="only the sim row(s)")
    ap.add_argument("--no-sim", action="store_true", help="only the dist rows")
    ap.add_argument("--trace", default=None, metavar="CASE", help='e.g. "dist fsdp=4/none": op listing of rank 0')
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    print(
        f"Llama dim {a.dim}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv), ffn {a.ffn}, vocab {a.vocab}; "
        f"batch {a.batch} x seq {a.seq}; train.build_step (clip + AdamW, donated); float32. Peak live bytes per "
        "device: predicted = lower().memory_analysis()['peak'], measured = input blocks + LiveBytes peak of the body"
    )
    rows = []
    if not a.no_sim and "RANK" not in os.environ:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        for remat in a.remat:
            case = f"sim dp=1/{remat}"
            t0 = time.perf_counter()
            got = measure(a, {"dp": 1}, remat, "sim", trace=case == a.trace)
            rows.append(_row(case, [got]))
            if case == a.trace:
                _print_trace(case, *_trace_pair([got]))
            print(f"  {case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if not a.no_dist and "RANK" in os.environ:  # under torchrun: rank 0 prints the dist rows
        launch(_dist, (a, None), world=4, timeout_s=300)
    if not a.no_dist:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.json")
            launch(_dist, (a, path), world=4, timeout_s=300)
            done = json.loads(Path(path).read_text())
        rows += done["rows"]
        for case, pair in done["traces"]:
            _print_trace(case, *pair)
    print()
    print_table(rows)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
