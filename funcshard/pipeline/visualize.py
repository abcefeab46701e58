"""Pictures of a pipeline schedule's simulated timeline: ASCII (``text``) and PNG (``plot``).

An overlapped F&B pair (``dualpipev``) is one cell ``F5c0&B1c1`` in text and two half-height boxes in the PNG.

Example:
    >>> from funcshard.pipeline import one_f_one_b
    >>> print(one_f_one_b(2, 3).text())
    1f1b: 2 stages, 3 microbatches, bubble 25.0%, peak in-flight [2, 1]  (F=1 B=2)
    stage 0 | F0 F1 .  .  B0--- F2 B1--- .  B2---
    stage 1 | .  F0 B0--- F1 B1--- F2 B2--- .  .
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Protocol


# What the pictures read of a schedule, stated here (``schedules.Action`` / ``Timeline`` / ``Schedule`` have it), so
# this module imports nothing of ``schedules``, which draws through it (``Schedule.text`` / ``Schedule.plot``).
class Action(Protocol):
    """One action of a stage, as drawn: :class:`funcshard.pipeline.Action`."""

    @property
    def kind(self) -> str: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def chunk(self) -> int: ...
    @property
    def overlap(self) -> bool: ...


class Timeline(Protocol):
    """A simulated timeline, as drawn: :class:`funcshard.pipeline.Timeline`."""

    @property
    def timeline(self) -> list[list[tuple[float, float, Action]]]: ...
    @property
    def makespan(self) -> float: ...
    @property
    def bubble_fraction(self) -> float: ...
    @property
    def peak_in_flight(self) -> list[int]: ...
    @property
    def costs(self) -> dict[str, float]: ...


class Schedule(Protocol):
    """A schedule, as drawn: :class:`funcshard.pipeline.Schedule`."""

    @property
    def name(self) -> str: ...
    @property
    def n_stages(self) -> int: ...
    @property
    def n_microbatches(self) -> int: ...
    @property
    def n_virtual(self) -> int: ...
    @property
    def actions(self) -> list[list[Action]]: ...
    @property
    def placement(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def placement_kind(self) -> str: ...
    @property
    def split_backward(self) -> bool: ...
    def simulate(self, costs: dict[str, float] | None = None) -> Timeline: ...


__all__ = ["plot", "text"]

COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}
MAX_CELLS = 400


def _label(schedule: Schedule, a: Action, with_kind: bool = True) -> str:
    base = (a.kind if with_kind else "") + str(a.microbatch)
    return base + (f"c{a.chunk}" if schedule.n_virtual > 1 else "")


def _cells(schedule: Schedule, row: list[tuple[float, float, Action]]) -> list[tuple[float, float, str]]:
    """A stage's timeline as labelled cells, an overlapped F&B pair merged into one (``F5c0&B1c1``)."""
    out: list[tuple[float, float, str]] = []
    for b, e, a in row:
        if a.overlap and out:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + "&" + _label(schedule, a))
        else:
            out.append((b, e, _label(schedule, a)))
    return out


def _cost_note(sim: Timeline, split: bool) -> str:
    c = sim.costs
    note = " ".join(f"{k}={c[k]:g}" for k in ("F", "B", "W") if split or k != "W")
    note += f" FB={c['FB']:g}" if "FB" in c else ""
    return note + (f" comm={c['comm']:g}" if c["comm"] else "")


def _header(schedule: Schedule, sim: Timeline) -> str:
    v = f", {schedule.n_virtual} chunks/stage" if schedule.n_virtual > 1 else ""
    if schedule.placement_kind == "v":
        v += " (V-shape)"
    elif schedule.placement_kind == "custom":
        v += f" (placement {schedule.placement})"
    return (
        f"{schedule.name}: {schedule.n_stages} stages, {schedule.n_microbatches} microbatches{v}, "
        f"bubble {sim.bubble_fraction:.1%}, peak in-flight {sim.peak_in_flight}"
    )


def _step(sim: Timeline) -> float:
    """The time of one text cell: the gcd of all durations and start times, or a coarser step if too fine."""
    times = {Fraction(x).limit_denominator(1000) for row in sim.timeline for b, e, _ in row for x in (b, e - b)}
    num = den = 0
    for f in times:
        if f:
            num, den = math.gcd(num, f.numerator), math.lcm(den or 1, f.denominator)
    step = num / den if num else 1.0
    return max(step, sim.makespan / MAX_CELLS) if sim.makespan else 1.0


def text(schedule: Schedule, costs: dict[str, float] | None = None) -> str:
    """A compact ASCII timeline: one row per stage, one cell per time step, ``.`` for idle.

    An action longer than one step is drawn as its label followed by dashes (``B0---`` for a 2-step B).

    Args:
        schedule: the schedule to draw.
        costs: as for ``Schedule.simulate``.

    Example:
        >>> from funcshard.pipeline import gpipe
        >>> print(gpipe(2, 2).text().splitlines()[1])
        stage 0 | F0 F1 .  .  .  B0--- B1---
    """
    sim = schedule.simulate(costs)
    step = _step(sim)
    rows = [_cells(schedule, row) for row in sim.timeline]
    width = max((len(label) for row in rows for _, _, label in row), default=2) + 1
    n_cells = round(sim.makespan / step)
    lines = [f"{_header(schedule, sim)}  ({_cost_note(sim, schedule.split_backward)})"]
    for s, row in enumerate(rows):
        out, cell = [], 0
        for b, e, label in row:
            start, stop = round(b / step), max(round(e / step), round(b / step) + 1)
            out += [".".ljust(width)] * max(start - cell, 0)
            out.append(label.ljust((stop - start) * width - 1, "-") + " ")
            cell = max(stop, cell)
        out += [".".ljust(width)] * max(n_cells - cell, 0)
        lines.append(f"stage {s} | " + "".join(out).rstrip())
    return "\n".join(lines)


def _shade(color: str, chunk: int, n_virtual: int) -> tuple[float, float, float]:
    """The kind's color, lightened for later chunks so the chunks of one stage tell apart."""
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    t = 0.45 * chunk / max(n_virtual - 1, 1) if n_virtual > 1 else 0.0
    return (r + (1 - r) * t, g + (1 - g) * t, b + (1 - b) * t)


def plot(schedule: Schedule, path: str | Path, costs: dict[str, float] | None = None, *, dpi: int = 120) -> Path:
    """Draw the simulated timeline as a PNG: a row per stage, a box per action colored by kind.

    Boxes are labelled with the microbatch (and ``c<chunk>`` for schedules with several chunks per stage;
    later chunks are lighter); idle time shows as gaps; an overlapped F&B pair shares its row's time span,
    the F above its B. The title names the schedule and its bubble fraction. Uses
    matplotlib's object API with the Agg canvas, so it changes no global pyplot state.

    Args:
        schedule: the schedule to draw.
        path: where to write the PNG (parent folders are created).
        costs: as for ``Schedule.simulate``.
        dpi: resolution of the PNG.

    Returns:
        The path written.

    Example:
        >>> from funcshard.pipeline import zero_bubble_h1
        >>> zero_bubble_h1(4, 8).plot("/tmp/zb_h1.png").name
        'zb_h1.png'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    sim = schedule.simulate(costs)
    p, span = schedule.n_stages, sim.makespan or 1.0
    n_actions = max(len(row) for row in schedule.actions)
    fig_w, fig_h = min(max(6.0, 0.48 * n_actions), 24.0), 0.55 * p + 1.6
    fig = Figure(figsize=(fig_w, fig_h))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    points_per_time = fig_w * 0.8 / span * 72
    for s, row in enumerate(sim.timeline):
        for i, (b, e, a) in enumerate(row):
            # an overlapped F&B pair: the F on the upper half of the row, its B on the lower half
            top, height = (s - 0.4, 0.8)
            if i + 1 < len(row) and row[i + 1][2].overlap:
                height = 0.4
            elif a.overlap:
                top, height = s, 0.4
            color = _shade(COLORS[a.kind], a.chunk, schedule.n_virtual)
            ax.add_patch(Rectangle((b, top), e - b, height, facecolor=color, edgecolor="white", linewidth=0.8))
            label = _label(schedule, a, with_kind=False)
            size = min(9.0 if height > 0.5 else 7.0, (e - b) * points_per_time / (0.65 * len(label) + 0.6))
            if size >= 4:  # too narrow a box stays unlabelled
                ink = "white" if a.chunk == 0 else "black"
                ax.text((b + e) / 2, top + height / 2, label, ha="center", va="center", fontsize=size, color=ink)
    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    pairs = any(a.overlap for row in schedule.actions for a in row)
    note = "; overlapped F&B: F above B" if pairs else ""
    ax.set_xlabel(f"time ({_cost_note(sim, schedule.split_backward)}){note}")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(_header(schedule, sim), fontsize=10)
    kinds = [k for k in COLORS if any(a.kind == k for row in schedule.actions for a in row)]
    handles = [Patch(color=COLORS[k], label=f"{k} ({NAMES[k]})") for k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=len(kinds), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.3 / fig_h, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    return out
