"""A node of a run, whatever carries it (`NodeHandle`: a torchrun agent, a
container, an SSH session), and where every node's output goes
(`LinePrinter`), one line at a time, in three steps: the reader
(launch/supervise/reader.py) reads each line once into what it holds, lines
for people and records; each record goes to the run's `Findings`
(launch/supervise/findings.py: what the summary reads; a node newly reported
lost is told to the supervisor, whose loop gets it as an event); each line for people, and the
line a record shows in its place, goes to the console (`ConsoleLines`: one
prefix per line, lines several ranks print at once shown once). A record is
kept off the console (the node's log keeps it). The supervisor
(launch/supervise/supervisor.py) owns the run; this module only reads."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from ... import records
from .dedup import Dedup, Released, Source
from .findings import Findings
from .reader import OutputReader, Read, noisy
from .reads import LineRead

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console


NO_EXIT_STATUS = -1  # a node that ended without an exit status (a dropped connection, a removed container)

STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
SUMMARY_LINES = 5  # of those, shown in the summary's "first failure" cell


class NodeHandle(Protocol):
    """One node of a run, whatever carries it."""

    @property
    def index(self) -> int:
        """The node rank."""

    @property
    def host(self) -> str:
        """Where it runs, as the user knows the host."""

    @property
    def label(self) -> str:
        """The node part of each output line's prefix, e.g. `node0` or `node0 10.0.0.2`."""

    def start(self, printer: LinePrinter, exited: Callable[[], None]) -> None:
        """Start the node; send each output line to `printer.line(self, text)`
        and call `exited()` once, from any thread, when it has ended."""

    def exit_code(self) -> int | None:
        """None while running; then its exit code (128+N for signal N), or NO_EXIT_STATUS."""

    def no_status_reason(self) -> str:
        """Why a node ended with NO_EXIT_STATUS (one line)."""

    def stop(self, grace_s: float) -> str | None:
        """Stop it and everything it started: TERM, KILL after `grace_s`.
        Safe on a node that has ended or never started. Returns a problem, if any."""


class LinePrinter:
    """Every node's output, one line at a time (`line`, from each node's
    thread): read once (`OutputReader`), its records kept in `findings` (the
    supervisor's, or its own), its lines for people printed (`ConsoleLines`,
    with a `Dedup`: the launchers' default; --no-dedup: none). `close()`
    gives out what is held. `on_lost` is told each node newly reported lost,
    `on_record` every record framed on the output (a MetricsSink)."""

    def __init__(self, console: Console, dedup: Dedup | None = None,
                 clock: Callable[[], float] = time.monotonic, findings: Findings | None = None) -> None:
        self.clock = clock
        self.reader = OutputReader()
        self.findings = Findings() if findings is None else findings
        self.out = ConsoleLines(console, dedup, lambda: self.clock())
        self.on_lost: Callable[[int], None] = lambda _node: None
        self.on_record: Callable[[records.Stamped], None] = lambda _stamped: None
        self._lock = threading.Lock()  # one line read, kept and printed at a time: the console keeps their order

    def line(self, node: NodeHandle, text: str) -> None:
        with self._lock:
            for read in self.reader.read(node.index, node.label, text, self.clock()):
                self._hand(read)

    def _hand(self, read: Read) -> None:
        """A line to the console and the node's tail; a record to the findings."""
        if isinstance(read, LineRead):
            self._show(read.node, read.rank, read.prefix, read.body)
            return
        if read.framed:
            self.on_record(records.Stamped(read.record, read.time))
        taken = self.findings.take(read, self.clock())
        for node in taken.lost:
            self.on_lost(node)
        if taken.shown is not None and not (read.framed and noisy(taken.shown)):
            self._show(read.node, read.rank, read.prefix, taken.shown)

    def _show(self, node: int, rank: int | None, prefix: str, body: str) -> None:
        self.findings.shown(node, prefix + body)
        self.out.show(node, rank, prefix, body)

    def close(self) -> None:
        """Prints every held line, in order (a traceback never finished: as it
        came); later lines print at once."""
        with self._lock:
            for read in self.reader.close():
                self._hand(read)
            self.out.close()

    def forget(self, index: int) -> None:
        """A node that comes back (elastic) starts without its last failure's code."""
        with self._lock:
            self.reader.forget(index)
            self.findings.forget(index)



class ConsoleLines:
    """Prints each line it is handed, `[<label>] ` or `[<label> rank<R>] `
    in its node's style. With a `Dedup`, a line several ranks print at about
    the same time is shown once with the ranks named
    (launch/supervise/dedup.py); a thread releases held lines when their time
    is up, and `close()` releases the rest."""

    def __init__(self, console: Console, dedup: Dedup | None, clock: Callable[[], float]) -> None:
        self.console, self.dedup, self.clock = console, dedup, clock
        self._flusher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)

    def show(self, node: int, rank: int | None, prefix: str, body: str) -> None:
        style = STYLES[node % len(STYLES)]
        with self._lock:
            if self.dedup is None:
                self._print(Released(prefix, style, body))
                return
            due = self.dedup.next_due()
            for out in self.dedup.add(Source(node, rank, prefix, style), body, self.clock()):
                self._print(out)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="line dedup", daemon=True)
                self._flusher.start()
            if self.dedup.next_due() != due:  # the flusher waits for the oldest group: woken only when that changed
                self._wake.notify()

    def _print(self, out: Released) -> None:
        from rich.text import Text

        self.console.print(Text.assemble((out.prefix, out.style), out.body), soft_wrap=True)

    def _flush_loop(self) -> None:
        """Releases held lines when their time is up, until close()."""
        with self._lock:
            while self.dedup is not None:
                due = self.dedup.next_due()
                self._wake.wait(None if due is None else max(due - self.clock(), 0.01))
                if self.dedup is not None:
                    for out in self.dedup.due(self.clock()):
                        self._print(out)

    def close(self) -> None:
        """Prints every held line, in order; later lines print at once."""
        with self._lock:
            if self.dedup is not None:
                for out in self.dedup.drain():
                    self._print(out)
                self.dedup = None
                self._wake.notify_all()


@contextmanager
def node_log(path: Path | None) -> Iterator[Callable[[bytes], None]]:
    """A writer that appends a node's raw output to `path` as it comes, all of
    it (the console leaves torchrun's traceback out); flushed per write, so a
    killed launcher leaves the file whole up to there. No path: a no-op."""
    if path is None:
        yield lambda _chunk: None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as log:
        def keep(chunk: bytes) -> None:
            log.write(chunk)
            log.flush()

        yield keep


def add_dedup_argument(parser: argparse.ArgumentParser) -> None:
    """--no-dedup, on every launcher the supervisor runs."""
    parser.add_argument("--no-dedup", dest="dedup", action="store_false",
                        help="print every rank's copy of a line; by default a line several ranks print at about "
                             "the same time is shown once, e.g. '[ranks 1-5] ...' or '[all 6 ranks] ...' "
                             "(the node logs keep every copy)")
