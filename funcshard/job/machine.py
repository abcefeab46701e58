"""What the machine has for a job: the memory a device may use, and byte counts people read.

Example:
    >>> human_bytes(26e9), (available_memory() or 1) > 0
    ('26 GB', True)
"""

from __future__ import annotations

import os

import torch

import funcshard as fs

__all__ = ["available_memory", "device_memory", "human_bytes"]


def available_memory() -> int | None:
    """Bytes of memory available to new allocations on this machine (``MemAvailable``), or None if unknown.

    Example:
        >>> (available_memory() or 1) > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def device_memory(mesh: fs.Mesh) -> tuple[int | None, int, str]:
    """The memory one device of ``mesh`` may use in this job, how many of the mesh's devices share it, and what
    it is: a GPU's own memory (one device each) under ``"dist"`` on CUDA; else this host's available memory,
    shared by the devices this host runs (every device of a simulated mesh; ``LOCAL_WORLD_SIZE`` processes under
    torchrun).

    Example:
        >>> have, sharing, what = device_memory(fs.make_mesh({"dp": 2}, backend="sim"))
        >>> sharing, what
        (2, 'available host memory')
    """
    dev = mesh.local_device()
    if dev is not None and dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory, 1, f"GPU memory ({torch.cuda.get_device_name(dev)})"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if mesh.is_multiprocess else mesh.size
    return available_memory(), local, "available host memory"


def human_bytes(n: float) -> str:
    """``1.3 PB``, ``260 MB``: a byte count in decimal units, two or three significant digits.

    Example:
        >>> human_bytes(26e9), human_bytes(512)
        ('26 GB', '512 B')
    """
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.2g} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable
