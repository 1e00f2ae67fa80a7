"""Rank 0's output: one rich table per section with PASS/WARN/FAIL and the
fix for every failure, or one JSON document (--json)."""

from __future__ import annotations

import json
import sys
from itertools import groupby
from typing import TYPE_CHECKING, TextIO

from .results import BenchRow, Check, DoctorResult, Status
from .sizes import format_size

if TYPE_CHECKING:
    from rich.table import Table

SECTIONS = (("local", "local checks"), ("network", "network checks"), ("distributed", "distributed checks"))
STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts = []
    ordered = sorted(set(ranks))
    for _, run in groupby(enumerate(ordered), key=lambda p: p[1] - p[0]):
        items = [r for _, r in run]
        parts.append(str(items[0]) if len(items) == 1 else f"{items[0]}-{items[-1]}")
    return ",".join(parts)


def merged(checks: list[Check]) -> list[tuple[str, Check]]:
    """Identical verdicts from many ranks become one row with a rank range,
    so 64 ranks that all pass do not print 64 rows."""
    keyed: dict[tuple[object, ...], list[Check]] = {}
    for c in checks:
        keyed.setdefault((c.name, c.status, c.detail, c.fix), []).append(c)
    rows = []
    for group in keyed.values():
        ranks = [c.rank for c in group if c.rank is not None]
        rows.append((rank_ranges(ranks) if ranks else "all", group[0]))
    order = {Status.FAIL: 0, Status.WARN: 1, Status.PASS: 2, Status.SKIP: 3}
    return sorted(rows, key=lambda rc: (rc[1].name, order[rc[1].status]))


def _checks_table(title: str, checks: list[Check]) -> Table:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for col in ("rank", "check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for ranks, c in merged(checks):
        table.add_row(ranks, c.name, f"[{STYLE[c.status]}]{c.status.value}[/]", c.detail, c.fix)
    return table


def _bench_table(rows: list[BenchRow], world: int) -> Table:
    from rich.table import Table

    table = Table(title=f"bandwidth ({world} ranks; busbw as nccl-tests define it)", title_justify="left")
    for col in ("backend", "op", "size", "iters", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="right" if col not in ("backend", "op") else "left")
    for r in rows:
        table.add_row(r.backend, r.op, format_size(r.size_bytes), str(r.iterations), f"{r.time_us:.1f}",
                      f"{r.algbw_gbps:.4g}", f"{r.busbw_gbps:.4g}")
    return table


def print_tables(result: DoctorResult, out: TextIO | None = None) -> None:
    from rich.console import Console

    out = out or sys.stdout
    # Logs from Slurm, kubectl and docker are not terminals: rich would wrap
    # them at 80 columns, which folds every fix into a narrow column.
    width = None if out.isatty() else 160
    console = Console(file=out, highlight=False, soft_wrap=False, width=width)
    for key, title in SECTIONS:
        section = [c for c in result.checks if c.section == key]
        if section:
            console.print(_checks_table(title, section))
    if result.barrier_us:
        figures = ", ".join(f"{b}: {us:.0f} us" for b, us in result.barrier_us.items())
        console.print(f"barrier latency: {figures}")
    if result.bench:
        console.print(_bench_table(result.bench, result.world_size))
    fails = [c for c in result.checks if c.status is Status.FAIL]
    style = {"PASS": "bold green", "WARN": "bold yellow", "FAIL": "bold red"}[result.verdict]
    console.print(f"[{style}]doctor: {result.verdict}[/] ({len(fails)} failure(s), world size {result.world_size})")


def print_json(result: DoctorResult, out: TextIO | None = None) -> None:
    (out or sys.stdout).write(json.dumps(result.to_json(), indent=2) + "\n")
