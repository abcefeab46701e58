"""``python -m funcshard plan``: does the train step fit, what does it send, how fast would it run.

Example:
    >>> main(["--preset", "debug", "--mesh", "dp=2,tp=2", "--seq", "64", "--batch", "4"])  # doctest: +ELLIPSIS
    plan: debug ...
    0
"""

from __future__ import annotations

import argparse
import json
import sys

from ..cli import UsageError, plan_parser, run
from ..machine import human_bytes
from .estimate import PARTS, Estimate, advice, estimate, n_params, resolve_defaults
from .search import search

__all__ = ["main", "plan", "report", "resolve_defaults"]


def plan(args: argparse.Namespace) -> int:
    """Run the ``plan`` command on parsed options; 0 when the planned step fits (or ``--search`` found one)."""
    resolve_defaults(args)
    if args.search:
        if args.gpus is None:
            raise UsageError("--search needs --gpus N: the number of devices to lay the step out on.")
        ranked = search(args, args.gpus)
        if args.json:
            print(json.dumps([e.as_dict() for e in ranked[: args.top]], indent=1, default=str))
        else:
            print(ranking(ranked[: args.top], args))
        return 0 if ranked else 1
    e = estimate(args)
    print(json.dumps(e.as_dict(), indent=1, default=str) if args.json else report(e, args))
    return 0 if e.fits else 1


def report(e: Estimate, args: argparse.Namespace) -> str:
    """The estimate as text: the layout, memory by part against the device, communication by axis, the time."""
    name = args.preset or getattr(args, "model", "llama")
    pipe = f", {e.cfg.pp_schedule} x {e.cfg.microbatches(e.mesh['pp'])} microbatches" if e.mesh.get("pp", 1) > 1 else ""
    lines = [
        f"plan: {name} ({n_params(e.cfg) / 1e9:.2f}B params) on {e.mesh} ({e.devices} devices), {e.hardware.name}, "
        f"{e.dtype}, remat {e.cfg.remat}, batch {e.batch} x seq {e.seq}{pipe}",
        "",
        f"memory per device: {'fits' if e.fits else 'DOES NOT FIT'}: peak {human_bytes(e.memory['peak'])} of "
        f"{human_bytes(e.capacity)}",
    ]
    for part in PARTS:
        lines.append(f"  {part:<16} {human_bytes(e.memory[part]):>10}  {_bar(e.memory[part], e.capacity)}")
    if not e.fits:
        total = n_params(e.cfg)
        lines.append(
            f"  the model's fp32 master weights are {human_bytes(4 * total)} in all ({total / 1e9:.1f}B parameters; "
            f"{human_bytes(16 * total)} with gradients and AdamW's two moments), over {e.devices} devices"
        )
        lines.append("  " + advice(e.memory, e.capacity))
    lines += [
        "",
        "communication per device (one step):",
        f"  {'collective':<14} {'axis':<10} {'calls':>7} {'bytes':>10}",
    ]
    for (coll, axes), (calls, nbytes) in sorted(e.comm_rows.items()):
        lines.append(f"  {coll:<14} {axes:<10} {calls:>7} {human_bytes(nbytes):>10}")
    t = e.time
    lines += ["", "time per step (estimate):"]
    lines += ["  " + line for line in t.table().splitlines()]
    lines += [
        "",
        f"tokens/s per device {e.tokens_per_s:,.0f}   MFU {e.mfu:.1%}   FLOPs per device {e.cost['flops']:.3g}",
        f"(analysed in {e.seconds:.1f} s on an abstract mesh; hardware efficiency {e.hardware.efficiency})",
    ]
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)


def ranking(ranked: list[Estimate], args: argparse.Namespace) -> str:
    """The layouts of ``--search``, fastest first."""
    if not ranked:
        return f"plan --search: no layout of {args.gpus} devices fits {args.hardware} (see plan without --search)."
    head = f"{'#':>3} {'mesh':<34} {'remat':<10} {'mb':>3} {'peak':>9} {'step':>9} {'tok/s/dev':>10} {'MFU':>6}"
    lines = [f"layouts of {args.gpus} x {args.hardware} that fit, fastest first:", head]
    for i, e in enumerate(ranked, 1):
        mb = e.cfg.microbatches(e.mesh["pp"]) if e.mesh.get("pp", 1) > 1 else "-"
        mesh = ",".join(f"{a}={n}" for a, n in e.mesh.items())
        lines.append(
            f"{i:>3} {mesh:<34} {e.cfg.remat:<10} {mb!s:>3} {human_bytes(e.memory['peak']):>9} "
            f"{e.time.total * 1e3:>7.0f}ms {e.tokens_per_s:>10,.0f} {e.mfu:>6.1%}"
        )
    return "\n".join(lines)


def _bar(n: float, cap: float, width: int = 30) -> str:
    k = min(width, round(width * n / cap)) if cap else 0
    return "#" * k + "." * (width - k)


def main(argv: list[str] | None = None) -> int:
    """``python -m funcshard plan [options]``; 0: it fits, 1: it does not, 2: bad usage."""
    return run(plan_parser(), plan, sys.argv[1:] if argv is None else argv)
