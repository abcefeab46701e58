"""The train job's Llama step on one GPU: tokens/s, MFU and peak memory, beside ``python -m funcshard plan``'s
prediction for the same step.

The step is ``funcshard.job.train.build_step`` (``llama.value_and_grad`` + clipping + AdamW, params and moments
donated, one ``shard_map``) for the model and flags given (the train job's and ``plan``'s: ``--dim``, ``--layers``,
``--heads``, ``--kv-heads``, ``--ffn``, ``--seq``, ``--batch``, ``--dtype``, ``--remat``, ``--preset`` ...), built
from them as ``plan`` builds it (``plan_config`` after the GPU defaults), on a one-device ``"dist"`` mesh
(``{"dp": 1}``; this process initialises a one-process group: NCCL, so the blocks live on ``cuda:0``). Parameters
are random (``torch.randn * 0.02``, norms 1: the speed does not depend on the values), tokens uniform.

Method: ``--warmup`` steps (the Triton kernels compile in the first), then ``torch.cuda.reset_peak_memory_stats()``
and ``--steps`` steps timed from one synchronisation to the next. Measured: step time, tokens/s, MFU (the plan's
model FLOPs, ``6 N T + 12 L d s T`` with N the non-embedding parameters, over the step time and the hardware
table's dense peak for ``--dtype``: the same formula ``plan`` reports), the plan's FLOPs per step over the step
time (achieved TFLOP/s, recomputation counted) and ``torch.cuda.max_memory_allocated()``. Predicted: ``python -m
funcshard plan <the same flags> --mesh dp=1 --hardware H --json`` (``--plan-json PATH``: read from a file the
caller made with it; else run here), H from ``--hardware`` (default: from the GPU's name, h100 / h200 / a100).
Prints one table: quantity, plan, measured, measured / plan.

``--cpu-dry-run`` runs the same code on CPU (gloo, a tiny model by default, hardware ``cpu``): the script's own check
before a GPU is lent to it (a few seconds).

Usage (about a minute on an H100, most of it the first step's kernel compilation):
    python bench/gpu_train_step.py --dim 2048 --layers 8 --heads 16 --kv-heads 8 --ffn 5632 --seq 2048 --batch 8
    python bench/gpu_train_step.py --cpu-dry-run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import optree
import torch

DRY_FLAGS = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--seq", "64",
             "--batch", "4", "--dtype", "fp32", "--remat", "selective"]  # fmt: skip
GIB = 2**30


def gpu_hardware() -> str:
    """The hardware table's key for this GPU (by its name), h100 where the name is none of the table's."""
    name = torch.cuda.get_device_name().upper() if torch.cuda.is_available() else ""
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    return "h100"


def plan_json(flags: list[str], hardware: str) -> dict[str, Any]:
    """``python -m funcshard plan <flags> --mesh dp=1 --hardware <hardware> --json``, parsed."""
    cmd = [sys.executable, "-m", "funcshard", "plan", *flags, "--mesh", "dp=1", "--hardware", hardware, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):  # (1: the step does not fit; the JSON says so)
        raise SystemExit(f"plan failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _init_group() -> None:
    """A one-process group (NCCL on CUDA, else gloo) for the ``"dist"`` mesh, unless one exists."""
    for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def measure(flags: list[str], hw: str, warmup: int, steps: int) -> dict[str, Any]:
    """Build the step as ``plan`` does, take ``warmup + steps`` steps, time the last ``steps``."""
    import funcshard as fs
    from funcshard.job.cli import plan_parser
    from funcshard.job.plan.command import resolve_defaults
    from funcshard.job.plan.estimate import n_params, plan_config
    from funcshard.job.plan.timing import model_flops
    from funcshard.job.train import build_step
    from funcshard.models import llama

    args = resolve_defaults(plan_parser().parse_args([*flags, "--mesh", "dp=1", "--hardware", hw]))
    cfg = plan_config(args)
    _init_group()
    mesh = fs.make_mesh({"dp": 1}, backend="dist")
    built = build_step(args, cfg, mesh)
    shapes = fs.eval_shape(llama.init, fs.random.key(0), cfg)
    paths, leaves, treedef = optree.tree_flatten_with_path(shapes)
    full = [
        torch.ones(s.shape, dtype=s.dtype) if "norm" in "/".join(map(str, p)) else torch.randn(s.shape) * 0.02
        for p, s in zip(paths, leaves, strict=True)
    ]
    params = fs.device_put(optree.tree_unflatten(treedef, full), mesh, built.specs)
    del full
    state = built.opt_init(params)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    x = fs.device_put(tokens, mesh, built.batch_spec)
    y = fs.device_put(tokens.roll(-1, dims=1), mesh, built.batch_spec)
    cuda = torch.cuda.is_available()

    def sync(loss: Any) -> float:
        return float(fs.device_get(loss))  # (reads the value: waits for the device)

    t0 = time.perf_counter()
    for _ in range(warmup):
        loss, params, state = built.step(params, state, x, y)
    first_loss = sync(loss)
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, params, state = built.step(params, state, x, y)
    last_loss = sync(loss)
    step_s = (time.perf_counter() - t0) / steps
    n = n_params(cfg) - cfg.vocab_size * cfg.dim
    flops = model_flops(n, cfg.n_layers, cfg.dim, args.seq, args.batch * args.seq)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "where": str(mesh.local_device() or "cpu"),
        "params": n_params(cfg),
        "dtype": args.dtype,
        "remat": cfg.remat,
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
        "model_flops": flops,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "warmup_s": warm_s,
        "losses": (first_loss, last_loss),
    }


def report(got: dict[str, Any], plan: dict[str, Any], dtype: str) -> list[str]:
    """The table: plan beside measurement."""
    from funcshard.job.plan.hardware import hardware

    peak_flops = hardware(plan["hardware"]).peak(dtype)
    mfu = got["model_flops"] / got["step_s"] / peak_flops
    rows = [
        ("step time (s)", plan["time_s"]["step"], got["step_s"]),
        ("tokens/s", plan["tokens_per_s_per_device"], got["tokens_per_s"]),
        ("MFU", plan["mfu"], mfu),
        ("TFLOP/s as run (plan FLOPs / time)", plan["flops_per_device"] / plan["time_s"]["step"] / 1e12,
         plan["flops_per_device"] / got["step_s"] / 1e12),
        ("peak memory (GiB)", plan["memory_bytes"]["peak"] / GIB,
         None if got["peak_bytes"] is None else got["peak_bytes"] / GIB),
    ]  # fmt: skip
    lines = [
        f"{got['device']} ({got['where']}): {got['params'] / 1e6:.1f}M params, {got['dtype']}, remat {got['remat']}, "
        f"batch {plan['batch']} x seq {plan['seq']}; loss {got['losses'][0]:.3f} -> {got['losses'][1]:.3f}; "
        f"warmup {got['warmup_s']:.1f} s",
        f"{'':<36} {'plan (' + plan['hardware'] + ')':>14} {'measured':>12} {'meas/plan':>10}",
    ]
    for name, want, have in rows:
        ratio = "" if have is None or not want else f"{have / want:>10.3f}"
        have_s = "n/a" if have is None else f"{have:,.4g}"
        lines.append(f"{name:<36} {want:>14,.4g} {have_s:>12} {ratio}")
    lines.append(f"plan fits: {plan['fits']}; plan analysis {plan['analysis_s']:.1f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same code on CPU, tiny model, hardware cpu")
    ap.add_argument("--hardware", default=None, help="the plan's hardware (default: from the GPU's name; cpu dry)")
    ap.add_argument("--plan-json", default=None, help="plan --json output for the same flags (else run here)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a, flags = ap.parse_known_args(argv)
    if a.cpu_dry_run:
        flags = flags or DRY_FLAGS
        a.warmup, a.steps = min(a.warmup, 2), min(a.steps, 3)
    elif not torch.cuda.is_available():
        print("SKIP: no CUDA GPU (torch.cuda.is_available() is False); --cpu-dry-run checks the script on CPU")
        return 0
    hw = a.hardware or ("cpu" if a.cpu_dry_run else gpu_hardware())
    if a.plan_json:
        with open(a.plan_json) as f:
            plan = json.load(f)
    else:
        plan = plan_json(flags, hw)
    got = measure(flags, hw, a.warmup, a.steps)
    for line in report(got, plan, got["dtype"]):
        print(line)
    ok = all(math.isfinite(v) for v in got["losses"])
    sys.stdout.flush()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
