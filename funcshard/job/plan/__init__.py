"""What ``python -m funcshard plan`` times a step with: the hardware table and the step-time model.

- ``hardware.py``: ``HARDWARE`` (``h100``, ``h200``, ``a100``, ``cpu``): peak dense FLOP/s per dtype, memory,
  NVLink and network bandwidth and latency, node size, and one efficiency per device; ``hardware(name)``.
- ``timing.py``: one collective's time by the alpha-beta model at its group's placement on the mesh
  (``placement``, ``collective_time``, ``comm_time``), a whole step from its FLOPs, its ``fs.comm_stats`` rows,
  the overlap of each axis and the pipeline bubble (``step_time`` -> ``StepTime``, with ``mfu``), the
  bubble of a named schedule (``bubble_fraction``) and the model FLOPs of MFU (``model_flops``).

Pure Python: nothing here allocates a tensor or starts a process. docs/guides/planning.md explains the model.

Example:
    >>> from funcshard.job import plan
    >>> t = plan.step_time(1e15, {("psum", "tp"): (64, 2**30)}, {"dp": 2, "tp": 4}, "h100")
    >>> t.comm["tp"] > 0 and t.total > t.compute
    True
"""

from .hardware import DTYPES as DTYPES
from .hardware import HARDWARE as HARDWARE
from .hardware import Hardware as Hardware
from .hardware import canonical_dtype as canonical_dtype
from .hardware import hardware as hardware
from .timing import COLLECTIVES as COLLECTIVES
from .timing import OVERLAP_BY_ROLE as OVERLAP_BY_ROLE
from .timing import Placement as Placement
from .timing import StepTime as StepTime
from .timing import bubble_fraction as bubble_fraction
from .timing import collective_time as collective_time
from .timing import comm_time as comm_time
from .timing import default_overlap as default_overlap
from .timing import model_flops as model_flops
from .timing import placement as placement
from .timing import step_time as step_time

__all__ = [
    "COLLECTIVES",
    "DTYPES",
    "HARDWARE",
    "OVERLAP_BY_ROLE",
    "Hardware",
    "Placement",
    "StepTime",
    "bubble_fraction",
    "canonical_dtype",
    "collective_time",
    "comm_time",
    "default_overlap",
    "hardware",
    "model_flops",
    "placement",
    "step_time",
]
