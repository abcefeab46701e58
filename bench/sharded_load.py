"""Peak memory of loading a ~400 MB Hugging Face Llama folder on ``fsdp=4`` (4 gloo processes): ``llama.from_hf(path,
mesh=...)`` (each process reads only its own blocks) against ``from_hf(path)`` + ``fs.device_put`` (each process
reads the whole model, then keeps its shards).

Each rank measures its peak resident memory during the load (``/proc/self/clear_refs`` resets the peak,
``VmHWM`` reads it; mapped file pages count while mapped) minus its resident memory before, as a multiple of
the model's size on disk (float32). Issue #31's bound for the sharded load: below 0.4x on every rank.

Usage:
    python bench/sharded_load.py                # writes the folder once (to /tmp), spawns 4 processes (~2 min)
    python bench/sharded_load.py --folder DIR   # an existing folder (any Llama: config.json + safetensors)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.models import llama

# 102M parameters: 410 MB of float32 on disk
CFG = llama.Config(vocab_size=16000, dim=1024, n_layers=6, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_seq_len=256)


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_growth(load: object) -> tuple[float, object]:
    """(peak resident bytes during ``load()`` above the resident bytes before it, its result)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _kib("VmRSS")
    out = load()  # type: ignore[operator]
    return _kib("VmHWM") - before, out


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    folder = Path(args.folder)
    mesh = fs.make_mesh({"fsdp": 4})
    size = _folder_bytes(folder)
    sharded, arrays = _peak_growth(lambda: llama.from_hf(folder, mesh=mesh)[1])
    wq = fs.device_get(arrays["layers"]["wq"])[0, :2, :4].clone()  # (a collective: every rank)
    del arrays
    gc.collect()
    whole, arrays = _peak_growth(lambda: fs.device_put(llama.from_hf(folder)[1], mesh, llama.param_specs(CFG, mesh)))
    assert torch.equal(fs.device_get(arrays["layers"]["wq"])[0, :2, :4], wq)  # the same values either way
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (sharded, whole))
    if dist.get_rank() == 0:
        print(f"Llama {CFG.num_params() / 1e6:.0f}M params: {size / 1e6:.0f} MB of safetensors; fsdp=4, 4 processes")
        print("peak memory growth while loading, per rank (x the model's size):")
        print("  rank   from_hf(mesh=...)   from_hf + device_put")
        for r, (s, w) in enumerate(rows):
            print(f"  {r:>4}   {s / 1e6:6.0f} MB {s / size:5.2f}x   {w / 1e6:6.0f} MB {w / size:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=None, help="a Llama folder (default: a random one written to /tmp once)")
    args = ap.parse_args()
    if args.folder is None:
        args.folder = os.path.join(tempfile.gettempdir(), "funcshard-bench-llama-400mb")
        if not (Path(args.folder) / "config.json").is_file():
            print(f"writing a random {CFG.num_params() / 1e6:.0f}M-parameter folder to {args.folder} ...", flush=True)
            llama.to_hf(llama.init(fs.random.key(0), CFG), CFG, args.folder, dtype=torch.float32)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import launch

    launch(_run, args, world=4, timeout_s=600)


if __name__ == "__main__":
    main()
