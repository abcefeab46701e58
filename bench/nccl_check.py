"""funcshard's ``"dist"`` backend on NCCL: the collectives and the Llama's gradients on 2 GPU processes, against
references computed on one device.

The test suite's dist bodies run on a pool of gloo processes with CPU tensors (``tests/support/_dist_pool.py``
starts gloo by name; no variable points it at NCCL), so on a GPU machine this script is what checks NCCL: under
``torchrun --nproc-per-node 2`` each process takes GPU ``LOCAL_RANK`` (modulo the GPUs there are), starts the NCCL
group itself, and on a mesh of the two devices checks, forward and backward (``fs.value_and_grad`` inside
``shard_map``), against the same function on the whole tensors on this device:

- ``psum``, ``all_gather`` (tiled), ``psum_scatter`` (tiled), ``all_to_all``, ``ppermute`` (a swap), ``pmax``;
- the Llama's loss and gradients (``llama.value_and_grad``, float32, TF32 off) on ``{"dp": 2}``, ``{"fsdp": 2}``,
  ``{"tp": 2}`` against ``fs.value_and_grad(llama.loss)`` on the whole batch with plain tensors;
- ``fs.comm_stats`` of each Llama run against ``step.lower(...).comm_rows()`` (the abstract twin's prediction).

Without CUDA the same script runs on gloo and CPU tensors (``--allow-cpu``: the script's own check). Prints one
line per check (``ok`` / ``FAIL`` with the largest difference) from rank 0, then ``nccl_check: N/M ok``; exit
status 1 when any fails. NCCL refuses two processes on one GPU ("Duplicate GPU detected"): with one GPU this
script fails at its first collective, which says so.

Usage:
    torchrun --nproc-per-node 2 bench/nccl_check.py                 # 2 GPUs: ~30 s
    torchrun --nproc-per-node 2 bench/nccl_check.py --allow-cpu     # no GPU: gloo, CPU tensors
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard import P
from funcshard.models import llama

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    worst = 0.0
    ok = True
    for g, w in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        g, w = g.detach().float().cpu(), w.detach().float().cpu()
        if g.shape != w.shape:
            ok, worst = False, float("inf")
            continue
        worst = max(worst, (g - w).abs().max().item() if g.numel() else 0.0)
        ok &= torch.allclose(g, w, rtol=rtol, atol=atol)
    RESULTS.append((name, ok, f"max |diff| {worst:.2e}"))


def collectives(dev: torch.device) -> None:
    mesh = fs.make_mesh({"x": 2}, backend="dist")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=g).to(dev)

    def both(name: str, body: Callable[[torch.Tensor], torch.Tensor], ref: Callable[[torch.Tensor], torch.Tensor],
             in_spec: P, reduce: str) -> None:  # fmt: skip
        """The sum of squares of ``body``'s result and its gradient, on the blocks, against ``ref`` on the whole:
        ``reduce`` says how the devices' sums make the whole one (``"psum"``: a sharded result; ``"pmean"``: the
        whole result on every device; ``"none"``: an invariant result)."""
        total = {"psum": lambda v: fs.psum(v, "x"), "pmean": lambda v: fs.pmean(v, "x"), "none": lambda v: v}[reduce]
        f = fs.shard_map(
            fs.value_and_grad(lambda u: total(body(u).pow(2).sum())),
            mesh=mesh,
            in_specs=(in_spec,),
            out_specs=(P(), in_spec),
        )
        got = [fs.device_get(o) for o in f(x)]
        xr = x.clone().requires_grad_()
        loss = ref(xr).pow(2).sum()
        (gr,) = torch.autograd.grad(loss, xr)
        check(name, got, (loss, gr))

    both("psum", lambda t: fs.psum(t, "x"), lambda t: t[:4] + t[4:], P("x"), "none")
    both("all_gather", lambda t: fs.all_gather(t, "x", dim=0, tiled=True) * 1.5, lambda t: t * 1.5, P("x"), "pmean")
    both("psum_scatter", lambda t: fs.psum_scatter(t, "x", dim=0, tiled=True), lambda t: t * 2, P(), "psum")
    both("all_to_all", lambda t: fs.all_to_all(t, "x", 1, 0, tiled=True), lambda t: t, P("x"), "psum")
    both("ppermute", lambda t: fs.ppermute(t, "x", [(0, 1), (1, 0)]) * torch.arange(1.0, 7.0, device=t.device),
         lambda t: torch.cat([t[4:], t[:4]]) * torch.arange(1.0, 7.0, device=t.device), P("x"), "psum")  # fmt: skip
    both("pmax", lambda t: fs.pmax(t, "x"), lambda t: torch.maximum(t[:4], t[4:]), P("x"), "none")


def llama_grads(dev: torch.device) -> None:
    cfg = llama.Config(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    params = optree.tree_map(lambda t: t.to(dev), llama.init(fs.random.key(0), cfg))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=g).to(dev)
    targets = tokens.roll(-1, dims=1)
    ref = fs.value_and_grad(llama.loss)(params, tokens, targets, cfg)
    for shape in ({"dp": 2}, {"fsdp": 2}, {"tp": 2}):
        mesh = fs.make_mesh(shape, backend="dist")
        specs, bs = llama.param_specs(cfg, mesh), llama.batch_spec(mesh)
        step = fs.shard_map(
            lambda p, t, u: llama.value_and_grad(p, t, u, cfg),
            mesh=mesh,
            in_specs=(specs, bs, bs),
            out_specs=(P(), specs),
        )
        with fs.comm_stats() as stats:
            out = step(params, tokens, targets)
        got = fs.device_get(out)  # (gathers the gradients: after the count)
        name = "llama " + ",".join(f"{k}={v}" for k, v in shape.items())
        check(name, got, ref, rtol=1e-4, atol=1e-5)
        predicted = step.lower(params, tokens, targets).comm_rows(device=dist.get_rank())
        rows = stats.rows()
        diff = "; ".join(f"{k}: {rows.get(k)} vs lower {predicted.get(k)}" for k in sorted(set(rows) | set(predicted))
                         if rows.get(k) != predicted.get(k))  # fmt: skip
        calls = sum(c for c, _ in predicted.values())
        RESULTS.append((name + " comm rows == lower", rows == predicted, diff or f"{calls} calls, equal"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allow-cpu", action="store_true", help="without CUDA: gloo and CPU tensors")
    a = ap.parse_args()
    if "RANK" not in os.environ:
        print("nccl_check: run under torchrun --nproc-per-node 2")
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not a.allow_cpu:
        print("nccl_check: SKIP: no CUDA GPU (--allow-cpu runs it on gloo)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if dist.get_world_size() != 2:
        raise SystemExit(f"nccl_check: runs on 2 processes, found {dist.get_world_size()}")
    rank = dist.get_rank()
    if rank == 0:
        where = torch.cuda.get_device_name(dev) if cuda else "cpu"
        print(f"nccl_check: backend {dist.get_backend()}, 2 processes, {where}, GPUs {torch.cuda.device_count()}")
    collectives(dev)
    llama_grads(dev)
    if rank == 0:
        for name, ok, detail in RESULTS:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
        n_ok = sum(ok for _, ok, _ in RESULTS)
        print(f"nccl_check: {n_ok}/{len(RESULTS)} ok")
    failed = not all(ok for _, ok, _ in RESULTS)
    dist.barrier()
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # (no teardown: see bench/_launch.py on gloo groups at interpreter exit)


if __name__ == "__main__":
    sys.exit(main())
