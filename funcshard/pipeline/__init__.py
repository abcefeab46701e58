"""Pipeline parallelism: schedules as data (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zero_bubble_h1``).

A ``Schedule`` lists, per stage, the forward / backward / weight-gradient actions in execution order;
``validate`` checks it can run, ``simulate`` times it (bubble fraction, peak in-flight microbatches),
``text`` and ``plot`` draw it.

Example:
    >>> from funcshard.pipeline import zero_bubble_h1
    >>> sched = zero_bubble_h1(4, 8)
    >>> round(sched.simulate().bubble_fraction, 3)  # 1F1B: 0.273
    0.111
"""

from .runtime import run as run
from .schedules import Action as Action
from .schedules import Schedule as Schedule
from .schedules import ScheduleError as ScheduleError
from .schedules import Timeline as Timeline
from .schedules import gpipe as gpipe
from .schedules import interleaved_1f1b as interleaved_1f1b
from .schedules import one_f_one_b as one_f_one_b
from .schedules import zero_bubble_h1 as zero_bubble_h1
from .visualize import plot as plot
from .visualize import text as text

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "plot",
    "run",
    "text",
    "zero_bubble_h1",
]
