"""The step-time model: compute at a fraction of peak, collectives by alpha-beta, overlap, and the pipeline bubble.

A training step on one device is timed from what ``fs.comm_stats`` / ``lowered.cost_analysis()`` count for it:

- **Compute**: ``flops / (peak[dtype] * efficiency)`` (:class:`~funcshard.job.plan.hardware.Hardware`), plus any
  memory-bound bytes (the optimizer's update) at the HBM bandwidth.
- **Communication**, one collective call at a time, by the alpha-beta model: ``steps * alpha + volume /
  bandwidth``. The volume is the ring algorithm's bus-bandwidth factor times the full size (all-reduce
  ``2(n-1)/n``; all-gather and reduce-scatter ``(n-1)/n``; all-to-all ``(n-1)/n``; a send, ``1``); an all-reduce
  may also run as NCCL's (double binary) tree, ``2 log2(n)`` steps and ``2x`` the size, and takes whichever is
  faster for its size, as NCCL's tuner does: the tree for small messages (latency), the ring for large ones.
- **Placement**: the mesh's ranks are row-major over its axes (major to minor) and each run of ``node_size``
  consecutive ranks is a node, so the innermost axes sit inside a node. A group inside one node runs on NVLink;
  a group that spans ``k`` nodes with ``g`` members in each runs at the network's pace: its ring moves the same
  volume, but each node's share leaves through its ``g`` members' own NICs, so the bandwidth is
  ``min(nvlink, g * nic)`` and every step costs the network's alpha (the hierarchical estimate: the inter-node
  part is the bottleneck). An all-to-all's off-node part, ``(n-g)/n`` of the input, cannot be shared out: it
  goes through the sender's NIC.
- **Overlap**: a fraction of each axis's communication may run under compute (FSDP's prefetched all-gathers
  and gradient reduce-scatters, DDP's bucketed all-reduce, pipeline sends); the rest (tensor parallel's
  all-reduces, on the layer's critical path) is exposed. Overlappable communication beyond the compute time
  is exposed too.
- **Bubble**: a pipeline stage idles for a fraction ``b`` of the step (``Schedule.simulate``), so the step
  takes ``busy / (1 - b)``.

Example:
    >>> mesh = {"fsdp": 64, "tp": 8}
    >>> placement(mesh, "tp"), placement(mesh, "fsdp").nodes
    (Placement(size=8, nodes=1, per_node=8), 64)
    >>> t = step_time(5e14, {("psum", "tp"): (64, 2**30), ("all_gather", "fsdp"): (32, 2**28)}, mesh, "h100")
    >>> round(t.compute, 3), round(t.exposed_comm["tp"], 4), t.exposed_comm["fsdp"]
    (0.843, 0.0051, 0.0)
    >>> round(t.mfu(4e14), 3)
    0.477
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import funcshard as fs
from funcshard.pipeline import by_name

from .hardware import Hardware, hardware

__all__ = [
    "COLLECTIVES",
    "OVERLAP_BY_ROLE",
    "Placement",
    "StepTime",
    "bubble_fraction",
    "collective_time",
    "comm_time",
    "default_overlap",
    "model_flops",
    "placement",
    "step_time",
]

#: the names ``fs.comm_stats`` records (and NCCL's), each with the algorithm that times it
COLLECTIVES: dict[str, str] = {
    "psum": "all_reduce",
    "pmean": "all_reduce",
    "pmax": "all_reduce",
    "pmin": "all_reduce",
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
    "psum_scatter": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all",
    "ragged_all_to_all": "all_to_all",
    "ppermute": "p2p",
    "send": "p2p",
    "recv": "p2p",
    "p2p": "p2p",
}

#: the fraction of an axis's communication that may hide under compute, by the axis's role: data axes reduce
#: gradients in buckets during the backward and FSDP prefetches the next layer's gather; pipeline sends go
#: while the stage computes; tensor, context and expert parallel collectives sit on the layer's critical path
OVERLAP_BY_ROLE: dict[str, float] = {"dp": 1.0, "fsdp": 1.0, "pp": 1.0, "tp": 0.0, "cp": 0.0, "ep": 0.0}

Axes = str | Sequence[str]
#: ``{(collective, axes): (calls, bytes)}`` of one device, as ``CommStats.rows()`` returns it
CommRows = Mapping[tuple[str, Axes], tuple[int, float]]


class HasRows(Protocol):
    """Anything with ``CommStats``'s ``rows()``: an ``fs.comm_stats`` record."""

    def rows(self) -> CommRows:
        """``{(collective, "axis1,axis2"): (calls, bytes)}`` of one device."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where a collective's group of devices sits: its size, the nodes it spans, its fewest members in one node.

    Attributes:
        size: devices in the group (``n``).
        nodes: nodes the group spans (``k``; of the mesh's groups over these axes, the one spanning most).
        per_node: the group's fewest members in one of its nodes (``g``; ``size`` when ``nodes == 1``).

    Example:
        >>> Placement(16, 2, 8).intra_node, Placement(8, 1, 8).intra_node
        (False, True)
    """

    size: int
    nodes: int
    per_node: int

    @property
    def intra_node(self) -> bool:
        """True when the group fits in one node (NVLink only)."""
        return self.nodes == 1


def _axes(axes: Axes) -> tuple[str, ...]:
    """``"tp"``, ``"dp,tp"`` (``CommStats.rows()``'s spelling) or ``("dp", "tp")`` -> ``("dp", "tp")``."""
    if isinstance(axes, str):
        return tuple(a for a in axes.split(",") if a)
    return tuple(axes)


def placement(mesh_shape: Mapping[str, int], axes: Axes, *, node_size: int = 8) -> Placement:
    """The placement of the groups a collective over ``axes`` forms on a mesh laid out node by node.

    Ranks are the row-major index of the device's coordinates (major to minor, as ``fs.make_mesh``); ranks
    ``[i * node_size, (i + 1) * node_size)`` are node ``i``. Every group over ``axes`` is looked at and the one
    spanning most nodes (then with fewest members in a node) is returned: the slowest sets the pace.

    Args:
        mesh_shape: axis name -> size, major to minor (``mesh.shape``).
        axes: the axes the collective spans: a name, a tuple, or ``"dp,tp"``.
        node_size: devices per node.

    Returns:
        The ``Placement``.

    Raises:
        fs.ConfigError: an axis not in the mesh, an axis named twice, or a size below 1.

    Example:
        >>> placement({"dp": 2, "tp": 4}, ("dp", "tp"))  # 8 devices: one node
        Placement(size=8, nodes=1, per_node=8)
        >>> placement({"fsdp": 16}, "fsdp")  # two nodes, 8 members in each
        Placement(size=16, nodes=2, per_node=8)
    """
    names = _axes(axes)
    shape = tuple((str(a), int(s)) for a, s in mesh_shape.items())
    unknown = [a for a in names if a not in mesh_shape]
    if unknown or len(set(names)) != len(names):
        raise fs.ConfigError(
            f"placement: axes {names} must be distinct axes of the mesh {dict(shape)}; found {unknown or names}."
        )
    if node_size < 1 or any(s < 1 for _, s in shape):
        raise fs.ConfigError(f"placement: sizes must be at least 1; found mesh {dict(shape)}, node_size={node_size}.")
    return _placement(shape, names, node_size)


@functools.lru_cache(maxsize=4096)
def _placement(shape: tuple[tuple[str, int], ...], axes: tuple[str, ...], node_size: int) -> Placement:
    names = [a for a, _ in shape]
    strides = [math.prod(s for _, s in shape[i + 1 :]) for i in range(len(shape))]

    def offsets(which: Iterable[str]) -> list[int]:
        out = [0]
        for a in which:
            i = names.index(a)
            out = [o + c * strides[i] for o in out for c in range(shape[i][1])]
        return out

    members = offsets(axes)
    worst = (1, -len(members))
    for base in offsets(a for a in names if a not in axes):
        per_node = Counter((base + m) // node_size for m in members)
        worst = max(worst, (len(per_node), -min(per_node.values())))
    return Placement(len(members), worst[0], -worst[1])


def _kind(collective: str) -> str:
    if collective not in COLLECTIVES:
        raise fs.ConfigError(
            f"comm_time: unknown collective {collective!r}; expected one of {', '.join(sorted(COLLECTIVES))}."
        )
    return COLLECTIVES[collective]


def _link(hw: Hardware, group: Placement) -> tuple[float, float, float]:
    """(ring bandwidth, alpha, one device's own off-node bandwidth) for ``group``."""
    if group.intra_node:
        return hw.intra_bandwidth, hw.intra_latency, hw.intra_bandwidth
    return min(hw.intra_bandwidth, group.per_node * hw.inter_bandwidth), hw.inter_latency, hw.inter_bandwidth


def collective_time(
    collective: str,
    nbytes: float,
    group: Placement | int,
    hw: Hardware | str,
    *,
    algorithm: str | None = None,
) -> float:
    """Seconds one call of ``collective`` takes, by the alpha-beta model.

    Args:
        collective: a name ``fs.comm_stats`` records (``"psum"``, ``"all_gather"``, ``"psum_scatter"``,
            ``"all_to_all"``, ``"ppermute"``, ``"send"``) or NCCL's (``"all_reduce"``, ``"reduce_scatter"``,
            ``"p2p"``); see ``COLLECTIVES``.
        nbytes: the payload as ``fs.comm_stats`` counts it: the input on one device (for ``all_gather`` the
            local shard, ``n`` times smaller than the result; for ``psum_scatter`` the full input; for
            ``ragged_all_to_all`` the rows sent to other devices, timed as an all-to-all of ``n/(n-1)`` times them).
        group: the group's ``Placement``, or its size for a group inside one node.
        hw: a ``Hardware`` or its name.
        algorithm: ``"ring"`` or ``"tree"`` (all-reduce only) to force one; by default an all-reduce takes the
            faster of the two, the others run as a ring (or, for sends, one hop).

    Returns:
        Seconds; 0 for a group of one device or an empty payload.

    Raises:
        fs.ConfigError: an unknown collective or algorithm, a tree asked of a collective NCCL has none for, or a
            negative payload.

    Example:
        >>> ring = collective_time("psum", 2**30, 8, "h100", algorithm="ring")  # 14 alpha + 2(7/8) GiB / 450 GB/s
        >>> round(ring * 1e3, 3), collective_time("psum", 2**30, 8, "h100") == ring
        (4.19, True)
        >>> tiny = [collective_time("psum", 8, 8, "h100", algorithm=a) for a in ("tree", "ring")]
        >>> [round(t * 1e6, 2) for t in tiny]  # microseconds: 6 alpha against 14 alpha
        [6.0, 14.0]
    """
    kind, hw = _kind(collective), hardware(hw)
    if algorithm not in (None, "ring", "tree") or (algorithm == "tree" and kind != "all_reduce"):
        raise fs.ConfigError(
            f"collective_time: algorithm {algorithm!r} for {collective!r}; expected 'ring' or None "
            "('tree' for an all-reduce only: NCCL runs the others as rings or direct sends)."
        )
    if nbytes < 0:
        raise fs.ConfigError(f"collective_time: payload of {collective!r} is {nbytes} bytes; expected >= 0.")
    group = Placement(group, 1, group) if isinstance(group, int) else group
    n = group.size
    if n <= 1 or nbytes == 0:
        return 0.0
    bw, alpha, nic = _link(hw, group)
    if collective == "ragged_all_to_all":  # counted as the bytes sent to other devices: (n-1)/n of the input
        nbytes = nbytes * n / (n - 1)
    if kind == "all_reduce":
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw
        tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw
        return {"ring": ring, "tree": tree}.get(algorithm or "", min(ring, tree))
    if kind == "all_gather":  # the result is n local shards
        return (n - 1) * alpha + (n - 1) / n * (n * nbytes) / bw
    if kind == "reduce_scatter":
        return (n - 1) * alpha + (n - 1) / n * nbytes / bw
    if kind == "all_to_all":  # (n-1)/n of the input leaves; the off-node part through this device's own NIC
        g = group.per_node
        off = (n - g) / n * nbytes / nic
        return (n - 1) * alpha + max((g - 1) / n * nbytes / hw.intra_bandwidth, off)
    return alpha + nbytes / (hw.intra_bandwidth if group.intra_node else nic)  # one hop


def comm_time(
    collective: str,
    nbytes: float,
    mesh_shape: Mapping[str, int],
    axes: Axes,
    hw: Hardware | str,
    *,
    node_size: int | None = None,
    algorithm: str | None = None,
) -> float:
    """Seconds one call of ``collective`` over ``axes`` of a mesh takes: :func:`collective_time` at the group's
    :func:`placement`.

    Args:
        collective: as for :func:`collective_time`.
        nbytes: the payload on one device, as ``fs.comm_stats`` counts it.
        mesh_shape: axis name -> size, major to minor (``mesh.shape``).
        axes: the axes the collective spans (a name, a tuple, or ``"dp,tp"``).
        hw: a ``Hardware`` or its name.
        node_size: devices per node (default: the hardware's).
        algorithm: as for :func:`collective_time`.

    Returns:
        Seconds.

    Example:
        >>> mesh = {"fsdp": 64, "tp": 8}
        >>> comm_time("psum", 2**20, mesh, "tp", "h100") < comm_time("psum", 2**20, mesh, "fsdp", "h100")
        True
    """
    hw = hardware(hw)
    group = placement(mesh_shape, axes, node_size=node_size or hw.node_size)
    return collective_time(collective, nbytes, group, hw, algorithm=algorithm)


@dataclass(frozen=True)
class StepTime:
    """One training step's time on one device, by part (seconds).

    Attributes:
        compute: the step's FLOPs at the achieved rate, plus its memory-bound bytes at HBM bandwidth.
        comm: all the communication time per axis (``"tp"``, or ``"dp,fsdp"`` for a collective over both).
        exposed_comm: the part of ``comm`` not hidden under compute, per axis.
        bubble: the pipeline's idle time in the step.
        total: ``compute + sum(exposed_comm) + bubble``.
        peak_flops: the device's peak FLOP/s for the step's dtype (MFU's denominator).

    Example:
        >>> t = StepTime(0.8, {"tp": 0.1}, {"tp": 0.1}, 0.1, 1.0, 1e15)
        >>> t.mfu(5e14), t.exposed
        (0.5, 0.1)
    """

    compute: float
    comm: dict[str, float]
    exposed_comm: dict[str, float]
    bubble: float
    total: float
    peak_flops: float

    @property
    def exposed(self) -> float:
        """All the exposed communication time."""
        return sum(self.exposed_comm.values())

    def mfu(self, model_flops_per_device: float) -> float:
        """Model FLOPs utilisation: ``model FLOPs / (step time * peak)``, per device.

        Args:
            model_flops_per_device: the model's FLOPs in one step on one device (:func:`model_flops` of the
                tokens it processes), without the recomputation of remat.

        Example:
            >>> StepTime(1.0, {}, {}, 0.0, 2.0, 1e15).mfu(1e15)
            0.5
        """
        return model_flops_per_device / (self.total * self.peak_flops)

    def table(self) -> str:
        """The parts as text, one line each, in milliseconds.

        Example:
            >>> print(StepTime(0.8, {"tp": 0.2}, {"tp": 0.1}, 0.1, 1.0, 1e15).table())
            compute               800.0 ms
            comm tp               200.0 ms  (exposed 100.0 ms)
            bubble                100.0 ms
            step                 1000.0 ms
        """
        lines = [f"{'compute':<16} {self.compute * 1e3:>10.1f} ms"]
        for axis, t in self.comm.items():
            lines.append(f"{'comm ' + axis:<16} {t * 1e3:>10.1f} ms  (exposed {self.exposed_comm[axis] * 1e3:.1f} ms)")
        lines.append(f"{'bubble':<16} {self.bubble * 1e3:>10.1f} ms")
        lines.append(f"{'step':<16} {self.total * 1e3:>10.1f} ms")
        return "\n".join(lines)


def default_overlap(mesh_shape: Mapping[str, int]) -> dict[str, float]:
    """Each axis's overlappable fraction by its role (``OVERLAP_BY_ROLE``; an axis of another name: 0).

    Example:
        >>> default_overlap({"pp": 2, "fsdp": 4, "tp": 8})
        {'pp': 1.0, 'fsdp': 1.0, 'tp': 0.0}
    """
    return {a: OVERLAP_BY_ROLE.get(a, 0.0) for a in mesh_shape}


def _entries(comm: CommRows | HasRows) -> list[tuple[str, tuple[str, ...], int, float]]:
    """``(collective, axes, calls, bytes)`` from a ``{(collective, axes): (calls, bytes)}`` dict or a ``CommStats``."""
    rows = comm if isinstance(comm, Mapping) else comm.rows()
    return [(name, _axes(axes), int(calls), float(nbytes)) for (name, axes), (calls, nbytes) in rows.items()]


def _fraction(overlap: Mapping[Axes, float], axes: tuple[str, ...]) -> float:
    """The overlappable fraction of a collective over ``axes``: its own entry, else the least of its axes'."""
    fractions = {",".join(_axes(k)): float(v) for k, v in overlap.items()}
    label = ",".join(axes)
    f = fractions[label] if label in fractions else min((fractions.get(a, 0.0) for a in axes), default=0.0)
    if not 0.0 <= f <= 1.0:
        raise fs.ConfigError(f"step_time: overlap of {label!r} is {f}; expected a fraction in [0, 1].")
    return f


def _expose(comm: dict[str, float], fractions: dict[str, float], compute: float) -> dict[str, float]:
    """Per axis, the communication left outside compute: the part that may not overlap, and the overlappable
    part's share of whatever does not fit under ``compute`` (the axes' overlappable parts run one after another)."""
    hideable = sum(fractions[a] * t for a, t in comm.items())
    spill = max(0.0, hideable - compute) / hideable if hideable > 0 else 0.0
    return {a: (1 - fractions[a]) * t + fractions[a] * t * spill for a, t in comm.items()}


def step_time(
    flops: float,
    comm: CommRows | HasRows,
    mesh_shape: Mapping[str, int],
    hw: Hardware | str,
    *,
    dtype: object = "bf16",
    overlap: Mapping[Axes, float] | None = None,
    bubble: float = 0.0,
    memory_bytes: float = 0.0,
    node_size: int | None = None,
) -> StepTime:
    """Time one training step on one device: compute, exposed communication per axis, and the pipeline bubble.

    Args:
        flops: the step's FLOPs on one device, as run (remat's recomputation included:
            ``lowered.cost_analysis()["flops"]``).
        comm: ``{(collective, axes): (calls, bytes)}`` of one device (``CommStats.rows()``'s shape; ``axes`` a
            name, a tuple or ``"dp,tp"``), or a ``CommStats`` itself. Each call is timed at the mean payload
            ``bytes / calls``.
        mesh_shape: axis name -> size, major to minor (``mesh.shape``); the innermost axes sit inside a node.
        hw: a ``Hardware`` or its name.
        dtype: the matmuls' dtype (``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"`` or torch's spelling).
        overlap: axis (or ``"dp,fsdp"`` / a tuple, for a collective over several) -> the fraction of its
            communication that may run under compute; a collective over several axes without an entry of its own
            takes the least of theirs. Default: :func:`default_overlap` (by role; ``{}`` for none at all).
        bubble: the pipeline's bubble fraction (:func:`bubble_fraction`), in ``[0, 1)``: the step lasts the
            busy time over ``1 - bubble``.
        memory_bytes: bytes of memory-bound traffic outside the matmuls (the optimizer's update), timed at the
            HBM bandwidth and added to compute.
        node_size: devices per node (default: the hardware's).

    Returns:
        A :class:`StepTime`.

    Raises:
        fs.ConfigError: an unknown collective, dtype or hardware, an axis not in the mesh, an overlap outside
            ``[0, 1]``, or a bubble outside ``[0, 1)``.

    Example:
        >>> t = step_time(1e15, {("psum", "tp"): (10, 10 * 2**20)}, {"tp": 8}, "h100", overlap={"tp": 0.5})
        >>> round(t.compute, 3), round(t.comm["tp"] * 1e3, 3), round(t.exposed_comm["tp"] * 1e3, 3)
        (1.685, 0.107, 0.053)
        >>> step_time(1e15, {}, {"pp": 4}, "h100", bubble=0.5).total == 2 * step_time(1e15, {}, {"pp": 4}, "h100").total
        True
    """
    hw = hardware(hw)
    if not 0.0 <= bubble < 1.0:
        raise fs.ConfigError(f"step_time: bubble fraction {bubble}; expected a fraction in [0, 1).")
    compute = flops / hw.achieved(dtype) + memory_bytes / hw.hbm_bandwidth
    times: dict[str, float] = {}
    fractions: dict[str, float] = {}
    overlap = default_overlap(mesh_shape) if overlap is None else overlap
    for name, axes, calls, nbytes in _entries(comm):
        label = ",".join(axes)
        per_call = comm_time(name, nbytes / calls, mesh_shape, axes, hw, node_size=node_size) if calls else 0.0
        times[label] = times.get(label, 0.0) + calls * per_call
        fractions[label] = _fraction(overlap, axes)
    exposed = _expose(times, fractions, compute)
    busy = compute + sum(exposed.values())
    total = busy / (1.0 - bubble)
    return StepTime(compute, times, exposed, total - busy, total, hw.peak(dtype))


def bubble_fraction(
    schedule: str,
    n_stages: int,
    n_microbatches: int,
    *,
    n_virtual: int | None = None,
    costs: dict[str, float] | None = None,
) -> float:
    """The bubble fraction of a pipeline schedule by name, from its simulator (``Schedule.simulate``).

    Args:
        schedule: a name in ``funcshard.pipeline.SCHEDULE_NAMES`` (``"1f1b"``, ``"interleaved"``, ``"zb"``, ...).
        n_stages: pipeline stages (the ``pp`` size).
        n_microbatches: microbatches per step.
        n_virtual: chunks per stage for the interleaved schedules (``funcshard.pipeline.by_name``'s default).
        costs: the actions' durations for ``simulate`` (default ``F=1, B=2``, or ``F=B=W=1`` with ``W``).

    Returns:
        Idle time over ``n_stages * makespan``.

    Example:
        >>> bubble_fraction("1f1b", 4, 8)  # (p-1)/(m+p-1) = 3/11
        0.2727272727272727
        >>> bubble_fraction("zb", 4, 8) < bubble_fraction("1f1b", 4, 8)
        True
    """
    return by_name(schedule, n_stages, n_microbatches, n_virtual).simulate(costs).bubble_fraction


def model_flops(n_params_nonembedding: float, n_layers: int, dim: int, seq: int, tokens: float) -> float:
    """The model FLOPs of training on ``tokens`` tokens: ``6 N T + 12 L d s T``, MFU's numerator.

    PaLM's definition (Chowdhery et al. 2022, appendix B), which torchtitan's and Megatron-LM's MFU use: each
    token costs ``6 N`` for the matmuls with the ``N`` non-embedding parameters (2 forward, 4 backward) and
    ``12 L d s`` for attention's two ``s x s`` matmuls in each of ``L`` layers of width ``d`` (counted whole,
    not halved for a causal mask), and no recomputation is counted.

    Args:
        n_params_nonembedding: parameters outside the embedding table (the output head counts).
        n_layers: transformer layers ``L``.
        dim: model width ``d`` (heads x head dim).
        seq: sequence length ``s``.
        tokens: tokens processed (per device for a per-device MFU, or the global batch).

    Returns:
        FLOPs.

    Example:
        >>> model_flops(1e9, 16, 2048, 4096, 1)  # 6e9 + 12 * 16 * 2048 * 4096
        7610612736.0
    """
    return 6.0 * n_params_nonembedding * tokens + 12.0 * n_layers * dim * seq * tokens
