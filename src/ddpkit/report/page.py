"""The report's HTML page: one file that needs nothing else (every figure
embedded as a base64 PNG, the style inline, no script), so it opens the
same from a laptop, a mail or a cluster's login node without a network.
The page is templates/report/page.html.j2; this module gathers its rows."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from functools import lru_cache
from statistics import mean
from typing import Any

import jinja2

from ..render.templatedir import default_template_dir
from .data import Mark, ReportData
from .plots import color

TEMPLATE = "report/page.html.j2"


@dataclass(frozen=True)
class ReportRankRow:
    """One rank in the page's table: where it ran (the rank report) and its
    step times; `-` where nothing was recorded. The flag columns are the
    seconds since start at which a judge named the rank ('' when none did)."""

    rank: int
    node_rank: str
    host: str
    pid: str
    device: str
    mean_ms: str
    slowest_ms: str
    straggler_at: str
    stalled_at: str


@dataclass(frozen=True)
class EventRow:
    time: float
    kind: str
    color: str
    ranks: str
    detail: str


def _flagged(marks: list[Mark], rank: int) -> str:
    return ", ".join(f"{m.time:.1f}s" for m in marks if rank in m.ranks)


def rank_rows(data: ReportData) -> list[ReportRankRow]:
    """One row per rank of the run's world."""
    by_rank: dict[int, dict[str, Any]] = {int(r["rank"]): r for r in data.ranks if "rank" in r}
    stalls, stragglers = data.rank_marks("stall"), data.rank_marks("straggler")
    rows = []
    for rank in range(data.world()):
        row = by_rank.get(rank, {})
        times = [w["step_s"][rank] * 1000 for w in data.step_times if rank < len(w["step_s"])]
        node_rank, host, pid, device = (str(row.get(k, "-")) for k in ("node_rank", "host", "pid", "device"))
        rows.append(ReportRankRow(rank, node_rank, host, pid, device,
                            mean_ms=f"{mean(times):.1f}" if times else "-",
                            slowest_ms=f"{max(times):.1f}" if times else "-",
                            straggler_at=_flagged(stragglers, rank), stalled_at=_flagged(stalls, rank)))
    return rows


def event_rows(marks: list[Mark]) -> list[EventRow]:
    return [EventRow(m.time, m.kind, color(m.kind), ", ".join(map(str, m.ranks)) or "-", m.detail) for m in marks]


def facts(data: ReportData) -> list[str]:
    """The line under the title: when, how many ranks, the last train record, where the metrics are."""
    out = [f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(data.started))}", f"{data.world()} ranks"]
    last = data.train[-1] if data.train else None
    if last is not None:
        loss = "-" if last["loss"] is None else f"{last['loss']:.4g}"
        out.append(f"last train record: step {last['step']}, loss {loss}")
    out.append(f"metrics from {data.metrics_path}")
    return out


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(default_template_dir())),
                             undefined=jinja2.StrictUndefined, autoescape=True, keep_trailing_newline=True)
    return env.get_template(TEMPLATE)


def render(data: ReportData, figures: dict[str, bytes]) -> str:
    """figures: name -> PNG ("curves", "heatmap", "timeline")."""
    encoded = {name: base64.b64encode(png).decode("ascii") for name, png in figures.items()}
    return _template().render(title=data.title, facts=facts(data), figures=encoded, ranks=rank_rows(data),
                              events=event_rows(data.marks))
