"""Communication of one transformer block forward + backward, per parallel style, against the theory.

Runs the block of funcshard.models.block on a simulated 4-device mesh for TP, TP+SP, FSDP, FSDP+TP and
HSDP, records every collective with fs.comm_stats (calls and payload bytes on one device) and prints them
beside the theoretical minimum (Megatron's two all-reduces per block each way for TP, the same volume as
all-gathers + reduce-scatters for SP, one all-gather and one reduce-scatter per bucket of parameters for FSDP:
the leaves that vary over the same axes, gathered as one flat buffer).

    python bench/comm_volume.py [--dim 256 --heads 8 --ffn 1024 --batch 8 --seq 128]
"""

from __future__ import annotations

import argparse

import torch

import funcshard as fs
from funcshard.models import block


def measure(cfg: block.BlockConfig, mode: str, batch: int, seq: int) -> dict[tuple[str, str], tuple[int, int]]:
    mesh = fs.make_mesh(block.mesh_shape(mode), backend="sim")
    specs = block.param_specs(mode)
    params = fs.device_put(block.init(cfg, seed=0), mesh, specs)
    x = torch.randn(batch, seq, cfg.dim)
    step = fs.shard_map(
        lambda p, x: fs.value_and_grad(lambda p: block.loss(p, x, cfg, mode))(p),
        mesh=mesh,
        in_specs=(specs, block.batch_spec(mode)),
        out_specs=(fs.P(), specs),
    )
    with fs.comm_stats() as stats:
        step(params, x)
    return stats.rows()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    cfg = block.BlockConfig(dim=a.dim, heads=a.heads, ffn=a.ffn)
    print(f"block dim={a.dim} heads={a.heads} ffn={a.ffn}, global batch {a.batch} x seq {a.seq}, float32; per device")
    header = (
        f"{'mode':<8} {'collective':<13} {'axis':<8} {'calls':>5} {'theory':>6} {'bytes':>12} {'theory':>12} "
        f"{'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    all_exact = True
    for mode in block.MODES:
        got = measure(cfg, mode, a.batch, a.seq)
        want = block.comm_theory(cfg, mode, batch=a.batch, seq=a.seq)
        total_got = sum(b for _, b in got.values())
        total_want = sum(b for _, b in want.values())
        for key in sorted(set(got) | set(want)):
            (c, b), (tc, tb) = got.get(key, (0, 0)), want.get(key, (0, 0))
            ratio = b / tb if tb else float("inf")
            all_exact &= (c, b) == (tc, tb)
            print(f"{mode:<8} {key[0]:<13} {key[1]:<8} {c:>5} {tc:>6} {b:>12,} {tb:>12,} {ratio:>6.3f}")
        ratio = total_got / total_want
        print(f"{mode:<8} {'total':<13} {'':<8} {'':>5} {'':>6} {total_got:>12,} {total_want:>12,} {ratio:>6.3f}")
        print("-" * len(header))
    print("measured == theory for every collective:", all_exact)


if __name__ == "__main__":
    main()
