"""The report's figures, drawn with matplotlib's Agg backend (no display, no
network): each one a PNG, as bytes. Time is seconds since the run started,
the same axis in every figure, so an event lines up with the curves."""

from __future__ import annotations

import io
from bisect import bisect_left
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, whatever $DISPLAY says
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .data import Mark, ReportData

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100
# One colour per kind of event, the same in every figure and in the page's legend.
COLORS = {"start": "#2ca02c", "exit": "#444444", "stall": "#d62728", "straggler": "#ff7f0e",
          "restart": "#9467bd", "failed": "#d62728", "preempted": "#8c564b", "stop": "#8c564b",
          "interrupted": "#8c564b", "cancel": "#8c564b", "excluded": "#7b4173", "resume": "#17becf",
          "checkpoint": "#7f7f7f", "eval": "#bcbd22", "submitted": "#1f77b4"}
LOSS, THROUGHPUT = "#1f77b4", "#e377c2"  # no event's colour: a test tells the curves apart by them
# On the curves only what changes the run's course: checkpoints and evaluations would hide the data.
ON_CURVES = ("stall", "straggler", "restart", "failed", "preempted", "interrupted", "excluded", "resume")


def color(kind: str) -> str:
    return COLORS.get(kind, "#1f77b4")


def _png(fig: Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    plt.close(fig)
    return out.getvalue()


def _mark_lines(ax: Axes, marks: list[Mark]) -> None:
    for m in marks:
        if m.kind in ON_CURVES:
            ax.axvline(m.time, color=color(m.kind), linestyle="--", linewidth=1.2, alpha=0.9)


def curves(data: ReportData) -> bytes:
    """Loss and throughput over time, with the run-changing events as dashed lines."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, layout="constrained")
    loss = [p for p in data.train if p["loss"] is not None]
    top.plot([p["time"] for p in loss], [p["loss"] for p in loss], color=LOSS, marker=".", linewidth=1.5)
    top.set_ylabel("training loss")
    top.set_title("loss and throughput over time")
    _throughput(bottom, data)
    bottom.set_xlabel("seconds since the run started")
    for ax in (top, bottom):
        ax.set_xlim(*_training_span(data))
        ax.grid(True, alpha=0.3)
        _mark_lines(ax, data.marks)
        if not data.train:
            ax.text(0.5, 0.5, "no train records", ha="center", va="center", transform=ax.transAxes)
    return _png(fig)


def _throughput(ax: Axes, data: ReportData) -> None:
    """Throughput in the unit its records carry; a curve per unit where a run
    changed what it counts (a resumed job of another version), never mixed."""
    units = data.units()
    for unit in units:
        points = [p for p in data.train if p["unit"] == unit and p["per_s"] is not None]
        ax.plot([p["time"] for p in points], [p["per_s"] for p in points], color=THROUGHPUT, marker=".",
                linewidth=1.5, label=f"{unit} / s", linestyle="-" if unit == units[0] else ":")
    ax.set_ylabel(f"{' or '.join(units) or 'samples'} / s (all ranks)")
    if len(units) > 1:
        ax.legend(loc="best")


def _training_span(data: ReportData) -> tuple[float, float]:
    """The curves' time axis: from the first training record to the last
    one or the last run-changing event, whichever is later (the time line
    below shows the whole run, start-up included)."""
    times = [p["time"] for p in data.train + data.step_times]
    if not times:
        return 0.0, data.end()
    last = max([*times, *(m.time for m in data.marks if m.kind in ON_CURVES)])
    pad = max(last - min(times), 1.0) * 0.03
    return min(times) - pad, last + pad


def _column(times: list[float], t: float) -> int:
    """The heat map's column (a window of steps, at its end time) that time t falls in."""
    return min(bisect_left(times, t), len(times) - 1)


def heatmap(data: ReportData) -> bytes:
    """Each rank's mean step time per window (a row per rank); stalled ranks
    crossed, stragglers boxed, in the window where the record came."""
    world = data.world()
    windows = [w for w in data.step_times if len(w["step_s"]) == world]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.35 * max(world, 2)), layout="constrained")
    ax.set_title("step time per rank (mean over each window of steps, ms)")
    if not windows:
        ax.text(0.5, 0.5, "no step_times records", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _png(fig)
    grid = [[w["step_s"][r] * 1000 for w in windows] for r in range(world)]
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="ms per step", pad=0.01)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ticks = sorted({round(i * (len(windows) - 1) / 7) for i in range(8)}) if len(windows) > 8 else range(len(windows))
    ax.set_xticks(list(ticks), [str(windows[i]["step"]) for i in ticks])
    ax.set_xlabel("step (end of window)")
    times = [w["time"] for w in windows]
    for m in data.rank_marks("stall"):
        col = _column(times, m.time)
        for r in m.ranks:
            ax.plot(col, r, marker="x", color=color("stall"), markersize=14, markeredgewidth=3)
    for m in data.rank_marks("straggler"):
        col = _column(times, m.time)
        for r in m.ranks:
            ax.add_patch(Rectangle((col - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=color("straggler"),
                                   linewidth=3))
    return _png(fig)


def timeline(data: ReportData) -> bytes:
    """Every event and marked record on the time axis, one row per kind."""
    kinds = list(dict.fromkeys(m.kind for m in data.marks))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.4 * max(len(kinds), 1)), layout="constrained")
    ax.set_title("events")
    for row, kind in enumerate(kinds):
        times = [m.time for m in data.marks if m.kind == kind]
        ax.scatter(times, [row] * len(times), color=color(kind), s=80, marker="|" if kind in ("checkpoint", "eval")
                   else "o", linewidths=2, zorder=3)
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    ax.invert_yaxis()
    ax.set_xlim(-0.01 * data.end(), data.end() * 1.02)
    ax.set_xlabel("seconds since the run started")
    ax.grid(True, axis="x", alpha=0.3)
    return _png(fig)
