"""One supervisor for every launcher ddpkit controls (local, docker, ssh).

A launcher builds one `NodeHandle` per node (a torchrun agent, a container,
an SSH session) and hands them to `supervise`. Everything else is here and
only here: starting the nodes (their output goes through launch/supervise/nodeoutput.py's
printer), the loop that waits for events, fail-fast (the first node that fails stops every other
node, each given `grace_s` to exit), Ctrl-C / SIGTERM (every node stopped,
given `interrupt_grace_s`: the grace chain's time to checkpoint, spec.grace),
the end-of-run summary table and the exit code.

The loop reads `Event`s from one queue. Nodes post `NodeExited`; anything
else that may end a run (a hang watchdog, say) is an `EventSource` that
posts `StopRequested` with its reason and exit code. An elastic run (an
`ElasticPolicy`: launch ssh, launch local) goes on without a failed node, and
its `Reviver` brings the node back once its host answers, which posts
`NodeReturned`.
docs/ARCHITECTURE.md has the checklist for adding a launcher or a source.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from ...exitcodes import WORKER_CODES, ExitCode
from ...records import LostRank, StalledRank, Straggler
from ...runs import NodeRow, RunFolder, RunSummary
from .dedup import Dedup
from .interrupt import interrupts_raise
from .nodeoutput import LOST, SUMMARY_LINES, LinePrinter, NodeHandle
from .stragglers import straggler_cell

if TYPE_CHECKING:

    from rich.console import Console
    from rich.table import Table

    from ...spec import Elastic

POLL_S = 0.2  # the loop wakes this often so that Ctrl-C gets through
class Status(Enum):
    OK = "ok"
    FAILED_FIRST = "failed first"
    FAILED = "failed"
    STOPPED = "stopped"
    NOT_STARTED = "not started"
    EXCLUDED = "failed, excluded"  # elastic: the job went on without it
    REJOINED = "ok, rejoined"  # elastic: it failed, its host answered again, it joined and finished
    STALLED = "stalled"
    LOST = "lost"  # its ranks sent no heartbeat for watchdog.loss_s: a static job stopped for it


STATUS_STYLE = {Status.LOST: "bold red", Status.OK: "green", Status.FAILED_FIRST: "bold red", Status.FAILED: "red",
                Status.STOPPED: "yellow", Status.NOT_STARTED: "yellow", Status.EXCLUDED: "yellow",
                Status.STALLED: "bold red", Status.REJOINED: "green"}


@dataclass(frozen=True)
class NodeExited:
    node: NodeHandle


@dataclass(frozen=True)
class StopRequested:
    """Posted by an event source: stop every node, end with `code`."""

    reason: str
    code: ExitCode


@dataclass(frozen=True)
class NodeReturned:
    """Posted for a Reviver: a failed node's host answers again; `node` is
    a new handle for the same node index, not started yet."""

    node: NodeHandle


@dataclass(frozen=True)
class NodeLost:
    """The job's watchdog reported node `index` silent (launch/supervise/recovery.py):
    stop what is left of it and treat it as a node that failed."""

    index: int


Event = NodeExited | StopRequested | NodeReturned | NodeLost


class EventSource(Protocol):
    """Something besides the nodes that may end a run (e.g. a hang watchdog)."""

    def start(self, post: Callable[[Event], None]) -> None: ...

    def stop(self) -> None: ...


class Reviver(Protocol):
    """Brings a failed node of an elastic run back (launch ssh, launch local)."""

    def revive(self, node: NodeHandle, cancelled: threading.Event) -> NodeHandle | None:
        """Blocking, on its own thread: clear what `node` left on its host,
        then wait until the host answers again. A new handle for the same
        node, not started; None once `cancelled` is set."""


@dataclass(frozen=True)
class ElasticPolicy:
    """An elastic run's rules (spec.elastic): the job goes on without a failed
    node while min_nodes others remain, and `reviver` brings it back until it
    failed max_node_failures times."""

    min_nodes: int
    max_node_failures: int
    reviver: Reviver

    @classmethod
    def of(cls, elastic: Elastic | None, reviver: Reviver) -> ElasticPolicy | None:
        """None for a static job: its first failed node stops the run."""
        return None if elastic is None else cls(elastic.min_nodes, elastic.max_node_failures, reviver)


@dataclass
class Outcome:
    """How a run ended."""

    first_failure: NodeHandle | None = None
    stop_request: StopRequested | None = None
    interrupted: bool = False
    stopped: set[int] = field(default_factory=set)  # node indexes the supervisor stopped
    excluded: list[NodeHandle] = field(default_factory=list)  # elastic: failed nodes the job went on without
    rejoined: dict[int, list[str]] = field(default_factory=dict)  # node index -> why it failed, each time it came back
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    stalled: list[StalledRank] = field(default_factory=list)  # named by the job's hang watchdog
    stragglers: list[Straggler] = field(default_factory=list)  # named by its straggler judge
    worker_codes: dict[int, int] = field(default_factory=dict)  # node index -> its failed worker's code
    lost: list[LostRank] = field(default_factory=list)  # ranks the job's watchdog found silent (launch/supervise/recovery.py)

    def node_code(self, node: NodeHandle) -> int | None:
        return node_code(node, self.worker_codes.get(node.index))

    @property
    def code(self) -> int:
        if self.interrupted:
            return ExitCode.INTERRUPTED
        if self.stalled:
            return ExitCode.STALLED
        if self.stop_request is not None:
            return self.stop_request.code
        if self.first_failure is not None and any(x.node == self.first_failure.index for x in self.lost):
            return ExitCode.NODE_LOST
        if self.first_failure is not None:
            code = self.node_code(self.first_failure)
            return code if code is not None and code > 0 else ExitCode.FAILED
        return ExitCode.OK


@dataclass(frozen=True)
class RunText:
    """What the summary says that differs between launchers."""

    title: str  # e.g. "launch local"
    interrupted: str  # after Ctrl-C, e.g. "interrupted; stopped all nodes"


class Supervisor:
    """One run of N nodes: start, wait, fail fast, stop, summarise."""

    def __init__(self, nodes: Sequence[NodeHandle], console: Console, grace_s: float,
                 sources: Sequence[EventSource] = (), summary_console: Console | None = None,
                 interrupt_grace_s: float | None = None, elastic: ElasticPolicy | None = None,
                 ranks: int | None = None, dedup: bool = True, run: RunFolder | None = None) -> None:
        # ranks: the job's world size (dedup's "all N ranks"); dedup False: --no-dedup.
        # run: the run folder the events and the summary are recorded in (ddpkit runs).
        # grace_s: after a node failed (fail fast); interrupt_grace_s: after
        # Ctrl-C or SIGTERM, which ask the job to checkpoint (spec.grace).
        self.nodes, self.grace_s = list(nodes), grace_s
        self.interrupt_grace_s = grace_s if interrupt_grace_s is None else interrupt_grace_s
        self.elastic = elastic  # see _excludes and _leave_out; None (a static job): fail fast
        self.failures: Counter[int] = Counter()
        # Nodes whose own exit status reached the loop before anything stopped
        # them: that status is how they failed, even if the job's watchdog
        # reports them silent afterwards (a killed node's ranks stop their
        # heartbeats too). A dropped connection (LOST) is no status: for a
        # silent host the watchdog's report says more (which ranks, how long).
        # By index, until the node rejoins.
        self.failed_on_own: set[int] = set()
        self.stopping_lost: set[int] = set()  # nodes _stop_lost is stopping
        self.away: dict[int, NodeHandle] = {}  # failed nodes being revived, by index
        self._cancel = threading.Event()  # the run ended: stop reviving
        self.console = summary_console or console  # where the summary goes
        self.sources = list(sources)
        self.printer = LinePrinter(console, Dedup(ranks) if dedup else None)
        self.events: queue.Queue[Event] = queue.Queue()
        self.printer.on_lost = lambda index: self.events.put(NodeLost(index))
        self.started: set[int] = set()
        self.run_folder = run

    def note(self, kind: str, detail: str = "", node: int | None = None) -> None:
        """One event in the run folder's events.jsonl; a folder that went
        away (removed by hand) must not stop the run."""
        if self.run_folder is None:
            return
        try:
            self.run_folder.event(kind, detail, node)
        except OSError:
            pass

    def run(self) -> Outcome:
        outcome, began = Outcome(), time.monotonic()
        try:
            with interrupts_raise():
                self._start()
                self._wait(outcome)
        except KeyboardInterrupt:
            outcome.interrupted = True
        finally:
            self._cancel.set()
            for source in self.sources:
                source.stop()
        outcome.excluded += self.away.values()  # their hosts did not come back in time
        if outcome.interrupted or outcome.first_failure is not None or outcome.stop_request is not None:
            self._stop_all(outcome)
        elif outcome.excluded:
            self._stop_excluded(outcome)
        outcome.elapsed_s = time.monotonic() - began
        self.printer.close()  # every node has ended: what is held is printed, before the summary
        outcome.stalled = self.printer.stalled_ranks()
        outcome.stragglers = self.printer.straggler_ranks()
        outcome.lost = sorted((x for x in self.printer.recovery.lost.values() if x.node not in self.failed_on_own),
                              key=lambda x: x.rank)
        self._blame_lost(outcome)
        outcome.worker_codes = {n.index: c for n in self.nodes if (c := self.printer.worker_code(n.index)) is not None}
        self._note_end(outcome)
        return outcome

    def _note_end(self, outcome: Outcome) -> None:
        if outcome.interrupted:
            self.note("interrupted", f"Ctrl-C or SIGTERM: every node stopped with {self.interrupt_grace_s:g} s grace")
        for s in outcome.stalled:
            self.note("stall", s.line, s.node)
        for straggler in outcome.stragglers:
            self.note("straggler", straggler.line, straggler.node)
        for node in self.nodes:
            if outcome.node_code(node) == ExitCode.PREEMPTED:
                self.note("preempted", "its workers checkpointed on the stop signal and exited 75", node.index)

    def _start(self) -> None:
        for source in self.sources:
            source.start(self.events.put)
        for node in self.nodes:
            self.started.add(node.index)
            node.start(self.printer, functools.partial(self.events.put, NodeExited(node)))

    def _wait(self, outcome: Outcome) -> None:
        """Until every node succeeded, one failed, or a source asked to stop."""
        running = {node.index for node in self.nodes}
        while running:
            try:
                event = self.events.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(event, StopRequested):
                outcome.stop_request = event
                self.note("stop", event.reason)
                return
            if isinstance(event, NodeReturned):
                self._rejoin(event.node, outcome)
                running.add(event.node.index)
                continue
            if isinstance(event, NodeLost):
                if event.index in running:
                    self._stop_lost(event.index)
                continue
            running.discard(event.node.index)
            if event.node.exit_code() != 0:
                if event.node.index not in self.stopping_lost and event.node.exit_code() != LOST:
                    self.failed_on_own.add(event.node.index)
                if self._excludes(event.node, outcome):
                    self._leave_out(event.node, outcome)
                    continue
                outcome.first_failure = event.node
                self.note("failed", f"{self.reason(event.node)}: stopping every other node", event.node.index)
                return

    def _stop_lost(self, index: int) -> None:
        """A node the job's watchdog found silent: stopped (TERM, then KILL:
        a frozen process takes only KILL) on a thread of its own, since its
        host may not answer; its exit then goes the way of any failed node's
        (left out in an elastic job, the job stopped in a static one)."""
        node = next(n for n in self.nodes if n.index == index)
        self.stopping_lost.add(index)
        self.note("lost", "no heartbeat (the job's watchdog): stopping what is left of it", index)
        threading.Thread(target=node.stop, args=(self.grace_s,), name=f"stop lost {node.label}", daemon=True).start()

    def _blame_lost(self, outcome: Outcome) -> None:
        """A static job stopped for a lost node: that node failed first,
        whichever exit (a survivor's NODE_LOST) reached the loop first."""
        lost = {x.node for x in outcome.lost}
        if outcome.first_failure is not None and outcome.first_failure.index not in lost:
            outcome.first_failure = next((n for n in self.nodes if n.index in lost), outcome.first_failure)

    def _excludes(self, node: NodeHandle, outcome: Outcome) -> bool:
        """Elastic policy: the job goes on without a failed node while at
        least min_nodes others remain, unless it is node 0 (its agent holds
        the rendezvous store)."""
        if self.elastic is None or node.index == 0:
            return False
        return len(self.nodes) - len(outcome.excluded) - len(self.away) - 1 >= self.elastic.min_nodes

    def _leave_out(self, node: NodeHandle, outcome: Outcome) -> None:
        """Revived while it has failed fewer than max_node_failures times;
        otherwise excluded from the rest of the run."""
        assert self.elastic is not None  # _excludes said yes
        self.failures[node.index] += 1
        if self.failures[node.index] >= self.elastic.max_node_failures:
            outcome.excluded.append(node)
            self.note("excluded", f"{self.reason(node)}: failed {self.failures[node.index]} times", node.index)
            return
        self.note("failed", f"{self.reason(node)}: the job goes on without it until it is back", node.index)
        self.away[node.index] = node
        threading.Thread(target=self._revive, args=(node,), name=f"revive {node.label}", daemon=True).start()

    def _revive(self, node: NodeHandle) -> None:
        assert self.elastic is not None
        new = self.elastic.reviver.revive(node, self._cancel)
        if new is not None:
            self.events.put(NodeReturned(new))

    def _rejoin(self, new: NodeHandle, outcome: Outcome) -> None:
        old = self.away.pop(new.index)
        why = self.reason(old)
        self.printer.forget(new.index)
        self.failed_on_own.discard(new.index)
        self.stopping_lost.discard(new.index)
        outcome.rejoined.setdefault(new.index, []).append(why)
        self.note("restart", f"back after it failed ({why})", new.index)
        self.nodes = [new if n.index == new.index else n for n in self.nodes]
        self.printer.line(new, f"ddpkit: node {new.index} ({new.host}) is back after it failed ({why}): "
                               "its agent is restarted and joins the job at the next rendezvous")
        new.start(self.printer, functools.partial(self.events.put, NodeExited(new)))

    def _stop_excluded(self, outcome: Outcome) -> None:
        """What an excluded node left behind (a cut-off host's trainer) is
        stopped once the others finished; a host still unreachable is a problem
        in the summary."""
        outcome.problems = [p for p in (n.stop(self.grace_s) for n in outcome.excluded) if p]

    def _stop_all(self, outcome: Outcome) -> None:
        """Every node at once, so the whole run takes one grace period."""
        # A node that ended is stopped too: what it left behind may still run.
        outcome.stopped = {n.index for n in self.nodes if n.exit_code() is None}
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(self.nodes)))) as pool:
            grace = self.interrupt_grace_s if outcome.interrupted else self.grace_s
            outcome.problems = [p for p in pool.map(lambda n: n.stop(grace), self.nodes) if p]

    def status(self, node: NodeHandle, outcome: Outcome) -> Status:
        if any(s.node == node.index for s in outcome.stalled):
            return Status.STALLED
        if outcome.stalled and node.index in self.started:
            return Status.STOPPED  # its ranks left because the watchdog stopped the job, not by a fault of theirs
        if node is outcome.first_failure:
            return Status.LOST if any(x.node == node.index for x in outcome.lost) else Status.FAILED_FIRST
        if node in outcome.excluded:
            return Status.EXCLUDED
        if node.index not in self.started:
            return Status.NOT_STARTED
        if node.index in outcome.stopped:
            return Status.STOPPED
        if outcome.node_code(node) != 0:
            return Status.FAILED
        return Status.REJOINED if node.index in outcome.rejoined else Status.OK

    def summary(self, outcome: Outcome, text: RunText) -> RunSummary:
        """The end-of-run table, then one line on how the run ended; the same
        rows and lines are recorded in the run folder's run.json (`ddpkit
        status` shows them again), with the exit code and end state."""
        from rich.text import Text

        self.printer.close()  # (a run interrupted before it began has lines held too)
        first = None if outcome.first_failure is None else outcome.first_failure.index
        record = RunSummary(title=text.title, elapsed_s=outcome.elapsed_s,
                            rows=[self._row(node, outcome) for node in self.nodes],
                            closing=self.closing_line(outcome, text), causes=self.printer.cause_lines(first),
                            problems=list(outcome.problems))
        self.console.print(summary_table(record))
        for problem in record.problems:
            self.console.print(Text(f"teardown problem: {problem}"))
        self.console.print(Text(record.closing, style="bold red" if outcome.code else "green"))
        # The workers' own cause, once, last (every rank printed it; the stream held it back).
        for cause in record.causes:
            self.console.print(Text(cause, style="bold red" if outcome.code else ""), soft_wrap=True)
        if self.run_folder is not None:
            try:
                self.run_folder.finish(outcome.code, record)
            except OSError as exc:  # the run itself is over: say so, keep its exit code
                self.console.print(Text(f"{text.title}: could not record the run's end in {self.run_folder.path}: "
                                        f"{exc}"))
        return record

    def _row(self, node: NodeHandle, outcome: Outcome) -> NodeRow:
        return NodeRow(node=node.index, exit_code=_code_text(outcome.node_code(node)),
                       status=self.status(node, outcome).value, host=node.host,
                       first_failure=self._failure_cell(node, outcome),
                       straggler=straggler_cell(outcome.stragglers, node.index))

    def _failure_cell(self, node: NodeHandle, outcome: Outcome) -> str:
        stalled = [s.line for s in outcome.stalled if s.node == node.index]
        if stalled:
            return "\n".join(["hang watchdog: stalled", *stalled])
        if (not outcome.stalled and node.index in outcome.rejoined and node not in outcome.excluded
                and node is not outcome.first_failure):
            return "\n".join(f"rejoined after: {why}" for why in outcome.rejoined[node.index])
        if outcome.stalled or (node is not outcome.first_failure and node not in outcome.excluded):
            return ""
        return "\n".join([self.reason(node, outcome), *self.printer.tail(node)[-SUMMARY_LINES:]])

    def reason(self, node: NodeHandle, outcome: Outcome | None = None) -> str:
        lost = self.printer.recovery.of_node(node.index)
        if lost is not None and node.index not in self.failed_on_own:
            return lost.reason
        code = node_code(node, self.printer.worker_code(node.index)) if outcome is None else outcome.node_code(node)
        return node.lost_reason() if code == LOST else f"exit status {code}"

    def closing_line(self, outcome: Outcome, text: RunText) -> str:
        if outcome.interrupted:
            return f"{text.title}: {text.interrupted}"
        if outcome.stalled:
            named = "; ".join(f"rank {s.rank} (node {s.node}, {s.host})" for s in outcome.stalled)
            return (f"{text.title}: the hang watchdog found stalled rank(s): {named}; stacks were dumped "
                    f"(see the lines above), every node was stopped, exit {int(ExitCode.STALLED)}")
        if outcome.stop_request is not None:
            return f"{text.title}: {outcome.stop_request.reason}; stopped every node"
        failed = outcome.first_failure
        if failed is None:
            return (f"{text.title}: every node finished" + self._rejoined_text(outcome) + self._excluded_text(outcome)
                    + self.printer.recovery.summary())
        # Both halves are read by scripts and tests: keep their wording.
        return (f"{text.title}: node {failed.index} ({failed.host}) failed first: {self.reason(failed, outcome)}; "
                f"every other node was stopped\n"
                f"{text.title}: node{failed.index} exited with code {outcome.code}; stopped the other nodes")


    def _rejoined_text(self, outcome: Outcome) -> str:
        back = [n for n in self.nodes if n.index in outcome.rejoined and n not in outcome.excluded]
        if not back:
            return ""
        return "; " + ", ".join(f"node {n.index} ({n.host}) rejoined after it failed "
                                f"({'; '.join(outcome.rejoined[n.index])})" for n in back)

    def _excluded_text(self, outcome: Outcome) -> str:
        if not outcome.excluded:
            return ""
        names = ", ".join(f"node {n.index} ({n.host}: {self.reason(n, outcome)})" for n in outcome.excluded)
        return (f" but {names}: excluded after it failed; the job went on with "
                f"{len(self.nodes) - len(outcome.excluded)} of {len(self.nodes)} nodes")


def node_code(node: NodeHandle, worker: int | None) -> int | None:
    """The node's exit code; for a torchrun agent's 1, its failed worker's
    own code when that is one of ddpkit's (exitcodes.WORKER_CODES)."""
    code = node.exit_code()
    return worker if code == ExitCode.FAILED and worker in WORKER_CODES else code


def summary_table(summary: RunSummary) -> Table:
    """The summary's table, from its recorded rows: what the launcher printed
    at the end, and what `ddpkit status` prints again."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{summary.title}: {len(summary.rows)} nodes, {summary.elapsed_s:.1f}s", title_justify="left")
    # "node | exit code | status" first: scripts (and tests) match that run of cells.
    stragglers = any(row.straggler for row in summary.rows)  # the column only when the watchdog named one
    for column in ("node", "exit code", "status", "host", "first failure", *(("straggler",) * stragglers)):
        table.add_column(column, overflow="fold")
    for row in summary.rows:
        style = next((STATUS_STYLE[s] for s in Status if s.value == row.status), "")
        # Text, not markup: log lines hold brackets (our own prefix, for one).
        cells = [Text(f"node{row.node}"), Text(row.exit_code), Text(row.status, style=style), Text(row.host),
                 Text(row.first_failure)]
        table.add_row(*cells, *([Text(row.straggler, style="yellow")] * stragglers))
    return table


def _code_text(code: int | None) -> str:
    if code is None:
        return "-"
    return "lost" if code == LOST else str(code)


def supervise(nodes: Sequence[NodeHandle], console: Console, grace_s: float, text: RunText,
              sources: Sequence[EventSource] = (), interrupt_grace_s: float | None = None,
              ranks: int | None = None, dedup: bool = True, run: RunFolder | None = None) -> int:
    """Run the nodes to the end, print the summary, return the exit code."""
    supervisor = Supervisor(nodes, console, grace_s, sources, interrupt_grace_s=interrupt_grace_s,
                            ranks=ranks, dedup=dedup, run=run)
    outcome = supervisor.run()
    supervisor.summary(outcome, text)
    return outcome.code
