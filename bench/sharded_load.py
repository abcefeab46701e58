"""Peak memory of loading a ~400 MB Hugging Face folder on ``fsdp=4`` (4 gloo processes), sharded (each process reads
only its own blocks) against whole (each process reads the whole model, then keeps its shards):

- ``--model llama``: ``llama.from_hf(path, mesh=...)`` against ``llama.from_hf(path)`` + ``fs.device_put``;
- ``--model mixtral``: the same with ``mixtral.from_hf`` (8 experts a layer);
- ``--model bridge``: a Qwen3 folder through ``fs.nn.from_pretrained(path, mesh)`` (the module on the meta device,
  each parameter's shard read by byte ranges) against transformers' ``from_pretrained`` + ``fs.nn.parallelize`` +
  ``fs.device_put``.

Each rank measures its peak resident memory during the load (``/proc/self/clear_refs`` resets the peak,
``VmHWM`` reads it; mapped file pages count while mapped) minus its resident memory before, as a multiple of
the model's size on disk (float32). Issue #31's bound for the sharded load: below 0.4x on every rank.

Usage:
    python bench/sharded_load.py                   # writes the folder once (to /tmp), spawns 4 processes (~2 min)
    python bench/sharded_load.py --model mixtral   # a Mixtral folder (--model bridge: a Qwen3 folder)
    python bench/sharded_load.py --folder DIR      # an existing folder of --model's kind
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.models import llama, mixtral

# 102M parameters: 410 MB of float32 on disk
CFG = llama.Config(vocab_size=16000, dim=1024, n_layers=6, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_seq_len=256)
# 95M parameters (8 experts a layer): 380 MB
MOE = mixtral.Config(
    vocab_size=16000, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=256, n_experts=8
)
# a Qwen3 of the Llama's shape (untied head): 410 MB
QWEN3 = {
    "vocab_size": 16000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


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


def _loaders(model: str, folder: Path, mesh: fs.Mesh) -> tuple[Any, Any, Any]:
    """``(sharded, whole, probe)``: the two loads (each returning a dict-like tree of ``fs.Array``s) and a function
    of the result giving one small block to compare."""
    if model == "bridge":
        import transformers

        def whole() -> dict:
            module = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            params, specs, _ = fs.nn.parallelize(module, mesh)
            names = [n for n, _ in module.named_parameters()]
            return fs.device_put({n: params[n] for n in names}, mesh, {n: specs[n] for n in names})

        name = "model.layers.0.self_attn.q_proj.weight"
        return (lambda: fs.nn.from_pretrained(folder, mesh)[0]), whole, lambda t: fs.device_get(t[name])[:2, :4]
    family = mixtral if model == "mixtral" else llama

    def whole_native() -> dict:
        cfg, params = family.from_hf(folder)  # (the folder's own shape: --folder may hold another)
        return fs.device_put(params, mesh, family.param_specs(cfg, mesh))

    return (
        lambda: family.from_hf(folder, mesh=mesh)[1],
        whole_native,
        lambda t: fs.device_get(t["layers"]["wq"])[0, :2, :4],
    )


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    folder = Path(args.folder)
    mesh = fs.make_mesh({"fsdp": 4})
    size = _folder_bytes(folder)
    sharded_load, whole_load, probe = _loaders(args.model, folder, mesh)
    if args.model == "bridge":  # transformers and the model's classes imported before either load is measured
        fs.nn.empty_pretrained(folder)
    sharded, arrays = _peak_growth(sharded_load)
    block = probe(arrays).clone()  # (a collective: every rank)
    del arrays
    gc.collect()
    whole, arrays = _peak_growth(whole_load)
    assert torch.equal(probe(arrays), block)  # the same values either way
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (sharded, whole))
    if dist.get_rank() == 0:
        names = {"llama": "llama.from_hf", "mixtral": "mixtral.from_hf", "bridge": "fs.nn.from_pretrained"}
        print(f"{args.model}: {size / 1e6:.0f} MB of safetensors ({folder}); fsdp=4, 4 processes")
        print("peak memory growth while loading, per rank (x the model's size):")
        print(f"  rank   sharded ({names[args.model]})   whole + device_put")
        for r, (s, w) in enumerate(rows):
            print(f"  {r:>4}   {s / 1e6:6.0f} MB {s / size:5.2f}x   {w / 1e6:6.0f} MB {w / size:5.2f}x")


def _write_folder(model: str, folder: str) -> None:
    """A random folder of ``model``'s kind (written once)."""
    if model == "bridge":
        import transformers

        print(f"writing a random Qwen3 folder to {folder} ...", flush=True)
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).save_pretrained(folder)
        return
    family, cfg = (mixtral, MOE) if model == "mixtral" else (llama, CFG)
    print(f"writing a random {cfg.num_params() / 1e6:.0f}M-parameter {model} folder to {folder} ...", flush=True)
    family.to_hf(family.init(fs.random.key(0), cfg), cfg, folder, dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "mixtral", "bridge"), default="llama", help="the folder's kind")
    ap.add_argument("--folder", default=None, help="a folder (default: a random one written to /tmp once)")
    args = ap.parse_args()
    if args.folder is None:
        suffix = {"llama": "llama", "mixtral": "mixtral", "bridge": "qwen3"}[args.model]
        args.folder = os.path.join(tempfile.gettempdir(), f"funcshard-bench-{suffix}-400mb")
        if not (Path(args.folder) / "config.json").is_file():
            _write_folder(args.model, args.folder)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import launch

    launch(_run, args, world=4, timeout_s=600)


if __name__ == "__main__":
    main()
