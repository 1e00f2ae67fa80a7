"""The report's HTML page: one file that needs nothing else (every figure
embedded as a base64 PNG, the style inline, no script), so it opens the
same from a laptop, a mail or a cluster's login node without a network."""

from __future__ import annotations

import base64
import time
from html import escape
from statistics import mean
from typing import Any

from .data import Mark, ReportData
from .plots import color

STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; max-width: 1100px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f0f0f0; }
.flag { color: #b00; font-weight: bold; }
.dot { display: inline-block; width: 0.8em; height: 0.8em; border-radius: 50%; margin-right: 0.3em; }
.muted { color: #777; }
"""


def _img(name: str, png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img id="{escape(name)}" alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _table(head: list[str], rows: list[list[str]]) -> str:
    """Cells are HTML already (escaped where they carry text)."""
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _flagged(marks: list[Mark], rank: int) -> str:
    times = [f"{m.time:.1f}s" for m in marks if rank in m.ranks]
    return f'<span class="flag">{escape(", ".join(times))}</span>' if times else "-"


def rank_rows(data: ReportData) -> list[list[str]]:
    """One row per rank: where it ran (the rank report) and its step times."""
    by_rank: dict[int, dict[str, Any]] = {int(r["rank"]): r for r in data.ranks if "rank" in r}
    stalls, stragglers = data.rank_marks("stall"), data.rank_marks("straggler")
    rows = []
    for rank in range(data.world()):
        row = by_rank.get(rank, {})
        times = [w["step_s"][rank] * 1000 for w in data.step_times if rank < len(w["step_s"])]
        rows.append([str(rank), *(escape(str(row.get(k, "-"))) for k in ("node_rank", "host", "pid", "device")),
                     f"{mean(times):.1f}" if times else "-", f"{max(times):.1f}" if times else "-",
                     _flagged(stragglers, rank), _flagged(stalls, rank)])
    return rows


def _event_rows(marks: list[Mark]) -> list[list[str]]:
    return [[f"{m.time:.1f}", f'<span class="dot" style="background:{color(m.kind)}"></span>{escape(m.kind)}',
             escape(", ".join(map(str, m.ranks)) or "-"), escape(m.detail)] for m in marks]


def render(data: ReportData, figures: dict[str, bytes]) -> str:
    """figures: name -> PNG ("curves", "heatmap", "timeline")."""
    last = data.train[-1] if data.train else None
    facts = [f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(data.started))}",
             f"{data.world()} ranks"]
    if last is not None:
        loss = "-" if last["loss"] is None else f"{last['loss']:.4g}"
        facts.append(f"last train record: step {last['step']}, loss {loss}")
    facts.append(f"metrics from {data.metrics_path}")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ddpkit report: {escape(data.title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>ddpkit report: {escape(data.title)}</h1>",
        f'<p class="muted">{escape("; ".join(facts))}</p>',
        "<h2>Loss and throughput</h2>", _img("curves", figures["curves"], "loss and throughput over time"),
        "<h2>Step time per rank</h2>",
        '<p class="muted">red crosses: ranks a stall named; orange boxes: stragglers</p>',
        _img("heatmap", figures["heatmap"], "per-rank step-time heat map"),
        "<h2>Ranks</h2>",
        _table(["rank", "node", "host", "pid", "device", "mean step ms", "slowest window ms", "straggler at",
                "stalled at"], rank_rows(data)),
        "<h2>Events</h2>", _img("timeline", figures["timeline"], "events on the time line"),
        _table(["s since start", "event", "ranks", "detail"], _event_rows(data.marks)),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
