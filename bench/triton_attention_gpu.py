"""``funcshard.ops.triton.flash_attention`` on a CUDA GPU: accuracy and speed beside torch's SDPA.

For each shape (``[batch, heads, seq, head_dim]``, causal or not, GQA where ``hkv < hq``) the script

1. checks accuracy: the max abs error of out, lse and the gradients of q, k, v of flash_attention in bf16 / fp16
   against a float32 reference (``funcshard.ops.attention`` on float32 copies), beside the error of
   ``torch.nn.functional.scaled_dot_product_attention`` in the same dtype (its lse: none); a flash error more
   than 4x SDPA's (plus 1e-3) is reported as FAIL and the script exits with status 1;
2. times the forward and forward + backward (CUDA events, median of ``--iters``) of both, and prints TFLOP/s
   (forward ``4 b h s^2 d`` FLOPs, halved when causal; backward 2.5x the forward) and the ratio flash / SDPA;
3. runs ``ring_attention`` (zigzag, causal, GQA) on a simulated ``{"cp": 2}`` mesh on this GPU with its blocks by
   the kernels and by the torch path (``ops.attention.local.FLASH_DEVICES`` emptied), and prints both errors against
   the float32 unsharded attention (the kernels' more than 4x the torch path's plus 1e-3: FAIL) and both times.

``--cpu-dry-run`` runs steps 1 and 3 at small shapes on CPU through Triton's interpreter (``TRITON_INTERPRET=1``
set before triton's import): a check that the script itself works before a GPU is lent to it.

Usage (about a minute on an H100 / H200, most of it Triton compiling the kernels once per variant):
    python bench/triton_attention_gpu.py [--iters 20]
    python bench/triton_attention_gpu.py --cpu-dry-run     # the script's own check, on CPU (~1 minute)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import statistics
import sys
import time
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
    """Median milliseconds of ``fn`` (after 3 warm-up calls); CUDA events on a GPU, else the wall clock."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
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


def _err(a: torch.Tensor, r: torch.Tensor) -> float:
    return (a.float() - r).abs().max().item()


def accuracy(shape: tuple, dtype: torch.dtype, device: str = "cuda") -> bool:
    """Print the max abs errors against float32 of flash_attention and SDPA; True if flash's are in line."""
    from funcshard.ops import attention
    from funcshard.ops.triton import flash_attention

    b, hq, hkv, s, d, causal = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, generator=gen) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, device=device, generator=gen)
    ref_out, ref_lse, ref_g = _grads(lambda *a: attention(*a, causal=causal, return_lse=True), q, k, v, dout)
    low = [t.to(dtype) for t in (q, k, v, dout)]
    fa_out, fa_lse, fa_g = _grads(lambda *a: flash_attention(*a, causal=causal, return_lse=True), *low)
    sd_out, _, sd_g = _grads(lambda *a: _sdpa(*a, causal), *low)

    names = ("out", "dq", "dk", "dv")
    fa = [_err(fa_out, ref_out), *(_err(g, r) for g, r in zip(fa_g, ref_g))]
    sd = [_err(sd_out, ref_out), *(_err(g, r) for g, r in zip(sd_g, ref_g))]
    ok = all(f <= 4 * e + 1e-3 for f, e in zip(fa, sd))
    cells = "  ".join(f"{n} {f:.2e} (sdpa {e:.2e})" for n, f, e in zip(names, fa, sd))
    tag = "ok  " if ok else "FAIL"
    print(f"  {tag} {str(dtype).removeprefix('torch.'):8s} max|err| vs fp32: {cells}  lse {_err(fa_lse, ref_lse):.2e}")
    del ref_out, ref_lse, ref_g
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ok


def ring(shape: tuple, dtype: torch.dtype, iters: int, device: str = "cuda") -> bool:
    """``ring_attention`` (zigzag, causal) over a simulated ``{"cp": 2}`` mesh on ``device``, its blocks by the
    kernels and by the torch path: errors against the float32 unsharded attention and times (forward +
    backward); True if the kernels' errors are in line with the torch path's."""
    import funcshard as fs
    from funcshard import P
    from funcshard.ops import attention, ring_attention, zigzag_indices, zigzag_inverse_indices

    attention_module = importlib.import_module("funcshard.ops.attention.local")
    b, hq, hkv, s, d, _ = shape
    cp = 2
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, generator=gen) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, device=device, generator=gen)
    ref_out, _, ref_g = _grads(lambda *a: attention(*a, causal=True), q, k, v, dout)
    order, back = zigzag_indices(s, cp).to(device), zigzag_inverse_indices(s, cp).to(device)
    spec = P(None, None, "cp")

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, causal=True)  # [b, hq, s/cp, d] per device
        return out, list(torch.autograd.grad(out, (q, k, v), dout))

    mesh = fs.make_mesh({"cp": cp}, backend="sim")
    f = fs.shard_map(step, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, [spec] * 3))
    args = fs.device_put(tuple(t.to(dtype).index_select(2, order) for t in (q, k, v, dout)), mesh, (spec,) * 4)
    saved = attention_module.FLASH_DEVICES
    errs, ms = {}, {}
    try:
        for name, devices in (("kernels", (device,)), ("torch", ())):
            attention_module.FLASH_DEVICES = devices
            out, grads = f(*args)
            got = [fs.device_get(t).index_select(2, back) for t in (out, *grads)]
            errs[name] = [_err(a, r) for a, r in zip(got, (ref_out, *ref_g))]
            ms[name] = _time(lambda: f(*args), iters)
    finally:
        attention_module.FLASH_DEVICES = saved
    ok = all(a <= 4 * t + 1e-3 for a, t in zip(errs["kernels"], errs["torch"]))
    cells = "  ".join(f"{n} {a:.2e} (torch {t:.2e})" for n, a, t in zip(("out", "dq", "dk", "dv"), *errs.values()))
    print(f"  {'ok  ' if ok else 'FAIL'} ring cp={cp} {str(dtype).removeprefix('torch.'):8s} max|err| vs fp32: {cells}")
    print(
        f"  speed ring fwd+bwd: kernels {ms['kernels']:.2f} ms  torch {ms['torch']:.2f} ms  "
        f"ratio {ms['torch'] / ms['kernels']:4.2f}x   (ratio > 1: kernels faster)"
    )
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
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="small shapes on CPU, interpreted (times mean nothing)"
    )
    args = parser.parse_args()
    if args.cpu_dry_run:
        if importlib.util.find_spec("triton") is None:
            print("triton_attention_gpu.py: triton is not installed: pip install 'funcshard[triton]'.", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
        shape = (1, 4, 2, 32, 16, True)
        ok = accuracy(shape, torch.bfloat16, "cpu") & ring(shape, torch.bfloat16, 1, "cpu")
        print("dry run: ok" if ok else "dry run: FAIL")
        return 0 if ok else 1
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
    print("ring_attention, b=2 hq=16 hkv=4 s=4096 d=128 causal, zigzag over a simulated cp=2 on this GPU")
    ok &= ring((2, 16, 4, 4096, 128, True), torch.bfloat16, args.iters)
    print("all errors in line with SDPA's" if ok else "FAIL: some flash_attention errors are far above SDPA's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
