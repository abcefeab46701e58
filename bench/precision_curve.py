"""The bf16 loss curve against the float32 one: the train job run twice, same seed, per-step relative difference.

Runs ``python -m funcshard train`` (the default mesh, model, data and 200 steps unless told otherwise) once with
``--dtype fp32`` and once with ``--dtype bf16`` (``fs.Precision``: float32 master weights and AdamW moments,
bfloat16 compute, float32 loss / softmax statistics / RMSNorm / gradient reductions), each in a fresh process
with the same ``--seed`` (the same init and the same batches), reads each run's ``metrics.csv`` and prints the
relative difference of the training loss per step, ``|bf16 - fp32| / fp32``: its max (and at which step), mean,
the mean and max over the last 50 steps, and the final step's; ``--show N`` prints the N worst steps. The issue's
acceptance: within 2% of the float32 curve over 200 steps.

Usage:
    python bench/precision_curve.py                         # 2 x 200 steps of the default job (bf16 is slow on CPU)
    python bench/precision_curve.py --steps 50 -- --mesh dp=2   # anything after -- goes to both train runs
    python bench/precision_curve.py --reuse /tmp/curves         # summarise runs already in that folder

Measured (2-core CPU shared with 3 other jobs, load 7-11; the default job: dp=2 x tp=2 sim, 3.08M params, batch
16 x 128, 200 steps, lr 3e-3 after 20 warmup steps, seed 0). The per-step training loss is a different batch each
step and the run is chaotic around the peak learning rate (loss spikes at steps 18-30 in either dtype), so its
per-step max mostly measures that: the same fp32 job on another mesh (``dp=4``: only the summation order differs)
is itself 2.14% off at one step. The validation loss (fixed held-out batches, every 25 steps) is the steadier curve.

    before the embedding fix (bf16 summed the embedding's gradient in bf16 on CPU: 2.75% off fp32, 4x the rest):
      validation: max 2.36% at step 25, then <= 0.63% (50-200), final 0.45%
      training, per step: max 5.42% at step 30 (14 of 200 steps over 2%), mean 0.83%, last 50 steps mean 0.70% /
      max 2.08%, final 0.95%; 10-step moving average max 1.76% (step 29), mean 0.48%
    fp32 dp=4 against fp32 dp=2 x tp=2 (the noise floor): validation max 0.80%; training per step max 2.14% (one
      step over 2%), mean 0.35%, last 50 mean 0.47% / max 1.58%; moving average max 0.43%
    after the fix (embedding gradient 0.57% off fp32, as the other weights), all 200 steps (fp32 re-run on the same
    code: bitwise its earlier curve):
      validation: +0.19% at step 25 (was +2.36%), then -1.12 -0.16 -0.72 -1.64 -1.55 -2.21 -1.99% (steps 50-200:
      bf16 LOWER than fp32); max 2.21% at step 175, mean 1.06%, final 1.99%
      training, per step: max 7.41% at step 30 (54 of 200 steps over 2%), mean 1.36%, last 50 steps mean 2.11% /
      max 4.18%, final 2.37% (fp32 1.8988, bf16 1.8538); 10-step moving average max 2.56% (step 198), mean 1.17%
    Not met: "within 2% of the fp32 curve over 200 steps" holds for neither run at every step; the gap is not a
    bf16 loss of precision at one op (step 1-11 agree to 0.07%; loss, softmax statistics, RMSNorm, RoPE,
    cross-entropy and AdamW's masters are fp32; the one op that summed in bf16, the CPU embedding backward, is
    fixed) but the divergence of two chaotic trajectories, larger than the fp32 reorder floor.

    The peer oracle (``bench/precision_peer.py``: the ``nn.Module`` twin on the same init, batches, clipping,
    AdamW and schedule, one process; load 4-15, same machine): torch's own bf16 moves the curve as much or more.
    Step 0's gradients (the default batch) against fp32, per leaf: funcshard bf16 0.51-0.77%, the twin's
    FSDP2-style bf16 0.51-0.76% (each leaf within 0.011 points of funcshard's), autocast 0.44-0.68%; loss +6e-6 / +9e-6.
      twin fp32 vs funcshard fp32 (two implementations, fp32: the summation order only): validation max 0.96%
        (step 125), final 0.54%; per step max 3.45% (2 of 200 over 2%), mean 0.56%, last 50 mean 0.70%; moving
        average max 1.30%
      twin bf16 (FSDP2's MixedPrecisionPolicy: fp32 masters, weights cast to bf16 in the graph) vs twin fp32:
        validation +4.12 +2.88 +2.00 +0.82 +2.57 +1.92 +1.87 +1.63% (steps 25-200: bf16 HIGHER); max 4.12%, mean
        1.98%; per step max 6.83% at step 25 (91 of 200 steps over 2%), mean 1.85%, last 50 mean 1.94% / max
        3.67%, final 2.30% (fp32 1.8893, bf16 1.9329); moving average max 3.12% (step 29), mean 1.81%
      twin autocast (bf16 matmuls only; residual stream and norms fp32) vs twin fp32: validation +3.30% (25), then
        within 0.78% (50-200), final -0.59%; per step max 5.80% at step 30 (13 of 200 over 2%), mean 0.83%, last 50
        mean 0.76% / max 2.74%; moving average max 1.46%
      funcshard bf16 vs twin bf16 (63 steps: the bf16 job stopped there): validation -3.75% (25), -3.62% (50);
        per step max 6.00%, mean 1.86%
    So funcshard's bf16 is not the outlier: torch's own bf16 is further from its fp32 curve (validation max 4.12%
    vs 2.21%, 91 vs 54 steps over 2%), in the other direction. The 2% bar fails at the default lr 3e-3 in torch
    too. At lr 1e-3 (the twin, all else the default): bf16 vs fp32 validation max 1.05%, final 0.44%; per step
    max 5.25% at step 17 (4 of 200 over 2%), mean 0.50%, last 50 mean 0.44%; moving average max 0.70%; and the
    fp32 run's final validation loss is lower: 1.8544 against 1.9263 (twin) / 1.9368 (funcshard) at lr 3e-3.
    At lr 2e-3: bf16 vs fp32 validation max 0.91%, final 0.23%; per step max 3.09% (6 of 200 over 2%), mean 0.60%;
    moving average max 0.94%; fp32 final validation 1.8719. The per-step rises at steps 18-30 are hard batches:
    the same steps rise at every lr (16 steps over 200 exceed their 5-step mean by 8% at 1e-3, 2e-3 and 3e-3).

    The job's default lr is 1e-3 since then (b7af064). funcshard itself at lr 1e-3, all else the default (fp32 and
    bf16 runs of ``python -m funcshard train``, load 6-14, nice): fp32 final validation 1.8546 (1.9368 at 3e-3);
    bf16 vs fp32 validation -0.00 -0.35 +1.27 +0.41 -0.10 +0.31 +0.37 +0.58 +0.43% (steps 0-200): max 1.27% at
    step 50, mean 0.42%, final 0.43%; 10-step moving average max 0.93% (step 179), mean 0.46%; per step max 4.69%
    at step 17 (6 of 200 over 2%), mean 0.60%, last 50 mean 0.69% / max 1.55%, final 0.47% (fp32 1.8246, bf16
    1.8331). Within 2% of the fp32 curve on validation and on the moving average; single steps are not, as they
    are not for torch's own bf16 (5.25%) nor for two fp32 implementations (3.45%).
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
