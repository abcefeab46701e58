"""Planning at scale: the train step of Llama-3-70B and Llama-3.1-405B lowered on 4096-device abstract meshes.

For each case, ``step.lower(...)`` of the train job's step (``funcshard.job.step.build_step``: llama.value_and_grad
pipelined over ``pp``, AdamW) on ``make_mesh(shape, backend="abstract")`` with parameters from ``fs.eval_shape``,
then ``cost_analysis()`` and ``memory_analysis()``. Prints the wall time and the peak RSS of the analysis, the
per-device memory by part, and checks the parameters' and optimiser state's bytes against the layout of the real
shards (the local block of every leaf by its spec: what ``device_put`` would hold on that device).

Cases (seq 8192, bf16 compute, selective remat, 1F1B):

- ``70b``: Llama-3-70B on ``{"pp": 8, "fsdp": 64, "tp": 8}``;
- ``405b``: Llama-3.1-405B on ``{"pp": 2, "fsdp": 256, "tp": 8}`` (126 layers do not split over 8 stages until
  uneven stages land).

Usage:
    python bench/plan_scale.py                 # both cases
    python bench/plan_scale.py --cases 70b --microbatches 8
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import optree

import funcshard as fs
from funcshard.job.cli import plan_parser
from funcshard.job.plan.estimate import lowered_step, plan_config
from funcshard.models import llama

CASES = {
    "70b": ("llama3-70b", {"pp": 8, "fsdp": 64, "tp": 8}),
    "405b": ("llama3-405b", {"pp": 2, "fsdp": 256, "tp": 8}),
}


def layout_bytes(cfg: llama.Config, shape: dict[str, int]) -> int:
    """The bytes of device 0's local blocks of the parameters (float32), from their specs: the real layout."""
    mesh = fs.make_mesh(shape, backend="abstract")
    specs = llama.param_specs(cfg, mesh)
    shapes = fs.eval_shape(llama.init, fs.random.key(0), cfg)
    total = 0
    for s, spec in zip(optree.tree_leaves(shapes), optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, fs.P))):
        dims = spec.dim_axes(len(s.shape))
        local = [d // math.prod(shape.get(a, 1) for a in axes) for d, axes in zip(s.shape, dims)]
        total += math.prod(local) * s.dtype.itemsize
    return total


def run(case: str, microbatches: int | None) -> dict[str, float]:
    preset, shape = CASES[case]
    argv = [
        "--preset",
        preset,
        "--seq",
        "8192",
        "--hardware",
        "h100",
        "--mesh",
        ",".join(f"{a}={n}" for a, n in shape.items()),
    ]
    pp = shape["pp"]
    mb = microbatches or 2 * pp
    argv += ["--microbatches", str(mb), "--batch", str(shape["fsdp"] * mb)]
    args = plan_parser().parse_args(argv)
    cfg = plan_config(args)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    lowered = lowered_step(args, cfg, shape)
    cost, memory = lowered.cost_analysis(), lowered.memory_analysis(device=0)
    seconds = time.perf_counter() - t0
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    want = layout_bytes(cfg, shape)
    print(
        f"{case}: {preset} on {shape} ({math.prod(shape.values())} devices), batch {args.batch} x 8192, "
        f"{mb} microbatches"
    )
    print(
        f"  lower + both analyses: {seconds:.1f} s, peak RSS growth {rss / 2**30:.2f} GiB, "
        f"{len(lowered.devices())} runs"
    )
    for k, v in memory.items():
        print(f"  {k:<16} {v / 2**30:8.2f} GiB")
    print(
        f"  params on device 0: {memory['params']:,} bytes; the real shards' layout: {want:,} -> "
        f"{'equal' if memory['params'] == want else 'DIFFERENT'}"
    )
    print(
        f"  optimizer state: {memory['optimizer_state']:,} bytes = 2 x params + count: "
        f"{'equal' if 0 <= memory['optimizer_state'] - 2 * want <= 64 else 'DIFFERENT'} (+ the step count and norm)"
    )
    print(f"  FLOPs per device {cost['flops']:.3g}; comm bytes per axis {cost['comm_bytes']}")
    return {"seconds": seconds, "rss": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="70b,405b")
    ap.add_argument("--microbatches", type=int, default=None, help="default: 2 x pp (the train job's)")
    args = ap.parse_args()
    for case in args.cases.split(","):
        run(case, args.microbatches)


if __name__ == "__main__":
    main()
