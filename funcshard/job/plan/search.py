"""``plan --search --gpus N``: every layout of the train step over N devices that fits, fastest first.

The layouts are the meshes ``{pp, fsdp, cp, tp}`` whose sizes multiply to N (tp inside a node and fitting the
key / value heads, pp up to 8 and at most the layers, cp only for long sequences), each with the remat policies
from the cheapest (none, selective, full): once one fits, the dearer ones are not tried (the same communication
and more recomputation cannot be faster). A layout
whose parameters, gradients and AdamW moments alone (16 bytes a parameter, sharded over fsdp x tp x pp) exceed
the device is dropped before any analysis.

Each layout is lowered with one and with two layers per pipeline stage, and its FLOPs, communication and memory
are extended linearly to the model's layers (every layer is the same program: the costs are affine in the layer
count, the embedding and head being the constant part), so a search over a 70B model costs the analysis of
small ones. ``estimate`` lowers the whole model (``plan`` without ``--search``).

Example:
    >>> from funcshard.job.cli import plan_parser
    >>> args = plan_parser().parse_args(["--preset", "debug", "--seq", "64", "--batch", "8", "--hardware", "h100"])
    >>> ranked = search(args, 4, progress=False, workers=1)
    >>> all(e.fits for e in ranked) and len(ranked) > 1
    True
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import sys
from typing import Any

import funcshard as fs
from funcshard.models.llama import sharding as llama_sharding
from funcshard.pipeline import by_name

from ..cli import UsageError
from ..machine import human_bytes
from .estimate import PARTS, UPDATE_PASSES, Estimate, estimate, n_params, plan_config
from .hardware import hardware
from .timing import step_time

__all__ = ["candidates", "search"]

_BYTES_PER_PARAM = 16  # fp32 master weight, gradient and two AdamW moments


def candidates(args: argparse.Namespace, n: int) -> list[dict[str, int]]:
    """The meshes of ``n`` devices the search considers for the model of ``args``, before any analysis.

    Example:
        >>> from funcshard.job.cli import plan_parser
        >>> args = plan_parser().parse_args(["--preset", "debug", "--seq", "64", "--batch", "8"])
        >>> candidates(args, 4)
        [{'fsdp': 4}, {'fsdp': 2, 'tp': 2}, {'tp': 4}, {'pp': 2, 'fsdp': 2}, {'pp': 2, 'tp': 2}]
    """
    cfg = plan_config(args)
    node = hardware(args.hardware).node_size
    out = []
    for pp in _powers(n):
        if cfg.n_layers < pp or pp > 8:  # (layers pp does not divide: earlier stages take one more)
            continue
        for tp in _powers(n // pp):
            if tp > node or not llama_sharding.heads_fit(cfg, tp):  # (kv heads replicated where tp exceeds them)
                continue
            for cp in _powers(n // (pp * tp)):
                if cp > 1 and args.seq < 16384:  # (a length cp does not divide: zigzag over tensor_split's blocks)
                    continue
                fsdp = n // (pp * tp * cp)
                if args.batch % fsdp or (pp > 1 and (args.batch // fsdp) % cfg.microbatches(pp)):
                    continue
                shape = {"pp": pp, "fsdp": fsdp, "cp": cp, "tp": tp}
                mesh = {a: s for a, s in shape.items() if s > 1} or {"fsdp": 1}
                out.append(mesh)
    return sorted(out, key=lambda m: (m.get("pp", 1), -m.get("fsdp", 1), m.get("tp", 1)))


def _powers(n: int) -> list[int]:
    """The powers of two that divide ``n``."""
    return [p for p in (2**i for i in range(int(math.log2(n)) + 1)) if n % p == 0]


def search(args: argparse.Namespace, n: int, *, progress: bool = True, workers: int | None = None) -> list[Estimate]:
    """Every layout of ``n`` devices (:func:`candidates`, each with its cheapest remat policy that fits) that fits,
    fastest first. The layouts are analysed in ``workers`` processes (default: one per core; 1: in this one)."""
    cfg = plan_config(args)
    total = n_params(cfg)
    capacity = hardware(args.hardware).hbm_bytes
    meshes = []
    for mesh in candidates(args, n):
        shards = mesh.get("fsdp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
        if total * _BYTES_PER_PARAM / shards <= capacity:  # else the state alone does not fit
            meshes.append(mesh)
    if not meshes:
        raise UsageError(
            f"plan --search: no layout of {n} devices holds the model's {total / 1e9:.1f}B parameters with their "
            f"gradients and AdamW state ({human_bytes(total * _BYTES_PER_PARAM)}) within {human_bytes(capacity)} "
            f"per device; use more devices."
        )
    workers = min(len(meshes), os.cpu_count() or 1) if workers is None else workers
    found: list[Estimate] = []
    if workers <= 1:
        for i, mesh in enumerate(meshes, 1):
            if progress:
                _bar(i, len(meshes), mesh)
            found += _fastest_fitting(args, mesh)
    else:
        ctx = multiprocessing.get_context("spawn")  # (no fork of a process that holds torch's threads)
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = {pool.submit(_fastest_fitting, args, mesh): mesh for mesh in meshes}
            for i, done in enumerate(concurrent.futures.as_completed(futures), 1):
                if progress:
                    _bar(i, len(meshes), futures[done])
                found += done.result()
    if progress:
        print(file=sys.stderr)
    return sorted(found, key=lambda e: e.time.total)


def _fastest_fitting(args: argparse.Namespace, mesh: dict[str, int]) -> list[Estimate]:
    """The estimate of ``mesh`` with the cheapest remat policy that fits (none, selective, full), or nothing: a
    dearer policy has the same communication and more recomputation, so it cannot be faster."""
    for remat in ("none", "selective", "full"):
        try:
            e = extrapolated(argparse.Namespace(**{**vars(args), "remat": remat}), mesh)
        except (UsageError, fs.ShardingError, fs.ConfigError):
            return []
        if e.fits:
            return [e]
    return []


def extrapolated(args: argparse.Namespace, mesh: dict[str, int]) -> Estimate:
    """:func:`estimate` of ``mesh``, from two lowered copies of the model with one and two layers per pipeline
    stage (per chunk of a stage, for schedules with several), extended linearly to its layers.

    The peak memory, the FLOPs and the communication are affine in the layer count. The peak's parts are not:
    which buffers are live at the peak can change from one layer count to the next. The parameters and the
    optimiser state are extended (they are affine), the other parts are the larger copy's, and the peak's growth
    beyond those goes to the activations, the part that grows with the layers (each layer's saved inputs).
    """
    cfg = plan_config(args)
    pp = mesh.get("pp", 1)
    chunks = by_name(cfg.pp_schedule, pp, cfg.microbatches(pp)).n_virtual if pp > 1 else 1
    # the largest chunk's layers: where pp x chunks does not divide them, earlier chunks take one more, and the
    # stage holding them sets the step and the peak; it is estimated as if every chunk had as many
    per_chunk = -(-cfg.n_layers // (pp * chunks))
    if per_chunk <= 2:
        return estimate(args, mesh)
    small = [estimate(_with_layers(args, pp * chunks * k), mesh) for k in (1, 2)]
    scale = per_chunk - 1  # the second point is one layer per chunk more than the first

    def line(a: float, b: float) -> int:
        return round(a + (b - a) * scale)

    a, b = small
    memory = dict(b.memory)
    for part in ("peak", "params", "optimizer_state"):
        memory[part] = line(a.memory[part], b.memory[part])
    memory["activations"] += memory["peak"] - sum(memory[p] for p in PARTS)
    rows = {
        key: (line(a.comm_rows.get(key, (0, 0))[0], c), line(a.comm_rows.get(key, (0, 0))[1], nb))
        for key, (c, nb) in b.comm_rows.items()
    }
    flops = line(a.cost["flops"], b.cost["flops"])
    calls: dict[Any, int] = {}
    sent: dict[Any, int] = {}
    for (_, axes), (c, nb) in rows.items():  # per axis, as ``cost_analysis`` keys them
        k = axes if "," not in axes else tuple(axes.split(","))
        calls[k], sent[k] = calls.get(k, 0) + c, sent.get(k, 0) + nb
    cost = {**b.cost, "flops": flops, "comm_bytes": sent, "comm_calls": calls}
    t = b.time
    bubble = t.bubble / t.total if t.total else 0.0
    update = UPDATE_PASSES * memory["params"]
    timing = step_time(flops, rows, mesh, b.hardware, dtype=b.dtype, bubble=bubble, memory_bytes=update)
    out = dataclasses.replace(b, cfg=cfg, memory=memory, cost=cost, comm_rows=rows, time=timing)
    out.seconds = a.seconds + b.seconds
    to = (
        f"{cfg.n_layers}"
        if not cfg.n_layers % (pp * chunks)
        else f"{pp * chunks * per_chunk} ({cfg.n_layers} with "
        f"{per_chunk} in the largest of the {pp * chunks} chunks: every chunk counted as large)"
    )
    out.notes = [*b.notes, f"extended linearly from {pp * chunks} and {2 * pp * chunks} layers to {to}"]
    return out


def _with_layers(args: argparse.Namespace, layers: int) -> argparse.Namespace:
    """``args`` for the same model with ``layers`` layers."""
    return argparse.Namespace(**{**vars(args), "layers_override": layers})


def _bar(i: int, n: int, mesh: dict[str, int]) -> None:
    width = 24
    k = width * i // n
    text = ",".join(f"{a}={s}" for a, s in mesh.items())
    print(f"\rsearching [{'#' * k}{'.' * (width - k)}] {i}/{n} layouts ({text:<24})", end="", file=sys.stderr)
