"""Pipeline parallelism: schedules as data, from ``gpipe`` and ``one_f_one_b`` to the V-shaped ``zbv``, ``dualpipev``.

A ``Schedule`` lists, per stage, the forward / backward / weight-gradient actions in execution order;
its ``placement`` says which model chunk (virtual stage) each stage's chunk holds (looped, or V-shaped);
``validate`` checks it can run, ``simulate`` times it (bubble fraction, peak in-flight microbatches),
``text`` and ``plot`` draw it. ``by_name`` builds one from its name in ``SCHEDULE_NAMES``.

Example:
    >>> from funcshard.pipeline import zero_bubble_h1
    >>> sched = zero_bubble_h1(4, 8)
    >>> round(sched.simulate().bubble_fraction, 3)  # 1F1B: 0.273
    0.111
"""

from .layout import chunk_layers as chunk_layers
from .layout import from_chunks as from_chunks
from .layout import to_chunks as to_chunks
from .runtime import PipelineGrads as PipelineGrads
from .runtime import run as run
from .runtime import stage_order as stage_order
from .schedules import SCHEDULE_NAMES as SCHEDULE_NAMES
from .schedules import Action as Action
from .schedules import Schedule as Schedule
from .schedules import ScheduleError as ScheduleError
from .schedules import Timeline as Timeline
from .schedules import by_name as by_name
from .schedules import dualpipev as dualpipev
from .schedules import gpipe as gpipe
from .schedules import interleaved_1f1b as interleaved_1f1b
from .schedules import interleaved_zero_bubble as interleaved_zero_bubble
from .schedules import looped_bfs as looped_bfs
from .schedules import looped_placement as looped_placement
from .schedules import one_f_one_b as one_f_one_b
from .schedules import v_placement as v_placement
from .schedules import zbv as zbv
from .schedules import zero_bubble_h1 as zero_bubble_h1
from .trace import Trace as Trace
from .trace import trace as trace
from .visualize import plot as plot
from .visualize import text as text

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "PipelineGrads",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "Trace",
    "by_name",
    "chunk_layers",
    "dualpipev",
    "from_chunks",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "looped_bfs",
    "looped_placement",
    "one_f_one_b",
    "plot",
    "run",
    "stage_order",
    "text",
    "to_chunks",
    "trace",
    "v_placement",
    "zbv",
    "zero_bubble_h1",
]
