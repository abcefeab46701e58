"""``python -m funcshard plan``: the train step lowered on an abstract mesh, and what it times the step with.

- ``estimate.py``: one layout's :class:`Estimate` (``estimate``): the train job's step lowered without data,
  memory by part, communication per axis, time, tokens/s and MFU; ``search.py``: every layout of N devices that
  fits, fastest first; ``command.py``: the command.

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

from .command import main as main
from .estimate import Estimate as Estimate
from .estimate import estimate as estimate
from .hardware import DTYPES as DTYPES
from .hardware import HARDWARE as HARDWARE
from .hardware import Hardware as Hardware
from .hardware import canonical_dtype as canonical_dtype
from .hardware import hardware as hardware
from .search import search as search
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
    "Estimate",
    "Hardware",
    "Placement",
    "StepTime",
    "bubble_fraction",
    "canonical_dtype",
    "collective_time",
    "comm_time",
    "default_overlap",
    "estimate",
    "hardware",
    "main",
    "model_flops",
    "placement",
    "search",
    "step_time",
]
