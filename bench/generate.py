"""Greedy decoding speed: ``llama.generate`` (KV cache) vs transformers' ``generate`` on the same weights, and
``llama.generate`` on ``tp=2`` gloo processes vs one process.

1. One process, one thread, A/B interleaved: tokens/s of greedy decoding, ``--new`` tokens after a ``--prompt``
   token prompt (batch ``--batch``), for ``llama.generate`` on plain full tensors and for
   ``LlamaForCausalLM.generate(do_sample=False)`` loaded from ``llama.to_hf`` of the same parameters (its own
   KV cache, ``DynamicCache``). The two first check they emit the same tokens. Target: ratio >= 1.0.
2. ``--tp2``: the same decode inside ``fs.shard_map`` over ``tp=2`` on 2 gloo processes (spawned here, or under
   ``torchrun --nproc-per-node 2``), each process one thread, against the one-process number of row 1 measured
   in this run (on a 2-core host the two ranks share the cores with the collectives' threads).

The default model is the train job's default shape (dim 256, 4 layers, 8 query / 4 kv heads, SwiGLU 704, byte
vocabulary 256: 3.2M parameters), random weights from ``llama.init``.

Usage:
    python bench/generate.py                 # row 1
    python bench/generate.py --tp2           # rows 1 and 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import funcshard as fs
from funcshard import P
from funcshard.models import llama

CFG = llama.Config()  # the train job's default shape (its --seq aside: 256 positions here)


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, 256, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]


def _ours(params: dict, args: argparse.Namespace) -> torch.Tensor:
    return llama.generate(params, _prompts(args), CFG, max_new_tokens=args.new)


def _hf(model: object, args: argparse.Namespace) -> torch.Tensor:
    ids = torch.tensor(_prompts(args))  # [b, prompt]: every row full, no padding
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None
        )


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def row_vs_hf(args: argparse.Namespace) -> float:
    """Row 1; returns our one-process seconds per call (median)."""
    import transformers

    params = llama.init(fs.random.key(0), CFG)
    folder = tempfile.mkdtemp()
    llama.to_hf(params, CFG, folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    same = torch.equal(_ours(params, args), _hf(model, args))
    print(f"check: same tokens as transformers: {same}")
    ours, hf = [], []
    for i in range(args.warmup + args.reps):  # A/B interleaved, the order flipped every rep
        pair = [("ours", lambda: _ours(params, args)), ("hf", lambda: _hf(model, args))]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            t = _timed(fn)
            if i >= args.warmup:
                (ours if name == "ours" else hf).append(t)
    n = args.new * args.batch
    o, h = statistics.median(ours), statistics.median(hf)
    print(f"llama.generate   {n / o:8.0f} tokens/s  ({o * 1e3:.1f} ms for {args.new} new x batch {args.batch})")
    print(f"HF generate      {n / h:8.0f} tokens/s  ({h * 1e3:.1f} ms)")
    print(f"ratio (ours / HF tokens/s): {h / o:.2f}x   target >= 1.0")
    return o


def _tp2(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    mesh = fs.make_mesh({"tp": 2}, backend="dist")
    specs = llama.param_specs(CFG, mesh)
    params = fs.device_put(llama.init(fs.random.key(0), CFG), mesh, specs)
    step = fs.shard_map(
        lambda p: llama.generate(p, _prompts(args), CFG, max_new_tokens=args.new),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=P(),
        check_vma=args.check_vma,
    )
    times = [_timed(lambda: step(params)) for _ in range(args.warmup + args.reps)][args.warmup :]
    if int(os.environ["RANK"]) == 0:
        t = statistics.median(times)
        one = float(os.environ["BENCH_ONE_S"])
        n = args.new * args.batch
        print(f"tp=2 on 2 gloo processes: {n / t:8.0f} tokens/s  ({t * 1e3:.1f} ms; check_vma={args.check_vma})")
        print(f"ratio (tp=2 / one process tokens/s): {one / t:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tp2", action="store_true")
    ap.add_argument("--check-vma", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    if "RANK" in os.environ:  # under torchrun: row 2 only, against BENCH_ONE_S if given
        from _launch import launch

        launch(_tp2, args, world=2)
        return
    torch.set_num_threads(1)
    print(f"model: {CFG.num_params() / 1e6:.1f}M params; host load {os.getloadavg()[0]:.1f}; threads 1")
    one = row_vs_hf(args)
    if args.tp2:
        from _launch import launch

        os.environ["BENCH_ONE_S"] = str(one)
        launch(_tp2, args, world=2)


if __name__ == "__main__":
    main()
