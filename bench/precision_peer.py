"""The peer oracle of ``bench/precision_curve.py``: how far torch's own bf16 moves the same model's loss curve.

The ``nn.Module`` twin of the funcshard Llama (``bench/_memory_peers.py``, weights loaded with
``bench/_peers_twin.py``) trained in one process on the train job's exact problem: funcshard's initial parameters
(the job's sharded init on its mesh, gathered), the job's batches (``funcshard.job.data.train_batch`` from the same
seed, step by step) and validation batches, and the job's optimiser in torch (``clip_grad_norm_`` to 1.0, then
``torch.optim.AdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)`` on every parameter, its learning rate set each
step from the job's warmup + cosine schedule). Three precisions, each its own run:

- ``fp32``: the plain module;
- ``bf16``: as FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` does it: float32
  master weights and AdamW moments, the weights cast to bfloat16 for the forward and backward (so the residual
  stream and every activation are bfloat16, RMSNorm's statistics and RoPE float32 as in the twin), the
  gradients float32 (bfloat16 values cast up), the loss in float32 (``torch.func.functional_call`` on the cast
  weights: the cast is in the autograd graph, as FSDP2's is);
- ``autocast``: the float32 module under ``torch.autocast("cpu", torch.bfloat16)`` (the matmuls in bfloat16, the
  residual stream and norms float32).

Each run writes ``FOLDER/twin_<mode>/metrics.csv`` in the train job's format; the summary prints
``precision_curve.py``'s statistics for twin-bf16 (and twin-autocast) against twin-fp32, and, given
``--funcshard FOLDER`` (a ``precision_curve.py`` folder of the same settings), funcshard-fp32 against twin-fp32
(the two implementations in float32: only the summation order differs) and funcshard-bf16 against twin-bf16.

Usage:
    python bench/precision_peer.py --modes fp32,bf16 --folder /tmp/peer          # 200 steps each (bf16: slow on CPU)
    python bench/precision_peer.py --reuse /tmp/peer --funcshard runs/precision_curve
    python bench/precision_peer.py --steps 20 -- --lr 1e-3                     # after --: train job options

Measured figures: ``docs/guides/speed.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory_peers as peers
import precision_curve as pc
from _peers_twin import load_params

import funcshard as fs
from funcshard import random as fsr
from funcshard.job import train as job
from funcshard.job.cli import parse_mesh, train_parser
from funcshard.job.data import eval_batches, train_batch
from funcshard.job.step import check_args

MODES = ("fp32", "bf16", "autocast")


class EmulatedBf16(TorchFunctionMode):
    """torch's bfloat16 arithmetic as a GPU does it, fast on this CPU, for the twin's bf16 runs:

    - ``F.linear`` in bfloat16 (a bfloat16 operand, or under autocast): the operands rounded to bfloat16,
      multiplied in float32 (float32 accumulation, as torch's bfloat16 ``mm`` accumulates), the result rounded
      to bfloat16; the backward the same (autograd of the casts). On a CPU without native bfloat16 matmuls
      (AVX2) torch's own bfloat16 ``mm`` is ~20-50x slower than float32 (a 200-step twin run: hours); its
      results differ from these in ~1e-4 of the elements (float32 summation order; see the docstring);
    - ``F.embedding`` of a bfloat16 table: looked up in the float32 table (the same values, a bfloat16
      result), so its gradient is summed in float32 and rounded once, as CUDA's embedding backward sums (CPU's
      sums in bfloat16 and loses 2-3% on a byte vocabulary; funcshard's ``vocab_parallel_embedding`` does this).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        bf = torch.bfloat16
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is None and (torch.is_autocast_enabled("cpu") or bf in (x.dtype, w.dtype)):
                with torch.autocast("cpu", enabled=False):
                    return F.linear(x.to(bf).float(), w.to(bf).float()).to(bf)  # [.., k] @ [k, n] -> [.., n]
        if func is F.embedding and args[1].dtype == bf:
            return F.embedding(args[0], args[1].float(), *args[2:], **kwargs).to(bf)  # [b, s] -> [b, s, d]
        return func(*args, **kwargs)


def job_problem(job_args: list[str]) -> tuple[argparse.Namespace, Any, dict[str, Any], Any]:
    """``(args, cfg, params, corpus)``: the train job's options, model config (float32: the peer casts itself),
    initial parameters as full tensors (its sharded init on its mesh, gathered) and corpus."""
    args = train_parser().parse_args([*job_args, "--dtype", "fp32"])
    cfg = job.model_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        run = job._setup(args, cfg, parse_mesh(args.mesh), Path(tmp), Path(tmp))
        params = fs.device_get(run.init(fsr.fold_in(fsr.key(args.seed), 0)))
    return args, cfg, params, run.corpus


def _loss(model: torch.nn.Module, mode: str, masters: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """The mean token cross-entropy (float32) of the twin in ``mode``."""
    if mode == "bf16":  # FSDP2's param_dtype: the masters cast for the computation, inside the graph
        cast = {k: v.to(torch.bfloat16) for k, v in masters.items()}
        logits = torch.func.functional_call(model, cast, (x,))  # [b, s, V] bfloat16
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)  # [b, s, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return peers.module_loss(model, x, y)


class _Twin:
    """One twin of the train job in one precision mode: the module, its float32 masters, AdamW and its rows."""

    def __init__(self, mode: str, cfg: Any, params: dict[str, Any], weight_decay: float, native: bool) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
        self.mode, self.native = mode, native
        self.model = load_params(peers.build(cfg), params)
        self.masters = dict(self.model.named_parameters())  # float32, what AdamW updates
        self.opt = torch.optim.AdamW(
            self.masters.values(), lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False
        )
        self.rows: list[dict[str, Any]] = []

    def _arith(self) -> Any:
        """The context of this mode's arithmetic: :class:`EmulatedBf16` for bf16 modes unless ``native``."""
        return contextlib.nullcontext() if self.mode == "fp32" or self.native else EmulatedBf16()

    def evaluate(self, vals: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        with torch.no_grad(), self._arith():
            return sum(float(_loss(self.model, self.mode, self.masters, x, y)) for x, y in vals) / len(vals)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, clip: float) -> float:
        """One update on the batch ``(x, y)`` at learning rate ``lr``; the batch's loss before it."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        with self._arith():
            loss = _loss(self.model, self.mode, self.masters, x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.masters.values(), clip)
        self.opt.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise RuntimeError(f"twin {self.mode}: loss {value}")
        return value

    def write(self, folder: str) -> None:
        out = Path(folder) / f"twin_{self.mode}"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=job.CSV_FIELDS)
            w.writeheader()
            w.writerows(self.rows)


def train_twins(modes: list[str], folder: str, job_args: list[str], threads: int, native: bool = False) -> float:
    """The twin runs of the train job in ``modes``, in lockstep (step ``i`` of each before step ``i + 1``), each
    writing ``folder/twin_<mode>/metrics.csv`` at every evaluation (a run stopped early leaves curves of equal
    length); their wall seconds. ``native``: torch's own bfloat16 matmuls (slow on AVX2), else
    :class:`EmulatedBf16`."""
    torch.set_num_threads(threads)
    args, cfg, params, corpus = job_problem(job_args)
    twins = [_Twin(m, cfg, params, args.weight_decay, native) for m in modes]
    warmup = check_args(args, fs.make_mesh(parse_mesh(args.mesh)), cfg)
    final = args.lr / 10 if args.final_lr is None else args.final_lr
    schedule = fs.optim.warmup_cosine(args.lr, warmup, args.steps, final_lr=final)
    data_key = fsr.fold_in(fsr.key(args.seed), 1)
    vals = eval_batches(corpus.val, n=args.eval_batches, batch=args.batch, seq=args.seq)
    for t in twins:
        t.rows.append({"step": 0, "train_loss": "", "val_loss": t.evaluate(vals), "tokens_per_s": ""})
    t_all = time.perf_counter()
    for i in range(args.steps):
        x, y = train_batch(corpus.train, data_key, step=i, batch=args.batch, seq=args.seq)
        evaluate = (i + 1) % args.eval_every == 0 or i + 1 == args.steps
        for t in twins:
            t0 = time.perf_counter()
            loss = t.step(x, y, schedule(i), args.clip)  # the job's schedule of the update count before this one
            tps = args.batch * args.seq / (time.perf_counter() - t0)
            t.rows.append({"step": i + 1, "train_loss": loss, "val_loss": "", "tokens_per_s": tps})
            if evaluate:
                t.rows[-1]["val_loss"] = t.evaluate(vals)
                t.write(folder)
        if (i + 1) % 10 == 0:
            losses = ", ".join(f"{t.mode} {t.rows[-1]['train_loss']:.4f}" for t in twins)
            print(f"step {i + 1}: {losses} ({time.perf_counter() - t_all:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t_all


def train_twin(mode: str, folder: str, job_args: list[str], threads: int, native: bool = False) -> float:
    """One twin run (:func:`train_twins` of one mode)."""
    return train_twins([mode], folder, job_args, threads, native)


def main(argv: list[str] | None = None) -> int:
    argv, extra = pc.split_extra(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="fp32,bf16", help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--folder", default="runs/precision_peer", help="where the twin runs write")
    ap.add_argument("--reuse", default=None, metavar="FOLDER", help="only summarise FOLDER/twin_*/metrics.csv")
    ap.add_argument("--funcshard", default=None, metavar="FOLDER", help="a precision_curve.py folder to compare")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the twin's process")
    ap.add_argument("--show", type=int, default=5, help="print the N steps of largest difference")
    ap.add_argument("--native", action="store_true", help="torch's own bf16 matmuls (slow on AVX2: not emulated)")
    args = ap.parse_args(argv)
    folder = args.reuse or args.folder
    job_args = ["--steps", str(args.steps), "--seed", str(args.seed), *extra]
    if args.reuse is None:
        wall = train_twins(args.modes.split(","), folder, job_args, args.threads, args.native)
        print(f"twins {args.modes}: {wall:.0f} s", file=sys.stderr)
    runs = {f"twin-{m}": os.path.join(folder, f"twin_{m}", "metrics.csv") for m in MODES}
    if args.funcshard:
        runs |= {f"funcshard-{d}": os.path.join(args.funcshard, d, "metrics.csv") for d in ("fp32", "bf16")}
    runs = {k: v for k, v in runs.items() if os.path.isfile(v)}
    pairs = [("twin-fp32", "twin-bf16"), ("twin-fp32", "twin-autocast"), ("twin-fp32", "funcshard-fp32")]
    pairs += [("twin-bf16", "funcshard-bf16"), ("funcshard-fp32", "funcshard-bf16")]
    for ref, other in pairs:
        if ref in runs and other in runs:
            print(f"\n== {other} against {ref}")
            pc.report(runs[ref], runs[other], show=args.show, names=(ref, other))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
