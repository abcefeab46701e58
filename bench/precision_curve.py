"""The bf16 loss curve against the float32 one: the train job run twice, same seed, per-step relative difference.

Runs ``python -m funcshard train`` (the default mesh, model, data and 200 steps unless told otherwise) once with
``--dtype fp32`` (the baseline) and once with ``--dtype bf16`` (``fs.Precision``: float32 master weights and AdamW
moments, bfloat16 compute, float32 loss / softmax statistics / RMSNorm / gradient reductions), each in a fresh
process with the same ``--seed`` (the same init and the same batches), reads each run's ``metrics.csv`` and prints
the relative difference ``|bf16 - fp32| / fp32``: of the validation loss (fixed held-out batches, every 25 steps:
max and at which step, mean, final, and each evaluation's signed difference), of the training loss's 10-step
moving average (max, mean), and of the training loss per step (max and at which step, how many steps over 2%,
mean, the mean and max over the last 50 steps, the final step's); ``--show N`` prints the N worst steps. The
acceptance: within 2% of the float32 curve over 200 steps. The training loss is a new batch every step, so its
per-step difference is the noisiest of the three; ``bench/precision_peer.py`` measures how far torch's own bf16
and a second float32 implementation move the same curve.

Measured figures: ``docs/guides/speed.md``.

Usage:
    python bench/precision_curve.py                         # 2 x 200 steps of the default job (bf16 is slow on CPU)
    python bench/precision_curve.py --steps 50 -- --mesh dp=2   # anything after -- goes to both train runs
    python bench/precision_curve.py --reuse /tmp/curves         # summarise runs already in that folder
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time


def _losses(path: str, column: str = "train_loss") -> dict[int, float]:
    """step -> ``column`` (``train_loss`` or ``val_loss``) from a train run's ``metrics.csv`` (empty cells skipped)."""
    out: dict[int, float] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get(column):
                out[int(row["step"])] = float(row[column])
    return out


def _moving(d: dict[int, float], w: int) -> dict[int, float]:
    """The mean of the last ``w`` logged values at each step that has ``w`` before it."""
    steps = sorted(d)
    return {s: sum(d[k] for k in steps[i - w + 1 : i + 1]) / w for i, s in enumerate(steps) if i >= w - 1}


def _run(dtype: str, folder: str, args: argparse.Namespace, extra: list[str]) -> float:
    """One train run in a fresh process; its wall seconds."""
    out = os.path.join(folder, dtype)
    cmd = [sys.executable, "-m", "funcshard", "train", "--dtype", dtype, "--seed", str(args.seed)]
    cmd += ["--steps", str(args.steps), "--out", out, "--ckpt-dir", os.path.join(out, "ckpt"), "--overwrite"]
    cmd += ["--ckpt-every", str(10**9), *extra]
    t0 = time.perf_counter()
    with open(os.path.join(folder, f"{dtype}.log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def summary(fp32: dict[int, float], bf16: dict[int, float], last: int = 50) -> dict[str, float]:
    """The relative differences ``|bf16 - fp32| / fp32`` over the steps both runs logged.

    Example:
        >>> s = summary({1: 2.0, 2: 1.0}, {1: 2.02, 2: 1.0})
        >>> round(s["max"], 4), s["max_step"], round(s["mean"], 4)
        (0.01, 1, 0.005)
    """
    steps = sorted(set(fp32) & set(bf16))
    if not steps:
        raise ValueError("the two runs share no step with a training loss")
    rel = {s: abs(bf16[s] - fp32[s]) / abs(fp32[s]) for s in steps}
    worst = max(steps, key=rel.__getitem__)
    tail = steps[-last:]
    return {
        "steps": len(steps),
        "max": rel[worst],
        "max_step": worst,
        "mean": sum(rel.values()) / len(rel),
        "tail_mean": sum(rel[s] for s in tail) / len(tail),
        "tail_max": max(rel[s] for s in tail),
        "final": rel[steps[-1]],
        "final_step": steps[-1],
        "over_2pct": sum(r > 0.02 for r in rel.values()),
    }


def report(ref_csv: str, other_csv: str, *, show: int = 5, names: tuple[str, str] = ("fp32", "bf16")) -> None:
    """Print the statistics of run ``other_csv`` against run ``ref_csv`` (two ``metrics.csv``): the validation
    loss, the training loss's 10-step moving average and per step (max, mean, last 50, final, the ``show`` worst).

    Example:
        >>> report("runs/precision_curve/fp32/metrics.csv", "runs/precision_curve/bf16/metrics.csv")  # doctest: +SKIP
    """
    a, b = names
    fp32, bf16 = _losses(ref_csv), _losses(other_csv)
    vf, vb = _losses(ref_csv, "val_loss"), _losses(other_csv, "val_loss")
    if set(vf) & set(vb):
        v = summary(vf, vb, last=len(vf))
        print(
            f"validation loss (fixed held-out batches), over {v['steps']} evaluations: max {100 * v['max']:.2f}% "
            f"at step {v['max_step']}, mean {100 * v['mean']:.2f}%, final {100 * v['final']:.2f}%"
        )
        print("  " + " ".join(f"{k}:{100 * (vb[k] - vf[k]) / vf[k]:+.2f}%" for k in sorted(set(vf) & set(vb))))
    m = summary(_moving(fp32, 10), _moving(bf16, 10))
    print(
        f"training loss, 10-step moving average: max {100 * m['max']:.2f}% at step {m['max_step']}, "
        f"mean {100 * m['mean']:.2f}%"
    )
    s = summary(fp32, bf16)
    print(f"training loss, {b} vs {a}, |{b} - {a}| / {a} over {s['steps']} steps:")
    print(f"  max    {100 * s['max']:.2f}% at step {s['max_step']} ({s['over_2pct']} steps over 2%)")
    print(f"  mean   {100 * s['mean']:.2f}%")
    print(f"  last 50 steps: mean {100 * s['tail_mean']:.2f}%, max {100 * s['tail_max']:.2f}%")
    print(
        f"  final  {100 * s['final']:.2f}% (step {s['final_step']}: {a} {fp32[s['final_step']]:.4f}, "
        f"{b} {bf16[s['final_step']]:.4f})"
    )
    steps = sorted(set(fp32) & set(bf16), key=lambda k: -abs(bf16[k] - fp32[k]) / fp32[k])[:show]
    for k in steps:
        print(f"  step {k:>4}: {a} {fp32[k]:.4f}  {b} {bf16[k]:.4f}  {100 * (bf16[k] - fp32[k]) / fp32[k]:+.2f}%")


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` cut at ``--``: this script's own arguments, and those passed on to every train run."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--folder", default="runs/precision_curve", help="where the two runs write")
    ap.add_argument("--reuse", default=None, metavar="FOLDER", help="only summarise FOLDER/{fp32,bf16}/metrics.csv")
    ap.add_argument("--show", type=int, default=5, help="print the N steps of largest difference")
    args = ap.parse_args(argv)
    folder = args.reuse or args.folder
    if args.reuse is None:
        os.makedirs(folder, exist_ok=True)
        for dtype in ("fp32", "bf16"):
            wall = _run(dtype, folder, args, extra)
            print(f"{dtype}: {wall:.0f} s", file=sys.stderr)
    report(os.path.join(folder, "fp32", "metrics.csv"), os.path.join(folder, "bf16", "metrics.csv"), show=args.show)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
