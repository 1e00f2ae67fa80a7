"""A node of a run, whatever carries it (`NodeHandle`: a torchrun agent, a
container, an SSH session), and the printer of every node's output
(`LinePrinter`): one prefix per line, torchrun's worker prefix parsed back,
lines several ranks print at once shown once, and what the summary needs
from the output: each node's last lines, the workers' cause lines, and the
records the job and its agent send (ddpkit.records, framed on their
output): the watchdog's stall, straggler and lost-node reports, an elastic
job training again, a failed worker's exit code, the same error twice. A record is kept off the
console (the node's log keeps it); the lines a person reads come beside it.
The supervisor (launch/supervise/supervisor.py) owns the run; this module only reads."""

from __future__ import annotations

import argparse
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from ... import records
from ...records.tracebacks import Tracebacks
from .dedup import Dedup, Released, Source
from .exceptions import Exceptions, RankException
from .recovery import Recovery

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

NO_EXIT_STATUS = -1  # a node that ended without an exit status (a dropped connection, a removed container)

STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
# torch's lines that say nothing a person can act on, kept off the console (the node logs
# keep them): c10d's client looks up the name of the IPv4-mapped form of the address it
# connected to, which /etc/hosts does not answer, and warns when DNS cannot be reached
# (hosts named by /etc/hosts alone), once per process that connects.
NOISE = ("The hostname of the client socket cannot be retrieved.",)
TAIL_LINES = 100  # kept per node for the summary: torchrun's own failure report alone is ~35
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
    """Every node's output, one line at a time, each with one prefix
    `[<label>]` or `[<label> rank<R>]`, and the last lines of each node.
    With a `Dedup` (the launchers' default; --no-dedup: none) a line several
    ranks print at about the same time is shown once with the ranks named
    (launch/supervise/dedup.py); a thread releases held lines when their time is up,
    and `close()` releases the rest."""

    def __init__(self, console: Console, dedup: Dedup | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.dedup, self.clock = dedup, clock
        self._flusher: threading.Thread | None = None
        self.tails: dict[int, deque[str]] = {}
        self._tailed: dict[int, int] = {}  # node index -> lines it ever added to its tail
        self._cut: dict[int, int] = {}  # node index -> its tail's length when its agent reported a failed worker
        self.stalled: dict[int, records.StalledRank] = {}  # by rank: what the watchdog's report said
        self.stragglers: dict[int, records.Straggler] = {}  # by rank: the first time the watchdog named it
        self.worker_codes: dict[int, int] = {}  # by node index: the first failed worker's code (its agent's record)
        self.failed_at: dict[int, float] = {}  # by node index: when its first worker failed, on that node's clock
        self.same_errors: dict[int, records.SameError] = {}  # by node index: its agent saw the same error twice
        self.worker_ranks: dict[int, int | None] = {}  # by node index: the rank of its first failed worker
        self.exceptions = Exceptions()  # every worker's exception, from its traceback record
        self.stopped: records.Stop | None = None  # the job's last stop record: it checkpointed on a stop signal, or not
        self.causes: dict[str, int] = {}  # each worker's cause line (its `cause` record), once, with its first node
        self._hidden: dict[tuple[int, str], int] = {}  # (node, cause line) -> copies still to keep off the console
        self.recovery = Recovery()  # the watchdog's lost-node report, and when the others trained again
        self.on_lost: Callable[[int], None] = lambda _node: None  # called with a node newly reported lost
        self.on_record: Callable[[records.Stamped], None] = lambda _stamped: None  # called with every record read
        self._held_back: dict[tuple[int, int | None], int] = {}  # (node, rank or None: its agent) -> lines still to keep off
        self._tracebacks: dict[tuple[int, int], Tracebacks] = {}  # (node, rank): its traceback held till whole
        self._labels: dict[int, str] = {}  # node index -> its label, for what close() prints
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)

    def line(self, node: NodeHandle, text: str) -> None:
        for piece in glued_apart(text):
            self._line(node, piece)

    def _line(self, node: NodeHandle, text: str) -> None:
        match = records.rank_tagged(text)
        prefix = f"[{node.label} rank{match[0]}] " if match else f"[{node.label}] "
        body = match[1] if match else text
        rank = match[0] if match else None
        with self._lock:
            self._labels[node.index] = node.label
            took = self._took_record(node.index, rank, prefix, body)
            if took is True:
                return
            if isinstance(took, str):
                body = took  # what the record has shown in place of the lines it announced
            elif self._hidden.get((node.index, body)):  # a cause line its record announced: shown once, at the end
                self._hidden[(node.index, body)] -= 1
                return
            elif self._held_back.get((node.index, rank)):
                self._held_back[(node.index, rank)] -= 1  # an agent's report, a traceback: the node's log has it
                return
            if any(noise in body for noise in NOISE):
                return
            if rank is None or isinstance(took, str):
                self._show(node.index, rank, prefix, body)
                return
            # A rank's own lines that no agent copied (launch ssh, docker): its traceback, one line.
            tracebacks = self._tracebacks.setdefault((node.index, rank), Tracebacks(at_exception=True))
            for record, lines in tracebacks.feed([body], self.clock()):
                shown = ([self._note_exception(node.index, rank, prefix, record)]
                         if isinstance(record, records.Traceback) else lines)
                for text in shown:
                    self._show(node.index, rank, prefix, text)

    def _show(self, index: int, rank: int | None, prefix: str, body: str) -> None:
        """One line to the console (through dedup) and the node's tail; under the lock."""
        self._add_to_tail(index, prefix + body)
        style = STYLES[index % len(STYLES)]
        if self.dedup is None:
            self._print(Released(prefix, style, body))
            return
        for out in self.dedup.add(Source(index, rank, prefix, style), body, self.clock()):
            self._print(out)
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="line dedup", daemon=True)
            self._flusher.start()
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
        """Prints every held line, in order (a traceback never finished: as it
        came); later lines print at once."""
        with self._lock:
            for (index, rank), tracebacks in self._tracebacks.items():
                prefix = f"[{self._labels.get(index, f'node{index}')} rank{rank}] "
                for record, lines in tracebacks.close():
                    shown = ([self._note_exception(index, rank, prefix, record)]
                             if isinstance(record, records.Traceback) else lines)
                    for text in shown:
                        self._show(index, rank, prefix, text)
            self._tracebacks.clear()
            if self.dedup is not None:
                for out in self.dedup.drain():
                    self._print(out)
                self.dedup = None
                self._wake.notify_all()

    def _took_record(self, index: int, rank: int | None, prefix: str, body: str) -> bool | str:
        """Notes the record a framed line holds; False for any other line, and
        for a record this launcher cannot read (shown as it came); the line to
        show for a record that stands for the lines after it (a traceback)."""
        try:
            stamped = records.unframe(body)
        except records.RecordError:
            return False
        if stamped is None:
            return False
        self.on_record(stamped)
        record = stamped.record
        if isinstance(record, records.Stall):
            self.stalled.update((s.rank, s) for s in record.stalled)
        elif isinstance(record, records.Straggler) and record.slow:
            self.stragglers.setdefault(record.rank, record)
        elif isinstance(record, records.NodeLost):
            for lost in self.recovery.node_lost(record, self.clock()):
                self.on_lost(lost)
        elif isinstance(record, records.Reformed):
            self.recovery.trained_again(record, self.clock())
        elif isinstance(record, records.WorkerExit) and index not in self.worker_codes:
            self.worker_codes[index], self.worker_ranks[index] = record.exitcode, record.rank
            if stamped.time is not None:
                self.failed_at[index] = stamped.time
            self._add_to_tail(index, prefix + record.line)
            self._cut[index] = self._tailed[index]
        elif isinstance(record, records.SameError):
            self.same_errors.setdefault(index, record)
        elif isinstance(record, records.Stop):
            self.stopped = record
        elif isinstance(record, records.AgentReport):
            self._held_back[(index, None)] = record.lines
        elif isinstance(record, records.Traceback):
            self._held_back[(index, rank)] = record.lines
            return self._note_exception(index, rank, prefix, record)
        elif isinstance(record, records.Cause):
            self.causes.setdefault(record.line, index)  # shown once, at the end (Supervisor.summary)
            self._hidden[(index, record.line)] = self._hidden.get((index, record.line), 0) + 1
        return True

    def _note_exception(self, index: int, rank: int | None, prefix: str, record: records.Traceback) -> str:
        """A worker's exception, for the summary's cell (launch/supervise/exceptions.py);
        the line the console shows for it (a knock-on says so)."""
        return self.exceptions.note(index, rank, prefix, record, late=index in self.worker_codes)

    def exception(self, index: int) -> RankException | None:
        """The exception that failed node `index` (not a knock-on where it raised one of its own), if any."""
        with self._lock:
            return self.exceptions.of_node(index, self.worker_ranks.get(index))

    def exception_nodes(self) -> tuple[set[int], set[int]]:
        """The nodes with an exception of their own, and those whose every exception was a knock-on."""
        with self._lock:
            return self.exceptions.own(), self.exceptions.knocked_on()

    def _add_to_tail(self, index: int, line: str) -> None:
        self.tails.setdefault(index, deque(maxlen=TAIL_LINES)).append(line)
        self._tailed[index] = self._tailed.get(index, 0) + 1

    def worker_code(self, index: int) -> int | None:
        with self._lock:
            return self.worker_codes.get(index)

    def same_error(self, index: int) -> records.SameError | None:
        """The same error twice, as node `index`'s agent said it (a bug: it stopped restarting)."""
        with self._lock:
            return self.same_errors.get(index)

    def worker_failed_at(self) -> dict[int, float]:
        with self._lock:
            return dict(self.failed_at)

    def forget(self, index: int) -> None:
        """A node that comes back (elastic) starts without its last failure's code."""
        with self._lock:
            self.worker_codes.pop(index, None)
            self.failed_at.pop(index, None)
            self.same_errors.pop(index, None)
            self.worker_ranks.pop(index, None)
            self.exceptions.forget(index)
            self._cut.pop(index, None)
            for key in [key for key in self._held_back if key[0] == index]:
                del self._held_back[key]
            self.recovery.forget(index)

    def cause_lines(self, first: int | None) -> list[str]:
        """Every worker cause line once, the first failed node's last."""
        with self._lock:
            causes = list(self.causes.items())
        return [c for c, n in causes if n != first] + [c for c, n in causes if n == first]

    def stop_record(self) -> records.Stop | None:
        with self._lock:
            return self.stopped

    def stalled_ranks(self) -> list[records.StalledRank]:
        with self._lock:
            return sorted(self.stalled.values(), key=lambda s: s.rank)

    def straggler_ranks(self) -> list[records.Straggler]:
        with self._lock:
            return sorted(self.stragglers.values(), key=lambda s: s.rank)

    def tail(self, node: NodeHandle) -> list[str]:
        """The node's last lines; when its agent reported a failed worker,
        the lines before that and the worker's exit code."""
        with self._lock:
            lines = list(self.tails.get(node.index, ()))
            after = self._tailed.get(node.index, 0) - self._cut.get(node.index, self._tailed.get(node.index, 0))
        return lines[:len(lines) - after]


def glued_apart(text: str) -> list[str]:
    """One read line as the lines its writers meant. Where a worker's output
    shares the agent's stream (launch ssh, docker), an unfinished line (a bar
    without its newline, a process killed mid-line) gets the next writer's
    line glued to it: a record's frame, torch's rank-tagged warning. Each
    starts a line of its own."""
    pieces: list[str] = []
    for part in _split_before(text, records.FRAME):
        tag = records.rank_tagged(part)
        if records.is_frame(tag[1] if tag else part):
            pieces.append(part)
            continue
        drawn = f"{records.RANK_TAG_OPEN}{tag[0]}{records.RANK_TAG_CLOSE}{as_drawn(tag[1])}" if tag else as_drawn(part)
        starts = [0, *records.tag_starts(drawn)]
        pieces += [drawn[a:b] for a, b in zip(starts, [*starts[1:], len(drawn)])]
    return [piece for index, piece in enumerate(pieces) if piece or index == 0]


def _split_before(text: str, marker: str) -> list[str]:
    """`text` cut before each `marker` after its start, except after a bare
    rank tag (torchrun's `[rank0]:` before a record is the record's own)."""
    parts, start = [], 0
    at = text.find(marker, 1)
    while at > 0:
        if not records.is_bare_tag(text[start:at]):
            parts.append(text[start:at])
            start = at
        at = text.find(marker, at + 1)
    return [*parts, text[start:]]


def as_drawn(line: str) -> str:
    """A line redrawn with carriage returns (a progress bar whose output no
    agent copied line by line: launch ssh, docker) as a terminal shows it:
    its last state, not one line per redraw."""
    if "\r" not in line:
        return line
    states = [state for state in line.split("\r") if state.strip()]
    return states[-1] if states else ""


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
