"""Logs without spew: a line that several ranks print at about the same time
is shown once on a launcher's console, with the ranks named (pytorch's RFC
"No Distributed Log Spew", pytorch#162999).

`Dedup` is the rule, with no clock and no I/O of its own (the supervisor's
`LinePrinter` feeds it and prints what it releases; tests give it a fake
clock). A line is held in a group with every identical body that other
sources print within `window_s` of the group's first copy, or until every
rank has printed it; groups are released in the order of their first copy,
so no line waits longer than `window_s`, and `drain()` releases the rest.

- A source is one rank (`[node0 rank1]`, torchrun's prefix), or, for a line
  without a rank (torchrun's agent, `launch docker` and `launch ssh`, which
  run torchrun without the prefix), one node.
- Lines come out in the order of their groups' first copies. A rank's copy
  joins the oldest held group of the same body that it is not in yet, so a
  rank that printed other lines in between sees its copy moved up by less
  than `window_s` (torchrun reads a rank's stdout and stderr apart: their
  relative order was never exact). The same rank printing a line twice is
  two lines.
- A group of one source prints as it came (`[node0 rank1] text`); several
  ranks as `[ranks 1-5] text`, or `[all 6 ranks] text` when every rank of the
  job printed it; several rank-less copies as `[nodes 0-1] text` (with the
  number of copies when a node printed it more than once).

Only identical bodies merge, but for the time a log header gives each copy
(`merge_key`): the same warning from every rank is one line whatever its
timestamps (torch's `[W1127 10:00:00.123456 77 reducer.cpp:1529] ...`, with
its process id, or Python logging's `2026-11-27 10:00:00,123 ...`), shown as
its first copy came. Lines whose message names their rank, step or time
differ and are printed as they are. The node logs are written before the printer
sees a line, so they stay complete; `--no-dedup` turns this off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW_S = 1.0  # the longest a line is held back waiting for other ranks' copies


@dataclass(frozen=True)
class Source:
    """Who printed a line: a rank, or (rank None) a node's rank-less output."""

    node: int
    rank: int | None
    prefix: str  # the line's own prefix, e.g. "[node0 rank1] "
    style: str

    @property
    def key(self) -> tuple[int, int | None]:
        return (self.node, self.rank)


@dataclass(frozen=True)
class Released:
    """One console line: its prefix, the prefix's style, the body."""

    prefix: str
    style: str
    body: str


MASK = "\x00"  # stands for a masked time or process id (no printed line holds it)


def merge_key(body: str) -> str:
    """What copies of a line are merged by: `body` with the time its log
    header starts with masked, and the process id torch's header names after
    the time (each rank's copy differs in both). A header: torch's C++
    warning's `[W1127 10:00:00.123456789 77 file.cpp:1033]`, its Python
    logs' `W1127 10:00:00.123000 77 run.py:793]`, Python logging's
    `2026-11-27 10:00:00,123` (bracketed or not). A time anywhere else in the
    line is the message's own and kept."""
    lead = 1 if body.startswith("[") else 0
    glog = _glog_end(body, lead)
    end = glog or _dated_end(body, lead)
    if not end:
        return body
    rest = body[end:]
    pid, space, after = rest[1:].partition(" ")
    if glog and rest.startswith(" ") and pid.isdecimal() and space and after.split(" ", 1)[0].endswith("]"):
        rest = " " + MASK + " " + after
    return body[:lead] + (body[lead] if glog else "") + MASK + rest


def _clock_end(text: str, at: int) -> int:
    """The end of an `HH:MM:SS` time at `at` (with its fraction after `.` or `,`), 0 where none is."""
    clock = text[at:at + 8]
    if not (len(clock) == 8 and clock[2] == clock[5] == ":"
            and (clock[:2] + clock[3:5] + clock[6:]).isdecimal()):
        return 0
    end = at + 8
    if text[end:end + 1] in (".", ",") and text[end + 1:end + 2].isdecimal():
        end += 1
        while text[end:end + 1].isdecimal():
            end += 1
    return end


def _glog_end(text: str, at: int) -> int:
    """torch's header: a severity letter, the month and day, a space, the time."""
    if text[at:at + 1] in ("I", "W", "E", "F") and text[at + 1:at + 5].isdecimal() and text[at + 5:at + 6] == " ":
        return _clock_end(text, at + 6)
    return 0


def _dated_end(text: str, at: int) -> int:
    """Python logging's asctime: `YYYY-MM-DD HH:MM:SS,mmm` (or ISO's `T`)."""
    date = text[at:at + 10]
    if (len(date) == 10 and date[4] == date[7] == "-" and (date[:4] + date[5:7] + date[8:]).isdecimal()
            and text[at + 10:at + 11] in (" ", "T")):
        return _clock_end(text, at + 11)
    return 0


@dataclass
class _Group:
    seq: int
    body: str
    key: tuple[str, bool]
    first: float
    sources: list[Source] = field(default_factory=list)
    # Kept beside the list, so that a line every rank of a large job prints
    # costs the same per copy whatever the number of ranks.
    keys: set[tuple[int, int | None]] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)

    def add(self, source: Source) -> None:
        self.sources.append(source)
        self.keys.add(source.key)
        if source.rank is not None:
            self.ranks.add(source.rank)

    def holds(self, source: Source) -> bool:
        return source.key in self.keys


def ranges(numbers: Iterable[int]) -> str:
    """0,1,2,5,7,8 -> "0-2,5,7-8"."""
    parts: list[str] = []
    run: list[int] = []
    for n in sorted(set(numbers)):
        if run and n != run[-1] + 1:
            parts.append(_run(run))
            run = []
        run.append(n)
    if run:
        parts.append(_run(run))
    return ",".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


class Dedup:
    """Holds lines by body for up to `window_s`; see the module's docstring."""

    def __init__(self, ranks: int | None, window_s: float = WINDOW_S, merged_style: str = "bold") -> None:
        self.ranks = ranks  # the job's world size, when known: "all N ranks", and released once all printed
        self.window_s = window_s
        self.merged_style = merged_style
        self._held: deque[_Group] = deque()
        self._by_body: dict[tuple[str, bool], list[_Group]] = {}
        self._seq = 0

    def add(self, source: Source, body: str, now: float) -> list[Released]:
        """Takes one line; returns what is due now (this line's group when
        every rank has printed it, and anything older whose time is up)."""
        key = (merge_key(body), source.rank is not None)
        # the oldest held copy this rank is not in yet (a node's rank-less
        # copies, its local ranks unnamed, are counted instead)
        group = next((g for g in self._by_body.get(key, ()) if source.rank is None or not g.holds(source)), None)
        if group is None:
            self._seq += 1
            group = _Group(self._seq, body, key, now)
            self._held.append(group)
            self._by_body.setdefault(key, []).append(group)
        group.add(source)
        return self.due(now)

    def due(self, now: float) -> list[Released]:
        """The held groups whose time is up or that every rank printed, oldest first;
        a group not yet due keeps the younger ones behind it (their order)."""
        out: list[Released] = []
        while self._held and (self._complete(self._held[0]) or now - self._held[0].first >= self.window_s):
            out.append(self._release(self._held.popleft()))
        return out

    def next_due(self) -> float | None:
        """When the oldest held group is due (clock time), None when none is held."""
        return self._held[0].first + self.window_s if self._held else None

    def drain(self) -> list[Released]:
        """Everything held, in order (the run ended)."""
        out = [self._release(g) for g in self._held]
        self._held.clear()
        self._by_body.clear()
        return out

    def _complete(self, group: _Group) -> bool:
        return (self.ranks is not None and group.sources[0].rank is not None
                and len(group.ranks) >= self.ranks)

    def _release(self, group: _Group) -> Released:
        rest = [g for g in self._by_body.get(group.key, ()) if g is not group]
        if rest:
            self._by_body[group.key] = rest
        else:
            self._by_body.pop(group.key, None)
        return Released(self.label(group.sources), self._style(group.sources), group.body)

    def label(self, sources: list[Source]) -> str:
        if len(sources) == 1:
            return sources[0].prefix
        if sources[0].rank is not None:
            ranks = {s.rank for s in sources if s.rank is not None}
            if self.ranks is not None and ranks == set(range(self.ranks)):
                return f"[all {self.ranks} ranks] "
            return f"[ranks {ranges(ranks)}] "
        nodes = [s.node for s in sources]
        copies = "" if len(set(nodes)) == len(nodes) else f", {len(nodes)} copies"
        return f"[nodes {ranges(nodes)}{copies}] " if len(set(nodes)) > 1 else f"[node{nodes[0]}{copies}] "

    def _style(self, sources: list[Source]) -> str:
        return sources[0].style if len({s.node for s in sources}) == 1 else self.merged_style
