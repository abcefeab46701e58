"""The planner against published runs: the "predicted" column of docs/guides/planning.md, "Against published runs".

For each published configuration (torchtitan's Llama 3.1 8B, 70B and 405B on H100s, MaxText's Llama 2 7B on
A3 VMs), plans the step ``python -m funcshard plan`` would plan for the same flags: the train step lowered on an
abstract mesh of the run's size (FLOPs as run, communication per axis, the peak memory by part) and timed with
the hardware table as it is (``funcshard.job.plan.hardware``: one efficiency per GPU, never fitted to a row).
Prints one markdown table: whether the step fits in 80 GB, the predicted tokens/s per GPU and MFU (PaLM's
model FLOPs over the dense bf16 peak), the published number, and predicted / published.

What it measures is the step-time model, not funcshard's speed: nothing runs on a GPU. The published runs differ
from what is planned in ways the model does not describe (Float8 linears, torch.compile, asynchronous TP,
power-capped GPUs); the guide's notes say where, and by how much that is expected to move each ratio.

The 405B rows lower copies of the model with one and two layers per pipeline stage (per chunk, interleaved) and
extend them linearly (``funcshard.job.plan.search.extrapolated``, as ``plan --search`` does): several times
faster than lowering the whole model on 512 devices, with the same FLOPs and communication.
Its 126 layers do not split into 8 equal stages; torchtitan gives stages 15 or 16 layers, so the step is paced by
the 16-layer stages: it is planned as 128 layers (16 a stage) and its MFU counts the model FLOPs of 126.

    PYTHONPATH=. python bench/plan_published.py           # about a minute on two cores
    PYTHONPATH=. python bench/plan_published.py --rows 8b maxtext   # a subset
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from funcshard.job.cli import parse_mesh, plan_parser
from funcshard.job.plan import Estimate, estimate, model_flops
from funcshard.job.plan.command import resolve_defaults
from funcshard.job.plan.estimate import n_params, plan_config
from funcshard.job.plan.search import extrapolated


@dataclasses.dataclass
class Row:
    name: str
    run: str  # the published run, as the guide's table names it
    flags: list[str]  # python -m funcshard plan flags
    published: float  # the published figure
    unit: str  # "tps" (tokens/s per GPU) or "tflops" (TFLOP/s per GPU)
    published_text: str
    layers: int | None = None  # plan with this many layers (the 405B: 128 for its 126)
    linear: bool = False  # extend from 1 and 2 layers per stage (funcshard.job.plan.search.extrapolated)


LLAMA2_7B = "--dim 4096 --layers 32 --heads 32 --kv-heads 32 --ffn 11008"  # vocabulary 256, not Llama 2's 32000
LLAMA3_405B = "--preset llama3-405b --mesh pp=8,fsdp=8,tp=8 --seq 8192 --batch 256 --remat full --sp"
ROWS = [
    Row(
        "8b",
        "torchtitan, Llama 3.1 8B, FSDP 8",
        "--preset llama3-8b --mesh fsdp=8 --seq 8192 --batch 16 --remat selective".split(),
        5762,
        "tps",
        "5,762 TPS eager (6,667 compiled)",
    ),
    Row(
        "70b",
        "torchtitan, Llama 3.1 70B, FSDP 32 x TP 8",
        "--preset llama3-70b --mesh fsdp=32,tp=8 --seq 8192 --batch 512 --remat full --sp".split(),
        829,
        "tps",
        "829 TPS (876 async TP)",
    ),
    Row(
        "405b-1f1b",
        "torchtitan, Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B",
        f"{LLAMA3_405B} --schedule 1f1b".split(),
        100,
        "tps",
        "100 TPS",
        layers=128,
        linear=True,
    ),
    Row(
        "405b-interleaved",
        "torchtitan, Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, interleaved 1F1B",
        f"{LLAMA3_405B} --schedule interleaved".split(),
        128,
        "tps",
        "128 TPS",
        layers=128,
        linear=True,
    ),
    Row(
        "maxtext",
        "MaxText, Llama 2 7B shape, FSDP 8",
        f"{LLAMA2_7B} --mesh fsdp=8 --seq 4096 --batch 32 --remat selective".split(),
        492,
        "tflops",
        "492 TFLOP/s per GPU",
    ),
]


def plan_row(row: Row) -> tuple[Estimate, float]:
    """The row's estimate and its MFU (over the model FLOPs of the published model's own layers)."""
    args = resolve_defaults(plan_parser().parse_args([*row.flags, "--hardware", "h100"]))
    true_cfg = plan_config(args)
    if row.layers is not None:
        args.layers_override = row.layers
    e = extrapolated(args, parse_mesh(args.mesh)) if row.linear else estimate(args)
    n = n_params(true_cfg) - true_cfg.vocab_size * true_cfg.dim  # the embedding table is not a matmul
    model = model_flops(n, true_cfg.n_layers, true_cfg.dim, e.seq, e.batch * e.seq)
    return e, e.time.mfu(model / e.devices)


def table(results: list[tuple[Row, Estimate, float, float]]) -> str:
    lines = [
        "| run | planned | peak / fits 80 GB | predicted TPS/GPU | predicted MFU | published | predicted / published |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, e, mfu, seconds in results:
        value = e.tokens_per_s if row.unit == "tps" else mfu * e.hardware.peak(e.dtype) / 1e12
        shown = f"{value:,.0f} TPS" if row.unit == "tps" else f"{value:,.0f} TFLOP/s"
        mb = f", {e.cfg.pp_schedule} x {e.cfg.microbatches(e.mesh['pp'])} mb" if e.mesh.get("pp", 1) > 1 else ""
        planned = f"{','.join(f'{a}={n}' for a, n in e.mesh.items())}, remat {e.cfg.remat}{mb}"
        how = "linear from 1-2 layers/chunk" if row.linear else "whole model"
        lines.append(
            f"| {row.run} | {planned} ({how}, {seconds:.0f} s) | {e.memory['peak'] / 1e9:.1f} GB, "
            f"{'yes' if e.fits else 'no'} | {e.tokens_per_s:,.0f} | {mfu:.1%} | {row.published_text} | "
            f"{shown} / {row.published:,} = {value / row.published:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=[r.name for r in ROWS], choices=[r.name for r in ROWS])
    ap.add_argument("--verbose", action="store_true", help="also print each row's time and communication")
    opts = ap.parse_args(argv)
    results: list[Any] = []
    for row in ROWS:
        if row.name not in opts.rows:
            continue
        t0 = time.perf_counter()
        e, mfu = plan_row(row)
        results.append((row, e, mfu, time.perf_counter() - t0))
        if opts.verbose:
            print(f"## {row.run}\n{e.time.table()}")
            for (coll, axes), (calls, nbytes) in sorted(e.comm_rows.items()):
                print(f"  {coll:<13} {axes:<12} {calls:>6} {nbytes / 1e9:10.2f} GB")
            print({k: f"{v / 1e9:.1f} GB" for k, v in e.memory.items()}, *e.notes, flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
