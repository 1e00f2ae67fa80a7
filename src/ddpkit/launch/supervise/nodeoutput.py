"""A node of a run, whatever carries it (`NodeHandle`: a torchrun agent, a
container, an SSH session), and the printer of every node's output
(`LinePrinter`): one prefix per line, torchrun's worker prefix parsed back,
lines several ranks print at once shown once, and what the summary needs
from the output (each node's last lines, its failed worker's code, the
watchdog's stall, straggler and lost-node lines, the workers' cause lines).
The supervisor (launch/supervise/supervisor.py) owns the run; this module only reads."""

from __future__ import annotations

import argparse
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .dedup import Dedup, Released, Source
from .recovery import Recovery
from .stragglers import NamedStraggler

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

LOST = -1  # a node that ended without an exit status (a dropped connection, a removed container)

STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
TAIL_LINES = 100  # kept per node for the summary: torchrun's own failure report alone is ~35
SUMMARY_LINES = 5  # of those, shown in the summary's "first failure" cell
# What torchrun puts before each worker line (launchers pass this template,
# see TORCHRUN_PREFIX_FLAG): the global rank, parsed back into ddpkit's prefix.
TORCHRUN_PREFIX_FLAG = "--log-line-prefix-template=[rank${rank}]:"
_TORCHRUN_PREFIX = re.compile(r"^\[rank(\d+)\]:")
# The first line of torchrun's report on a failed worker, with the worker's
# exit code (the agent itself exits 1); the traceback and the ChildFailedError
# box after it say nothing the worker's own lines do not: they go to the node's
# log, not the console.
_TORCHRUN_FAILED = re.compile(r"torch/distributed/elastic/multiprocessing/api\.py:\d+\] failed \(exitcode: (-?\d+)\)")
_TRACEBACK = "Traceback (most recent call last):"
_BOX_RULE = re.compile(r"^={20,}\s*$")  # the ChildFailedError box opens and closes with one
# A ddpkit.train worker's one-line cause (train/main.py, train/startup/netcheck.py):
# every rank prints the same agreed line; the console shows it once, last.
CAUSE_PREFIX = "ddpkit train: "
# The hang watchdog's report names each stalled rank on one line (train/watchdog/stall.py STALL_LINE).
_STALL = re.compile(r"ddpkit watchdog: STALL rank (\d+) node (\d+) host (\S+) pid \d+: (.*)$")


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
        """None while running; then its exit code (128+N for signal N), or LOST."""

    def lost_reason(self) -> str:
        """Why a node ended with LOST (one line)."""

    def stop(self, grace_s: float) -> str | None:
        """Stop it and everything it started: TERM, KILL after `grace_s`.
        Safe on a node that has ended or never started. Returns a problem, if any."""


@dataclass(frozen=True)
class StalledRank:
    """One rank the job's hang watchdog named (from its report line)."""

    rank: int
    node: int
    host: str
    detail: str  # "step 12, phase forward, at model.py:30 in forward"

    @property
    def line(self) -> str:
        return f"rank {self.rank} ({self.host}): {self.detail}"


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
        self.stalled: dict[int, StalledRank] = {}  # by rank: what the watchdog's report said
        self.stragglers: dict[int, NamedStraggler] = {}  # by rank: the first time the watchdog named it
        self.worker_codes: dict[int, int] = {}  # by node index: the first failed worker's code (torchrun's report)
        self.causes: dict[str, int] = {}  # each worker cause line (CAUSE_PREFIX), once, with its first node
        self.recovery = Recovery()  # the watchdog's lost-node report, and when the others trained again
        self.on_lost: Callable[[int], None] = lambda _node: None  # called with a node newly reported lost
        self._in_box: dict[int, int] = {}  # node index -> box rules seen, while torchrun's traceback is held back
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)

    def line(self, node: NodeHandle, text: str) -> None:
        match = _TORCHRUN_PREFIX.match(text)
        prefix = f"[{node.label} rank{match.group(1)}] " if match else f"[{node.label}] "
        body = text[match.end():] if match else text
        stall = _STALL.search(body) if "ddpkit watchdog: STALL" in body else None
        straggler = NamedStraggler.parse(body)
        with self._lock:
            if straggler:
                self.stragglers.setdefault(straggler.rank, straggler)
            if stall:
                rank = int(stall.group(1))
                self.stalled[rank] = StalledRank(rank, int(stall.group(2)), stall.group(3), stall.group(4))
            lost = self.recovery.read(body, self.clock())
            if lost is not None:
                self.on_lost(lost)
            if body.startswith(CAUSE_PREFIX):  # a worker's (torchrun's agent never says it), prefixed or not
                self.causes.setdefault(body, node.index)  # shown once, at the end (Supervisor.summary)
                return
            if not match and self._torchrun_report(node.index, body):
                return
            self.tails.setdefault(node.index, deque(maxlen=TAIL_LINES)).append(prefix + body)
            style = STYLES[node.index % len(STYLES)]
            if self.dedup is None:
                self._print(Released(prefix, style, body))
                return
            of = int(match.group(1)) if match else None
            for out in self.dedup.add(Source(node.index, of, prefix, style), body, self.clock()):
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
        """Prints every held line, in order; later lines print at once."""
        with self._lock:
            if self.dedup is not None:
                for out in self.dedup.drain():
                    self._print(out)
                self.dedup = None
                self._wake.notify_all()

    def _torchrun_report(self, index: int, body: str) -> bool:
        """Notes the worker's code from torchrun's report on a failed worker;
        True for a line of the traceback and ChildFailedError box that follow it."""
        failed = _TORCHRUN_FAILED.search(body)
        if failed:
            self.worker_codes.setdefault(index, int(failed.group(1)))
            return False
        if index not in self._in_box:
            if index in self.worker_codes and body.strip() == _TRACEBACK:
                self._in_box[index] = 0
                return True
            return False
        if _BOX_RULE.match(body):
            self._in_box[index] += 1
            if self._in_box[index] == 2:
                del self._in_box[index]  # the box's closing rule: what follows is shown again
        return True

    def worker_code(self, index: int) -> int | None:
        with self._lock:
            return self.worker_codes.get(index)

    def forget(self, index: int) -> None:
        """A node that comes back (elastic) starts without its last failure's code."""
        with self._lock:
            self.worker_codes.pop(index, None)
            self._in_box.pop(index, None)
            self.recovery.forget(index)

    def cause_lines(self, first: int | None) -> list[str]:
        """Every worker cause line once, the first failed node's last."""
        with self._lock:
            causes = list(self.causes.items())
        return [c for c, n in causes if n != first] + [c for c, n in causes if n == first]

    def stalled_ranks(self) -> list[StalledRank]:
        with self._lock:
            return sorted(self.stalled.values(), key=lambda s: s.rank)

    def straggler_ranks(self) -> list[NamedStraggler]:
        with self._lock:
            return sorted(self.stragglers.values(), key=lambda s: s.rank)

    def tail(self, node: NodeHandle) -> list[str]:
        """The node's last lines; when torchrun reported a failed worker,
        the worker's last lines and the report's first line."""
        with self._lock:
            lines = list(self.tails.get(node.index, ()))
        for at in range(len(lines) - 1, -1, -1):
            if _TORCHRUN_FAILED.search(lines[at]):
                return lines[:at + 1]
        return lines


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
