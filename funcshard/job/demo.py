"""The demo job: a DP x TP MLP regression trained with a functional step, on a simulated mesh or torchrun.

Until the Llama training job lands this is what ``python -m funcshard demo`` runs: it shows the mesh, where
each weight lives, a progress bar with the loss, the communication table of one step, and checks the final
loss against the same model trained without sharding.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P

from .cli import demo_parser, finite_positive, parse_mesh, run

__all__ = ["parse_mesh", "run_demo"]  # parse_mesh lives in cli


def _params(d: int, h: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(h, d, generator=g) / math.sqrt(d),
        "w2": torch.randn(d, h, generator=g) / math.sqrt(h),
    }


def _data(step: int, batch: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, d, generator=g)
    return x, torch.sin(x.roll(1, dims=1)) * 0.5 + x * 0.25


def _ref_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((F.linear(F.gelu(F.linear(x, p["w1"])), p["w2"]) - y) ** 2).mean()


def run_demo(mesh_shape: dict[str, int], *, steps: int, lr: float, d: int = 32, h: int = 128, batch: int = 32) -> float:
    """Train the demo MLP for ``steps`` steps; return the final loss. Checks it against an unsharded run.

    Args:
        mesh_shape: ``{axis: size}`` over ``dp``, ``fsdp`` and ``tp``.
        steps: training steps.
        lr: SGD learning rate.
        d: input and output width of the MLP.
        h: hidden width (split over ``tp``).
        batch: global batch (split over ``dp`` / ``fsdp``).

    Returns:
        The final training loss.

    Raises:
        MeshError: an axis the demo does not use.
        ShardingError: the sharded loss differs from the unsharded one.

    Example:
        >>> run_demo({"dp": 2, "tp": 2}, steps=5, lr=0.05)  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    mesh = fs.make_mesh(mesh_shape)
    lead = mesh.process_index() == 0
    axes = mesh.axis_names
    dp = tuple(a for a in axes if a in ("dp", "fsdp"))
    tp = "tp" if "tp" in axes else None
    for a in axes:
        if a not in ("dp", "fsdp", "tp"):
            raise fs.MeshError(
                f"demo: axis '{a}' is not used by the demo MLP; use dp and/or tp (e.g. --mesh dp=2,tp=2)."
            )
    specs = {"w1": P(tp, None), "w2": P(None, tp)}
    batch_spec = P(dp or None)

    def loss_local(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hid = F.gelu(F.linear(x, p["w1"]))  # [b/dp, d] @ [d, h/tp] -> [b/dp, h/tp]
        out = F.linear(hid, p["w2"])  # [b/dp, h/tp] @ [h/tp, d] -> [b/dp, d] (partial over tp)
        if tp:
            out = fs.psum(out, tp)  # [b/dp, d] -> [b/dp, d]
        loss = ((out - y) ** 2).mean()
        return fs.pmean(loss, dp) if dp else loss

    def step(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        grads, loss = torch.func.grad_and_value(loss_local)(p, x, y)
        return loss, {k: p[k] - lr * grads[k] for k in p}

    train_step = fs.shard_map(step, mesh=mesh, in_specs=(specs, batch_spec, batch_spec), out_specs=(P(), specs))
    full = _params(d, h, seed=0)
    params = fs.device_put(full, mesh, specs)
    if lead:
        print(f"mesh {mesh}  ({mesh.size} devices)")
        print("w1 (column-parallel):")
        fs.visualize(params["w1"])
    ref = {k: v.clone() for k, v in full.items()}
    bar = tqdm(range(steps), desc="demo", disable=not lead, file=sys.stdout)
    loss_v = float("nan")
    ref_loss = float("nan")
    for i in bar:
        x, y = _data(i, batch, d)
        if i == 0:
            with fs.comm_stats() as stats:
                loss, params = train_step(params, x, y)
        else:
            loss, params = train_step(params, x, y)
        loss_v = float(fs.device_get(loss))
        # the same step without sharding, for the check at the end
        g, ref_l = torch.func.grad_and_value(_ref_loss)(ref, x, y)
        ref = {k: ref[k] - lr * g[k] for k in ref}
        ref_loss = float(ref_l)
        bar.set_postfix(loss=f"{loss_v:.4f}")
    if lead:
        print("communication of one step (one device):")
        print(stats.table())
        print(f"final loss {loss_v:.6f}; unsharded reference {ref_loss:.6f}")
    if not math.isclose(loss_v, ref_loss, rel_tol=1e-4, abs_tol=1e-6):
        raise fs.ShardingError(f"demo: sharded loss {loss_v} differs from the unsharded {ref_loss}")
    return loss_v


def main(argv: list[str] | None = None) -> int:
    """Command-line entry of the demo.

    Args:
        argv: the command-line options (default ``sys.argv[1:]``): ``--mesh``, ``--steps``, ``--lr``.

    Returns:
        The exit code: 0, or 2 with one ``error: ...`` line on stderr.

    Example:
        >>> main(["--mesh", "pp=2"])  # the demo has no pipeline axis
        2
    """

    def job(args: argparse.Namespace) -> float:
        finite_positive("--lr", args.lr)
        return run_demo(parse_mesh(args.mesh), steps=args.steps, lr=args.lr)

    return run(demo_parser(), job, argv)
