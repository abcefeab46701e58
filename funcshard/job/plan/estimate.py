"""One layout's estimate: the train job's step lowered on an abstract mesh, timed on a hardware entry.

:func:`estimate` builds the step ``train`` would run for the same flags (``train.build_step``) on
``make_mesh(shape, backend="abstract")``, its parameters from ``fs.eval_shape(llama.init, ...)`` (nothing is
allocated), lowers it (``step.lower(...)``: FLOPs as run, communication per axis, the peak of live bytes by part)
and times it with the step-time model (``timing.step_time``: compute at the hardware's achieved rate,
communication by the alpha-beta model at each group's placement, overlap by role, the schedule's own bubble).

Example:
    >>> from funcshard.job.cli import plan_parser
    >>> args = plan_parser().parse_args(["--preset", "debug", "--mesh", "fsdp=2,tp=2", "--seq", "64",
    ...                                  "--batch", "4", "--hardware", "h100"])
    >>> e = estimate(args)
    >>> e.fits, e.memory["peak"] > 0, {"fsdp", "tp"} <= set(e.cost["comm_bytes"])
    (True, True, True)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

import funcshard as fs
from funcshard.models import llama, mixtral

from ..cli import UsageError, parse_mesh
from ..machine import available_memory, human_bytes
from ..step import build_step, model_config, model_module
from .hardware import Hardware, hardware
from .timing import StepTime, bubble_fraction, model_flops, step_time

__all__ = [
    "PARTS",
    "UPDATE_PASSES",
    "Estimate",
    "advice",
    "estimate",
    "lowered_step",
    "n_params",
    "plan_config",
    "resolve_defaults",
]

#: the model's own memory traffic per parameter byte in the optimiser's update (read p, g, m, v; write p, m, v)
UPDATE_PASSES = 7
#: the parts of ``memory_analysis()``'s peak
PARTS = ("params", "grads", "optimizer_state", "activations", "temporaries")


@dataclass
class Estimate:
    """What one layout of the train step costs on one device (the largest where devices differ).

    Attributes:
        mesh: the mesh shape.
        cfg: the model.
        hardware: the hardware entry.
        batch, seq: the global batch (sequences) and the sequence length.
        memory: ``lowered.memory_analysis()``: ``peak`` and its parts, bytes.
        cost: ``lowered.cost_analysis()``: ``flops``, ``comm_bytes`` and ``comm_calls`` per axis.
        comm_rows: ``{(collective, axes): (calls, bytes)}`` of that device.
        time: the step-time model's :class:`~.timing.StepTime`.
        capacity: the device's memory, bytes.
        seconds: how long the analysis took.
    """

    mesh: dict[str, int]
    cfg: llama.Config
    hardware: Hardware
    batch: int
    seq: int
    dtype: str
    memory: dict[str, int]
    cost: dict[str, Any]
    comm_rows: dict[tuple[str, str], tuple[int, int]]
    time: StepTime
    capacity: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the peak fits the device's memory."""
        return self.memory["peak"] <= self.capacity

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second per device."""
        return self.batch * self.seq / self.time.total / self.devices

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (PaLM's model FLOPs, no recomputation counted) per device."""
        return self.time.mfu(self.model_flops / self.devices)

    @property
    def model_flops(self) -> float:
        """The step's model FLOPs over the whole mesh (``6 N T + 12 L d s T``; a mixture of experts' ``N``: the
        parameters a token uses, ``experts_per_token`` experts a layer)."""
        cfg = self.cfg
        used = cfg.active_params() if isinstance(cfg, mixtral.Config) else n_params(cfg)
        n = used - cfg.vocab_size * cfg.dim  # the embedding table is not a matmul
        return model_flops(n, cfg.n_layers, cfg.dim, self.seq, self.batch * self.seq)

    def as_dict(self) -> dict[str, Any]:
        """The estimate as plain data (``plan --json``)."""
        return {
            "mesh": self.mesh,
            "hardware": self.hardware.name,
            "dtype": self.dtype,
            "remat": self.cfg.remat,
            "schedule": self.cfg.pp_schedule if self.mesh.get("pp", 1) > 1 else None,
            "microbatches": self.cfg.microbatches(self.mesh["pp"]) if self.mesh.get("pp", 1) > 1 else None,
            "batch": self.batch,
            "seq": self.seq,
            "params": n_params(self.cfg),
            "fits": self.fits,
            "capacity_bytes": self.capacity,
            "memory_bytes": self.memory,
            "flops_per_device": self.cost["flops"],
            "comm": [
                {"collective": n, "axes": a, "calls": c, "bytes": b}
                for (n, a), (c, b) in sorted(self.comm_rows.items())
            ],
            "time_s": {
                "compute": self.time.compute,
                "comm": self.time.comm,
                "exposed_comm": self.time.exposed_comm,
                "bubble": self.time.bubble,
                "step": self.time.total,
            },
            "tokens_per_s_per_device": self.tokens_per_s,
            "mfu": self.mfu,
            "analysis_s": self.seconds,
        }


@functools.lru_cache(maxsize=64)
def n_params(cfg: llama.Config) -> int:
    """The model's parameter count (from ``fs.eval_shape`` of its init: nothing allocated; once per config, as
    a report and a search ask it for every row)."""
    shapes = fs.eval_shape(model_module(cfg).init, fs.random.key(0), cfg)
    return sum(math.prod(s.shape) for s in optree.tree_leaves(shapes))


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """On GPU hardware ``--dtype bf16`` and ``--remat selective`` unless given (as torchtitan trains); on
    ``cpu`` fp32 and none. ``--batch`` unless given: two sequences per device (of ``--mesh``, or ``--gpus`` with
    ``--search``)."""
    gpu = args.hardware != "cpu"
    if args.batch is None:
        devices = (
            args.gpus if getattr(args, "search", False) and args.gpus else math.prod(parse_mesh(args.mesh).values())
        )
        args.batch = 2 * devices
    if args.dtype is None:
        args.dtype = "bf16" if gpu else "fp32"
    if args.remat is None:
        args.remat = "selective" if gpu else "none"
    return args


def plan_config(args: argparse.Namespace) -> llama.Config:
    """The model ``plan`` lowers: ``--preset`` (the published shapes), else the train job's flags, with the
    flags that are set on top (``--seq``, ``--remat``, ``--dtype``, ``--schedule``, ``--microbatches``, ``--sp``).

    Example:
        >>> from funcshard.job.cli import plan_parser
        >>> cfg = plan_config(plan_parser().parse_args(["--preset", "llama3-8b", "--hardware", "h100"]))
        >>> cfg.dim, cfg.remat, cfg.precision.compute_dtype
        (4096, 'selective', torch.bfloat16)
    """
    base = model_config(resolve_defaults(args))
    layers = getattr(args, "layers_override", None)  # (the search's smaller copies of the model)
    if args.preset is None:
        return base if layers is None else dataclasses.replace(base, n_layers=layers)
    asked = getattr(args, "model", "llama") == "mixtral"
    moe = args.preset in mixtral.PRESETS and (args.preset not in llama.PRESETS or asked)  # ("debug": --model's)
    try:
        cfg = (mixtral if moe else model_module(base)).Config.preset(args.preset)
    except fs.ConfigError as e:
        raise UsageError(f"--preset: {e}") from None
    return dataclasses.replace(
        cfg,
        n_layers=cfg.n_layers if layers is None else layers,
        max_seq_len=args.seq,
        sequence_parallel=base.sequence_parallel,
        pp_schedule=base.pp_schedule,
        pp_microbatches=base.pp_microbatches,
        remat=base.remat,
        precision=base.precision,
    )


def estimate(args: argparse.Namespace, mesh_shape: dict[str, int] | None = None) -> Estimate:
    """Lower the train step of ``args`` on the abstract mesh ``mesh_shape`` (default ``--mesh``) and time it.

    Raises:
        UsageError: sizes the mesh cannot use.
        fs.ShardingError: an axis the model cannot use.
    """
    t0 = time.perf_counter()
    hw = hardware(args.hardware)
    shape = parse_mesh(args.mesh) if mesh_shape is None else mesh_shape
    cfg = plan_config(args)
    lowered = lowered_step(args, cfg, shape)
    accum = getattr(args, "grad_accum", 1)
    memory, cost = lowered.memory_analysis(), lowered.cost_analysis()
    rows = lowered.comm_rows(device=cost["device"])
    notes = []
    if accum > 1:  # the step is one of --grad-accum microbatches: k of them per optimiser step
        cost = {**cost, "flops": cost["flops"] * accum}
        rows = {k: (c * accum, b * accum) for k, (c, b) in rows.items()}
        notes.append(f"--grad-accum {accum}: FLOPs and communication of one microbatch x {accum}")
    pp = shape.get("pp", 1)
    bubble = bubble_fraction(cfg.pp_schedule, pp, cfg.microbatches(pp)) if pp > 1 else 0.0
    dtype = _dtype_name(cfg)
    update = UPDATE_PASSES * memory["params"]
    timing = step_time(cost["flops"], rows, shape, hw, dtype=dtype, bubble=bubble, memory_bytes=update)
    out = Estimate(shape, cfg, hw, args.batch, args.seq, dtype, memory, cost, rows, timing, _capacity(hw))
    out.seconds, out.notes = time.perf_counter() - t0, notes
    return out


def lowered_step(args: argparse.Namespace, cfg: llama.Config, shape: dict[str, int]) -> Any:
    """The train job's step for ``args`` and ``cfg`` (``step.build_step``) lowered on the abstract mesh ``shape``,
    from ``fs.eval_shape`` of the model's init: nothing allocated (one microbatch of ``--grad-accum``).

    Example:
        >>> from funcshard.job.cli import train_parser
        >>> from funcshard.job.step import model_config
        >>> args = train_parser().parse_args(["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        ...                                   "--ffn", "128", "--seq", "32", "--batch", "4"])
        >>> lowered_step(args, model_config(args), {"dp": 2, "tp": 2}).memory_analysis()["peak"] > 0
        True
    """
    mesh = fs.make_mesh(shape, backend="abstract")
    step = build_step(args, cfg, mesh)
    params = fs.device_put(fs.eval_shape(model_module(cfg).init, fs.random.key(0), cfg), mesh, step.specs)
    state = step.opt_init(params)
    accum = getattr(args, "grad_accum", 1)
    tokens = fs.device_put(fs.ShapeDtype((args.batch // accum, args.seq), torch.int64), mesh, step.batch_spec)
    return step.step.lower(params, state, tokens, tokens)


def advice(memory: dict[str, int], capacity: float) -> str:
    """What to change when a step does not fit: the part that is too big, and the flags that shrink it.

    Example:
        >>> advice({"params": 8, "grads": 8, "optimizer_state": 16, "activations": 0, "temporaries": 0}, 10)[:40]
        'parameters, gradients and optimiser stat'
    """
    m = memory
    state = m["params"] + m["grads"] + m["optimizer_state"]
    if state > capacity:
        return (
            f"parameters, gradients and optimiser state alone take {human_bytes(state)} per device, more than the "
            f"{human_bytes(capacity)} it has: shard them over more devices (a larger fsdp or pp axis, or tp)."
        )
    if m["activations"] >= m["temporaries"]:
        return (
            f"activations take {human_bytes(m['activations'])} per device: --remat full (or selective), a smaller "
            f"--batch or --seq, more --microbatches on a pp axis, or a cp / tp axis to split the sequence."
        )
    return (
        f"temporaries take {human_bytes(m['temporaries'])} per device (gathered weights, logits, buffers in "
        f"flight): a larger tp axis, a smaller --batch or --seq, or --remat."
    )


def _dtype_name(cfg: llama.Config) -> str:
    dt = torch.float32 if cfg.precision is None else cfg.precision.compute_dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dt]


def _capacity(hw: Hardware) -> int:
    """The device's memory: the table's (a GPU's own), or on ``cpu`` this host's share per process."""
    if hw.name == "cpu":
        host = available_memory()
        if host is not None:
            return host
    return int(hw.hbm_bytes)
