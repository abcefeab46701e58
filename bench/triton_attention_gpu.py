"""``funcshard.ops.triton.flash_attention`` on a CUDA GPU: accuracy and speed beside torch's SDPA.

For each shape (``[batch, heads, seq, head_dim]``, causal or not, GQA where ``hkv < hq``) the script

1. checks accuracy: the max abs error of out, lse and the gradients of q, k, v of flash_attention in bf16 / fp16
   against a float32 reference (``funcshard.ops.attention`` on float32 copies), beside the error of
   ``torch.nn.functional.scaled_dot_product_attention`` in the same dtype (its lse: none); a flash error more
   than 4x SDPA's (plus 1e-3) is reported as FAIL and the script exits with status 1;
2. times the forward and forward + backward (CUDA events, median of ``--iters``) of both, and prints TFLOP/s
   (forward ``4 b h s^2 d`` FLOPs, halved when causal; backward 2.5x the forward) and the ratio flash / SDPA.

Usage (about a minute on an H100 / H200, most of it Triton compiling the kernels once per variant):
    python bench/triton_attention_gpu.py [--iters 20]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [  # b, hq, hkv, s, d, causal
    (4, 16, 16, 2048, 64, False),
    (4, 16, 16, 2048, 64, True),
    (4, 16, 16, 2048, 128, False),
    (4, 16, 16, 2048, 128, True),
    (4, 16, 4, 2048, 128, True),  # GQA: 4 query heads per kv head
]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [b, hkv, s, d] -> [b, hq, s, d]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _time(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of ``fn`` (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _grads(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    lse = None
    if isinstance(out, tuple):
        out, lse = out
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


def accuracy(shape: tuple, dtype: torch.dtype) -> bool:
    """Print the max abs errors against float32 of flash_attention and SDPA; True if flash's are in line."""
    from funcshard.ops import attention
    from funcshard.ops.triton import flash_attention

    b, hq, hkv, s, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, device="cuda", generator=gen)
    ref_out, ref_lse, ref_g = _grads(lambda *a: attention(*a, causal=causal, return_lse=True), q, k, v, dout)
    low = [t.to(dtype) for t in (q, k, v, dout)]
    fa_out, fa_lse, fa_g = _grads(lambda *a: flash_attention(*a, causal=causal, return_lse=True), *low)
    sd_out, _, sd_g = _grads(lambda *a: _sdpa(*a, causal), *low)

    def err(a: torch.Tensor, r: torch.Tensor) -> float:
        return (a.float() - r).abs().max().item()

    names = ("out", "dq", "dk", "dv")
    fa = [err(fa_out, ref_out), *(err(g, r) for g, r in zip(fa_g, ref_g))]
    sd = [err(sd_out, ref_out), *(err(g, r) for g, r in zip(sd_g, ref_g))]
    ok = all(f <= 4 * e + 1e-3 for f, e in zip(fa, sd))
    cells = "  ".join(f"{n} {f:.2e} (sdpa {e:.2e})" for n, f, e in zip(names, fa, sd))
    tag = "ok  " if ok else "FAIL"
    print(f"  {tag} {str(dtype).removeprefix('torch.'):8s} max|err| vs fp32: {cells}  lse {err(fa_lse, ref_lse):.2e}")
    del ref_out, ref_lse, ref_g
    torch.cuda.empty_cache()
    return ok


def speed(shape: tuple, dtype: torch.dtype, iters: int) -> None:
    """Print TFLOP/s of the forward and forward + backward of flash_attention and SDPA."""
    from funcshard.ops.triton import flash_attention

    b, hq, hkv, s, d, causal = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    fns = {
        "flash": lambda: flash_attention(q, k, v, causal=causal),
        "sdpa": lambda: _sdpa(q, k, v, causal),
    }
    row = []
    for name, fn in fns.items():
        with torch.no_grad():
            fwd = _time(fn, iters)
        both = _time(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout), iters)
        row.append((name, fwd, both))
    (_, f_fwd, f_both), (_, s_fwd, s_both) = row
    tf = lambda ms, mult: flops * mult / (ms * 1e-3) / 1e12  # noqa: E731
    print(
        f"  speed {str(dtype).removeprefix('torch.'):8s} fwd: flash {tf(f_fwd, 1):6.1f} TFLOP/s  sdpa "
        f"{tf(s_fwd, 1):6.1f}  ratio {s_fwd / f_fwd:4.2f}x | fwd+bwd: flash {tf(f_both, 3.5):6.1f}  sdpa "
        f"{tf(s_both, 3.5):6.1f}  ratio {s_both / f_both:4.2f}x   (ratio > 1: flash faster)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("triton_attention_gpu.py: no CUDA GPU here; run it on a machine with one.", file=sys.stderr)
        return 2
    if importlib.util.find_spec("triton") is None:
        print("triton_attention_gpu.py: triton is not installed: pip install 'funcshard[triton]'.", file=sys.stderr)
        return 2
    from funcshard.ops.triton import uses_triton

    if not uses_triton(torch.zeros(1, device="cuda")):
        print("triton_attention_gpu.py: flash_attention would not run the Triton kernels here.", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {importlib.metadata.version('triton')}")
    ok = True
    for i, shape in enumerate(SHAPES):
        b, hq, hkv, s, d, causal = shape
        print(f"b={b} hq={hq} hkv={hkv} s={s} d={d} causal={causal}")
        ok &= accuracy(shape, torch.bfloat16)
        if i == 3:
            ok &= accuracy(shape, torch.float16)
        speed(shape, torch.bfloat16, args.iters)
    print("all errors in line with SDPA's" if ok else "FAIL: some flash_attention errors are far above SDPA's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
