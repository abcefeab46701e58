"""The hardware table the planner times a step against: peak FLOP/s, memory, links, and one efficiency each.

Each entry is one device (a GPU, or for ``cpu`` one process with two cores) and what connects it to its peers:
the intra-node link (NVLink) among the ``node_size`` devices of a node and the inter-node network (one NIC per
GPU, as on NVIDIA's DGX / HGX nodes). Numbers are the vendors' spec-sheet values, in SI base units (FLOP/s,
bytes, bytes/s, seconds); every TFLOP/s figure is *dense* (the sheets' headline tensor-core numbers assume 2:4
sparsity and are twice these). Sources:

- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet (FP32 67, TF32 989*, BF16 / FP16 1,979* TFLOP/s,
  * with sparsity; HBM3 3.35 TB/s; NVLink 900 GB/s), https://www.nvidia.com/en-us/data-center/h100/; nodes as
  in the DGX H100 (8 GPUs, 8 ConnectX-7 400 Gb/s NDR InfiniBand ports, one per GPU).
- H200 SXM 141 GB: NVIDIA H200 datasheet (the H100's compute; HBM3e 4.8 TB/s; NVLink 900 GB/s),
  https://www.nvidia.com/en-us/data-center/h200/; DGX H200 nodes (8 GPUs, 8 x 400 Gb/s NDR).
- A100 SXM4 80 GB: NVIDIA A100 datasheet (FP32 19.5, TF32 156, BF16 / FP16 312 TFLOP/s dense; HBM2e
  2,039 GB/s; NVLink 600 GB/s), https://www.nvidia.com/en-us/data-center/a100/; DGX A100 nodes (8 GPUs,
  8 ConnectX-6 200 Gb/s HDR ports).
- ``cpu``: an assumption, not a product: one device is a process with 2 x86 cores to itself, each doing two
  8-wide fp32 FMAs a cycle (AVX2) at 3 GHz: 2 x 32 x 3e9 = 0.19 TFLOP/s; no bf16 / fp16 / tf32 units, so every
  dtype gets the fp32 peak; 16 GiB of DDR4 at 25 GB/s; 8 such processes on one host talk over gloo (TCP
  loopback, ~3 GB/s, 20 us a step), hosts over 10 Gb Ethernet (1.25 GB/s, 50 us).

Memory is the size the device reports (``nvidia-smi --query-gpu=memory.total``: 81,559 MiB for an H100 80GB HBM3,
143,771 MiB for an H200, 81,920 MiB for an A100-SXM4-80GB), not the marketing gigabytes.

Link bandwidths are per GPU and per direction, the bus bandwidth NCCL's ring can approach: NVLink4's 900 GB/s
is 18 links x 25 GB/s x 2 directions, so 450 GB/s each way (NVLink3: 300). The network is one NIC per GPU:
400 Gb/s = 50 GB/s (200 Gb/s HDR = 25 GB/s). Latencies (``alpha``, one algorithm step: one message hop of a ring
or a tree) are of the order of NCCL's own tuning model (``src/graph/tuning.cc``: about 0.6-3.4 us per NVLink hop
and 2.7-14 us per network hop across its protocols): 1 us inside a node, 5 us across nodes.

``efficiency`` is the one fraction of the peak matmul throughput that the compute of a well-tuned training step
reaches on that device, the same for every model and every dtype (never fitted to a model):

- H100 / H200 ``0.6``: cuBLAS reaches ~75-80% of the dense bf16 peak on large GEMMs (~750-800 of 989 TFLOP/s),
  flash attention ~60-70%, and a step also runs memory-bound norms, activations and the loss, which Hopper's
  FLOP/byte ratio makes relatively costly; published end-to-end MFUs, which include communication and bubbles
  this model adds separately, are 33-50% (torchtitan, MaxText, Megatron-LM; see docs/guides/planning.md). The
  H200 has the same SMs and clocks; its faster HBM helps the memory-bound rest only a little.
- A100 ``0.7``: its GEMMs reach ~85-90% of 312 TFLOP/s and its FLOP/byte ratio is half Hopper's; torchtitan
  reports 51-58% end-to-end MFU for Llama 3 8B / 70B with FSDP on 64 A100s, and Megatron-LM (Narayanan et al.
  2021) 52% of peak (recomputation counted) for a 1T-parameter GPT on 3,072 A100s.
- ``cpu`` ``0.3``: eager torch on a couple of cores spends much of a step outside large matmuls; a 2048^3 fp32
  matmul on the 2-core AMD EPYC development host, shared with other jobs, ran at 41 GFLOP/s.

Example:
    >>> h = hardware("h100")
    >>> h.peak("bf16") / 1e12, round(h.hbm_bytes / 2**30, 1), h.intra_bandwidth / 1e9, h.node_size
    (989.0, 79.6, 450.0, 8)
    >>> hardware("h100").peak("bfloat16") == h.peak("bf16")  # torch's spelling too (or a torch.dtype)
    True
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import funcshard as fs

__all__ = ["DTYPES", "HARDWARE", "Hardware", "canonical_dtype", "hardware"]

#: the dtypes a peak is given for, and the other spellings each accepts (torch's names, ``torch.bfloat16``)
DTYPES: dict[str, tuple[str, ...]] = {
    "fp32": ("float32", "float", "f32"),
    "tf32": (),
    "bf16": ("bfloat16",),
    "fp16": ("float16", "half", "f16"),
}

_ALIASES = {alias: name for name, aliases in DTYPES.items() for alias in (name, *aliases)}

TERA = 1e12
GIGA = 1e9
MIB = 2**20


def canonical_dtype(dtype: object) -> str:
    """The table's name for ``dtype``: ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.

    Args:
        dtype: one of those names, torch's spelling (``"bfloat16"``) or a ``torch.dtype``.

    Returns:
        The canonical name.

    Raises:
        fs.ConfigError: an unknown dtype, with the names accepted.

    Example:
        >>> canonical_dtype("bfloat16"), canonical_dtype("fp16")
        ('bf16', 'fp16')
    """
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _ALIASES:
        raise fs.ConfigError(f"hardware: unknown dtype {dtype!r}; expected one of {sorted(_ALIASES)}.")
    return _ALIASES[key]


@dataclass(frozen=True)
class Hardware:
    """One device of the table and the links between devices (SI units: FLOP/s, bytes, bytes/s, seconds).

    Attributes:
        name: the table's key (``"h100"``).
        description: the part, and where its numbers come from.
        peak_fp32: peak dense fp32 FLOP/s (no tensor cores).
        peak_tf32: peak dense TF32 tensor-core FLOP/s.
        peak_bf16: peak dense bf16 tensor-core FLOP/s.
        peak_fp16: peak dense fp16 tensor-core FLOP/s.
        efficiency: the fraction of the peak a well-tuned training step's compute reaches, one per device.
        hbm_bytes: device memory, as the device reports it.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        intra_bandwidth: per-device, per-direction bandwidth inside a node (NVLink), bytes/s.
        intra_latency: one step of a collective inside a node (alpha), seconds.
        inter_bandwidth: per-device, per-direction network bandwidth between nodes (its NIC), bytes/s.
        inter_latency: one step of a collective across nodes (alpha), seconds.
        node_size: devices per node; a mesh's innermost axes are laid inside a node.

    Example:
        >>> a = hardware("a100")
        >>> a.peak("tf32") / 1e12, a.efficiency, a.inter_bandwidth / 1e9
        (156.0, 0.7, 25.0)
    """

    name: str
    description: str
    peak_fp32: float
    peak_tf32: float
    peak_bf16: float
    peak_fp16: float
    efficiency: float
    hbm_bytes: int
    hbm_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    node_size: int = 8

    def peak(self, dtype: object) -> float:
        """Peak dense FLOP/s for ``dtype`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or torch's spelling).

        Example:
            >>> hardware("h200").peak("fp32") / 1e12
            67.0
        """
        return float(getattr(self, f"peak_{canonical_dtype(dtype)}"))

    def achieved(self, dtype: object) -> float:
        """The FLOP/s a training step's compute reaches: ``peak(dtype) * efficiency``.

        Example:
            >>> round(hardware("h100").achieved("bf16") / 1e12, 1)
            593.4
        """
        return self.peak(dtype) * self.efficiency


_H100_COMPUTE = {"peak_fp32": 67 * TERA, "peak_tf32": 494.5 * TERA, "peak_bf16": 989 * TERA, "peak_fp16": 989 * TERA}
_NVLINK4_NDR = {
    "intra_bandwidth": 450 * GIGA,
    "intra_latency": 1e-6,
    "inter_bandwidth": 50 * GIGA,
    "inter_latency": 5e-6,
}

#: the devices by name; see the module's docstring for every number's source
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100",
        "NVIDIA H100 SXM5 80GB HBM3 (DGX H100: NVLink4, 8 x 400 Gb/s NDR InfiniBand)",
        **_H100_COMPUTE,
        efficiency=0.6,
        hbm_bytes=81_559 * MIB,
        hbm_bandwidth=3.35e12,
        **_NVLINK4_NDR,
    ),
    "h200": Hardware(
        "h200",
        "NVIDIA H200 SXM 141GB HBM3e (DGX H200: NVLink4, 8 x 400 Gb/s NDR InfiniBand)",
        **_H100_COMPUTE,
        efficiency=0.6,
        hbm_bytes=143_771 * MIB,
        hbm_bandwidth=4.8e12,
        **_NVLINK4_NDR,
    ),
    "a100": Hardware(
        "a100",
        "NVIDIA A100 SXM4 80GB HBM2e (DGX A100: NVLink3, 8 x 200 Gb/s HDR InfiniBand)",
        peak_fp32=19.5 * TERA,
        peak_tf32=156 * TERA,
        peak_bf16=312 * TERA,
        peak_fp16=312 * TERA,
        efficiency=0.7,
        hbm_bytes=81_920 * MIB,
        hbm_bandwidth=2.039e12,
        intra_bandwidth=300 * GIGA,
        intra_latency=1e-6,
        inter_bandwidth=25 * GIGA,
        inter_latency=5e-6,
    ),
    "cpu": Hardware(
        "cpu",
        "a 2-core x86 process (AVX2 FMA, 3 GHz), 8 to a host over gloo, hosts on 10 Gb Ethernet (an assumption)",
        peak_fp32=0.192 * TERA,
        peak_tf32=0.192 * TERA,
        peak_bf16=0.192 * TERA,
        peak_fp16=0.192 * TERA,
        efficiency=0.3,
        hbm_bytes=16 * 2**30,
        hbm_bandwidth=25 * GIGA,
        intra_bandwidth=3 * GIGA,
        intra_latency=20e-6,
        inter_bandwidth=1.25 * GIGA,
        inter_latency=50e-6,
    ),
}


def hardware(name: str | Hardware) -> Hardware:
    """The table's entry called ``name`` (an entry is returned as it is).

    Args:
        name: ``"h100"``, ``"h200"``, ``"a100"`` or ``"cpu"`` (any case), or a ``Hardware``.

    Returns:
        The ``Hardware``.

    Raises:
        fs.ConfigError: an unknown name; the message lists the table's names.

    Example:
        >>> hardware("H100").name
        'h100'
        >>> hardware("v100")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        funcshard._src.errors.ConfigError: hardware: unknown name 'v100'; expected one of h100, h200, a100, cpu...
    """
    if isinstance(name, Hardware):
        return name
    key = str(name).lower()
    if key not in HARDWARE:
        close = difflib.get_close_matches(key, HARDWARE, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise fs.ConfigError(f"hardware: unknown name {name!r}; expected one of {', '.join(HARDWARE)}.{hint}")
    return HARDWARE[key]
