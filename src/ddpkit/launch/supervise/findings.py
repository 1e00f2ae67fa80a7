"""What a run's output said, kept as data for the supervisor's summary, as
torch elastic's `RunResult.failures` keeps its workers' failures: each node's
first failed worker (`WorkerFailure`, its agent's `worker_exit` record), the
job's watchdog's stall, straggler and lost-node reports and an elastic job
training again (launch/supervise/recovery.py), the same error twice, the stop
record, every worker's exception (launch/supervise/exceptions.py) and cause
line, and each node's last lines (`Tails`).

`Findings` takes each record the reader decoded (`RecordRead`,
launch/supervise/reader.py) and each line the console showed, from the
LinePrinter's threads; the supervisor (launch/supervise/supervisor.py) reads
it, and a node newly reported lost reaches the supervisor's loop as its
`NodeReportedLost` event (launch/supervise/events.py)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ... import records
from .exceptions import Exceptions, RankException
from .reads import RecordRead
from .recovery import Recovery

TAIL_LINES = 100  # kept per node for the summary: torchrun's own failure report alone is ~35


@dataclass(frozen=True)
class WorkerFailure:
    """A node's first failed worker, as its agent's `worker_exit` record said it."""

    node: int
    rank: int | None
    exitcode: int
    time: float | None  # when it failed, on that node's clock (None: the record did not say)


@dataclass(frozen=True)
class Taken:
    """What a record asks of its reader beside being kept: the line the console
    shows in its place (a traceback's exception), the nodes newly reported lost."""

    shown: str | None = None
    lost: tuple[int, ...] = ()


class Tails:
    """Each node's last lines as the console showed them, and where its
    agent reported a failed worker (the summary's cell stops there)."""

    def __init__(self) -> None:
        self._lines: dict[int, deque[str]] = {}
        self._count: dict[int, int] = {}  # node index -> lines it ever added
        self._cut: dict[int, int] = {}  # node index -> its count when its agent reported a failed worker

    def add(self, node: int, line: str) -> None:
        self._lines.setdefault(node, deque(maxlen=TAIL_LINES)).append(line)
        self._count[node] = self._count.get(node, 0) + 1

    def cut(self, node: int, line: str) -> None:
        """`line` (the failed worker's) ends what the summary shows of the node."""
        self.add(node, line)
        self._cut[node] = self._count[node]

    def uncut(self, node: int) -> None:
        self._cut.pop(node, None)

    def of(self, node: int) -> list[str]:
        lines = list(self._lines.get(node, ()))
        count = self._count.get(node, 0)
        return lines[:len(lines) - (count - self._cut.get(node, count))]


class Findings:
    """Everything the summary reads of a run's output; thread-safe."""

    def __init__(self) -> None:
        self.failures: dict[int, WorkerFailure] = {}  # by node index: its first failed worker
        self.stalled: dict[int, records.StalledRank] = {}  # by rank: what the watchdog's report said
        self.stragglers: dict[int, records.Straggler] = {}  # by rank: the first time the watchdog named it
        self.same_errors: dict[int, records.SameError] = {}  # by node index: its agent saw the same error twice
        self.exceptions = Exceptions()  # every worker's exception, from its traceback record
        self.stopped: records.Stop | None = None  # the job's last stop record: it checkpointed on a stop signal, or not
        self.causes: dict[str, int] = {}  # each worker's cause line (its `cause` record), once, with its first node
        self.recovery = Recovery()  # the watchdog's lost-node report, and when the others trained again
        self.tails = Tails()
        self._lock = threading.Lock()

    def take(self, read: RecordRead, now: float) -> Taken:
        """Keeps what record `read` says; `now`: the clock's time (a lost node's silence, a recovery)."""
        take = _TAKES.get(type(read.record))
        with self._lock:
            return Taken() if take is None else take(self, read, now)

    def shown(self, node: int, line: str) -> None:
        """A line the console showed of node `node` (with its prefix)."""
        with self._lock:
            self.tails.add(node, line)

    def _stall(self, read: RecordRead, _now: float) -> Taken:
        assert isinstance(read.record, records.Stall)
        self.stalled.update((s.rank, s) for s in read.record.stalled)
        return Taken()

    def _straggler(self, read: RecordRead, _now: float) -> Taken:
        assert isinstance(read.record, records.Straggler)
        if read.record.slow:
            self.stragglers.setdefault(read.record.rank, read.record)
        return Taken()

    def _lost(self, read: RecordRead, now: float) -> Taken:
        assert isinstance(read.record, records.NodeLost)
        return Taken(lost=tuple(self.recovery.node_lost(read.record, now)))

    def _reformed(self, read: RecordRead, now: float) -> Taken:
        assert isinstance(read.record, records.Reformed)
        self.recovery.trained_again(read.record, now)
        return Taken()

    def _worker_exit(self, read: RecordRead, _now: float) -> Taken:
        record = read.record
        assert isinstance(record, records.WorkerExit)
        if read.node not in self.failures:
            self.failures[read.node] = WorkerFailure(read.node, record.rank, record.exitcode, read.time)
            self.tails.cut(read.node, read.prefix + record.line)
        return Taken()

    def _same_error(self, read: RecordRead, _now: float) -> Taken:
        assert isinstance(read.record, records.SameError)
        self.same_errors.setdefault(read.node, read.record)
        return Taken()

    def _stop(self, read: RecordRead, _now: float) -> Taken:
        assert isinstance(read.record, records.Stop)
        self.stopped = read.record
        return Taken()

    def _traceback(self, read: RecordRead, _now: float) -> Taken:
        """A worker's exception, for the summary's cell (launch/supervise/exceptions.py);
        the console shows its line (a knock-on says so) in place of the traceback."""
        assert isinstance(read.record, records.Traceback)
        late = read.node in self.failures
        return Taken(shown=self.exceptions.note(read.node, read.rank, read.prefix, read.record, late=late))

    def _cause(self, read: RecordRead, _now: float) -> Taken:
        assert isinstance(read.record, records.Cause)
        self.causes.setdefault(read.record.line, read.node)  # shown once, at the end (Supervisor.summary)
        return Taken()

    # ---- what the supervisor reads ----

    def worker_code(self, node: int) -> int | None:
        with self._lock:
            failure = self.failures.get(node)
        return None if failure is None else failure.exitcode

    def worker_failed_at(self) -> dict[int, float]:
        """Node index -> when its first worker failed, on that node's clock (where its record said)."""
        with self._lock:
            return {n: f.time for n, f in self.failures.items() if f.time is not None}

    def same_error(self, node: int) -> records.SameError | None:
        """The same error twice, as node `node`'s agent said it (a bug: it stopped restarting)."""
        with self._lock:
            return self.same_errors.get(node)

    def exception(self, node: int) -> RankException | None:
        """The exception that failed node `node` (not a knock-on where it raised one of its own), if any."""
        with self._lock:
            failure = self.failures.get(node)
            return self.exceptions.of_node(node, None if failure is None else failure.rank)

    def exception_nodes(self) -> tuple[set[int], set[int]]:
        """The nodes with an exception of their own, and those whose every exception was a knock-on."""
        with self._lock:
            return self.exceptions.own(), self.exceptions.knocked_on()

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

    def tail(self, node: int) -> list[str]:
        """The node's last lines; when its agent reported a failed worker,
        the lines before that and the worker's exit code."""
        with self._lock:
            return self.tails.of(node)

    def forget(self, node: int) -> None:
        """A node that comes back (elastic) starts without its last failure."""
        with self._lock:
            self.failures.pop(node, None)
            self.same_errors.pop(node, None)
            self.exceptions.forget(node)
            self.tails.uncut(node)
            self.recovery.forget(node)


# Each record the summary reads, and what keeps it (an agent's report announces lines only: the reader's).
_TAKES: dict[type[records.Record], Callable[[Findings, RecordRead, float], Taken]] = {
    records.Stall: Findings._stall, records.Straggler: Findings._straggler, records.NodeLost: Findings._lost,
    records.Reformed: Findings._reformed, records.WorkerExit: Findings._worker_exit,
    records.SameError: Findings._same_error, records.Stop: Findings._stop, records.Traceback: Findings._traceback,
    records.Cause: Findings._cause,
}
