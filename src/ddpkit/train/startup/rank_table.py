"""Rank 0's table of the rank report, for people to read.

Up to FULL_ROWS processes it shows every row. Above that a row per process
is thousands of lines nobody reads (and rich takes half a minute to lay out
8,192 of them), so the table is short: one row per kind of process (the same
device pattern, interface, versions and launcher), its ranks, node ranks and
hosts as ranges, and every process that differs from the majority (or shares
its rank with another) on a row of its own. The full table goes to a text
file when rank 0 has a folder for it. Everything here is O(rows).
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from ...records import RankRow

FULL_ROWS = 64  # up to this many processes the table shows each one
APART_ROWS = 32  # at most this many differing processes on rows of their own; more fold into their kind's row
RANGES_SHOWN = 4  # a cell of rank ranges names this many, then how many more
SHORT_WIDTH = 240  # the short table's widest line in a log
TABLE_FILE = "rank_report.txt"  # the full table, in the folder rank 0 was given (a log or run folder)
COLUMNS = ["rank", "local_rank", "node_rank", "host", "pid", "device", "interface", "address",
           "torch", "cuda", "nccl", "launcher"]
_INDEXED = re.compile(r"^([a-z]+):(\d+)$")

Kind = tuple[str | None, ...]


def cell(row: RankRow, column: str) -> str:
    value = getattr(row, column)
    return "-" if value is None else str(value)


def device_pattern(row: RankRow) -> str:
    """`cuda:<local rank>` where the device's index is the process's local rank:
    the same for every process of a healthy node, so it does not split kinds."""
    m = _INDEXED.match(row.device)
    return f"{m.group(1)}:<local rank>" if m and int(m.group(2)) == row.local_rank else row.device


def kind(row: RankRow) -> Kind:
    """What every process of one job should share (the columns a reader compares)."""
    return (device_pattern(row), row.interface, row.torch, row.cuda, row.nccl, row.launcher)


def ranges(values: Iterable[int]) -> str:
    """Sorted distinct ints as `0-4999, 5001-8191`; past RANGES_SHOWN ranges,
    the first ones, the last and how many there are."""
    runs: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(shown) > RANGES_SHOWN:
        return ", ".join(shown[:RANGES_SHOWN - 1]) + f", … {shown[-1]} ({len(shown)} ranges)"
    return ", ".join(shown)


def _names(values: Sequence[str], many: str, ends: bool = True) -> str:
    distinct = list(dict.fromkeys(values))
    if len(distinct) <= 2:
        return ", ".join(distinct)
    return f"{distinct[0]} … {distinct[-1]} ({len(distinct)} {many})" if ends else f"{len(distinct)} {many}"


def group_cells(rows: Sequence[RankRow]) -> list[str]:
    """One row standing for `rows` (all of one kind)."""
    first = rows[0]
    addresses = [cell(r, "address") for r in rows]
    return [ranges(r.rank for r in rows), ranges(r.local_rank for r in rows), ranges(r.node_rank for r in rows),
            _names([r.host for r in rows], "hosts"), f"{len(rows)} processes", device_pattern(first),
            cell(first, "interface"), _names(addresses, "addresses", ends=False), *(cell(first, c) for c in COLUMNS[-4:])]


def short_table(rows: Sequence[RankRow]) -> tuple[list[list[str]], int, int]:
    """The short table's rows (kinds first, the majority's first of all, then
    the processes shown apart), how many processes the kind rows stand for,
    and how many are shown apart."""
    ordered = sorted(rows, key=lambda r: (r.rank, r.pid))
    kinds = [kind(r) for r in ordered]
    majority = Counter(kinds).most_common(1)[0][0] if kinds else None
    times = Counter(r.rank for r in ordered)
    apart = [i for i, (r, k) in enumerate(zip(ordered, kinds)) if k != majority or times[r.rank] > 1][:APART_ROWS]
    shown = set(apart)
    by_kind: dict[Kind, list[RankRow]] = {}
    for i, (r, k) in enumerate(zip(ordered, kinds)):
        if i not in shown:
            by_kind.setdefault(k, []).append(r)
    groups = sorted(by_kind.values(), key=lambda g: (kind(g[0]) != majority, g[0].rank))
    table = [group_cells(g) for g in groups] + [[cell(ordered[i], c) for c in COLUMNS] for i in apart]
    return table, sum(len(g) for g in groups), len(apart)


def text_table(rows: Sequence[RankRow]) -> str:
    """Every row, plain and aligned: the full table for a file."""
    head = [c.replace("_", " ") for c in COLUMNS]
    body = [[cell(r, c) for c in COLUMNS] for r in sorted(rows, key=lambda r: (r.rank, r.pid))]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([f"rank report: {len(rows)} processes", line(head), *(line(b) for b in body)]) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Readers never see half a file: write beside it, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _full_table_note(rows: Sequence[RankRow], folder: Path | None, records: str | None) -> str:
    """Where the rows left out of the short table can be read."""
    kept = f"; every process's record: {records}" if records else ""
    if folder is None:
        return f"the full table is omitted (rank 0 has no log or run folder){kept}"
    path = folder / TABLE_FILE
    try:
        write_atomically(path, text_table(rows))
    except OSError as exc:
        return f"the full table could not be written to {path}: {exc}{kept}"
    return f"the full table: {path}{kept}"


def print_table(rows: list[RankRow], problems: list[str], *, folder: Path | None = None,
                records: str | None = None) -> None:
    """Rank 0's table: every row up to FULL_ROWS processes; above, the short
    table, with the full one written to `folder` (a log or run folder; None:
    none) and `records` (where every process's record went, if anywhere) named."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rank report: {len(rows)} processes", title_justify="left")
    for name in COLUMNS:
        table.add_column(name.replace("_", " "), no_wrap=True)
    note = None
    if len(rows) <= FULL_ROWS:
        for row in sorted(rows, key=lambda r: (r.rank, r.pid)):
            table.add_row(*(cell(row, c) for c in COLUMNS))
    else:
        body, folded, apart = short_table(rows)
        for cells in body:
            table.add_row(*cells)
        note = (f"rank report: {folded} processes folded into {len(body) - apart} row(s), one per kind "
                f"(device, interface, versions, launcher); {apart} shown on their own (unlike most processes, "
                f"or a repeated rank); {_full_table_note(rows, folder, records)}")
    # Logs are not terminals: do not squeeze the table into 80 columns there
    # (the short table's ranges and host names need more than the full one's cells).
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160 if note is None else SHORT_WIDTH)
    console.print(table)
    if note is not None:
        console.print(note, markup=False, soft_wrap=True)
    for problem in problems:
        console.print(f"[bold red]rank report:[/] {problem}", markup=True, soft_wrap=True)
