"""One supervisor for every launcher ddpkit controls (local, docker, ssh).

A launcher builds one `NodeHandle` per node (a torchrun agent, a container,
an SSH session) and hands them to a `Supervisor`. Everything else is here and
only here: starting the nodes (their output goes through launch/supervise/nodeoutput.py's
printer, and what its records say is kept in the run's `Findings`, launch/supervise/findings.py,
which the summary reads), the loop that waits for events, fail-fast (the first node that fails stops every other
node, each given `grace_s` to exit), Ctrl-C / SIGTERM (every node stopped,
given `interrupt_grace_s`: the grace chain's time to checkpoint, spec.grace),
the end-of-run summary table and the exit code.

The loop reads `Event`s from one queue (launch/supervise/events.py). Nodes
post `NodeExited`; anything else that may end a run (a hang watchdog, say) is
an `EventSource` that posts `StopRequested` with its reason and exit code. An
elastic run (an `ElasticPolicy`: launch ssh, launch local) goes on without a
failed node, and its `Reviver` brings the node back once its host answers,
which posts `NodeReturned`. Each node's state is one `NodeTrack`
(launch/supervise/nodestate.py), moved only along its allowed transitions;
the summary's words are launch/supervise/summary.py's.
docs/EXTENDING.md has the checklist for adding a launcher.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ...runs import NodeRow, RunFolder, RunSummary
from ...shared.exitcodes import ExitCode
from .dedup import Dedup
from .events import ElasticPolicy, Event, EventSource, NodeExited, NodeReportedLost, NodeReturned, StopRequested
from .findings import Findings
from .interrupt import interrupts_raise
from .metricsink import MetricsSink
from .nodeoutput import NO_EXIT_STATUS, SUMMARY_LINES, LinePrinter, NodeHandle
from .nodestate import NodeState, NodeTrack
from .outcome import Outcome, node_code
from .stragglers import straggler_cell
from .summary import RunText, checkpoint_text, closing_line, code_text, status_text, summary_table

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

POLL_S = 0.2  # the loop wakes this often so that Ctrl-C gets through


class Supervisor:
    """One run of N nodes: start, wait, fail fast, stop, summarise."""

    def __init__(self, nodes: Sequence[NodeHandle], console: Console, grace_s: float,
                 sources: Sequence[EventSource] = (), summary_console: Console | None = None,
                 interrupt_grace_s: float | None = None, elastic: ElasticPolicy | None = None,
                 ranks: int | None = None, dedup: bool = True, run: RunFolder | None = None,
                 metrics: Path | None = None) -> None:
        # ranks: the job's world size (dedup's "all N ranks"); dedup False: --no-dedup.
        # run: the run folder the events and the summary are recorded in (ddpkit runs).
        # metrics: where the metrics records the job frames on its output are appended (metricsink.py).
        # grace_s: after a node failed (fail fast); interrupt_grace_s: after
        # Ctrl-C or SIGTERM, which ask the job to checkpoint (spec.grace).
        self.grace_s = grace_s
        self.interrupt_grace_s = grace_s if interrupt_grace_s is None else interrupt_grace_s
        self.elastic = elastic  # see _excludes and _leave_out; None (a static job): fail fast
        self.tracks: dict[int, NodeTrack] = {}  # by node index: each node's one state
        self.set_nodes(nodes)
        self._cancel = threading.Event()  # the run ended: stop reviving
        self.console = summary_console or console  # where the summary goes
        self.sources = list(sources)
        self.findings = Findings()  # what the job's output said: failures, reports, last lines
        self.printer = LinePrinter(console, Dedup(ranks) if dedup else None, findings=self.findings)
        self.events: queue.Queue[Event] = queue.Queue()
        self.printer.on_lost = lambda index: self.events.put(NodeReportedLost(index))
        if metrics is not None:
            self.printer.on_record = MetricsSink(metrics, self._warn)
        self.run_folder = run

    @property
    def nodes(self) -> list[NodeHandle]:
        """Every node's current handle (a revived node's is new), by index."""
        return [t.node for t in self.tracks.values()]

    def set_nodes(self, nodes: Sequence[NodeHandle]) -> None:
        """The run's nodes, none started yet (launch docker has them only
        once its containers are made)."""
        self.tracks = {n.index: NodeTrack(n) for n in nodes}

    def note(self, kind: str, detail: str = "", node: int | None = None) -> None:
        """One event in the run folder's events.jsonl; a folder that went
        away (removed by hand) must not stop the run."""
        if self.run_folder is None:
            return
        try:
            self.run_folder.event(kind, detail, node)
        except OSError:
            pass

    def _warn(self, line: str) -> None:
        from rich.text import Text

        self.console.print(Text(f"ddpkit: {line}"))

    def outcome(self, interrupted: bool = False) -> Outcome:
        """A fresh outcome over every node's track."""
        return Outcome(nodes=list(self.tracks.values()), interrupted=interrupted)

    def run(self) -> Outcome:
        outcome, began = self.outcome(), time.monotonic()
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
        for track in sorted(self._in(NodeState.AWAY), key=lambda t: t.moved):
            track.move(NodeState.EXCLUDED)  # its host did not come back in time
        if outcome.interrupted or outcome.first_failure is not None or outcome.stop_request is not None:
            self._stop_all(outcome)
        elif outcome.excluded:
            self._stop_excluded(outcome)
        outcome.elapsed_s = time.monotonic() - began
        self.printer.close()  # every node has ended: what is held is printed, before the summary
        read_first = outcome.first_failure
        self._read_findings(outcome)
        self._note_end(outcome, read_first)
        return outcome

    def _read_findings(self, outcome: Outcome) -> None:
        """What the job's output said, onto the outcome: the watchdog's reports,
        the stop record, the workers' failures; and who failed first by them."""
        findings = self.findings
        outcome.stalled = findings.stalled_ranks()
        outcome.stragglers = findings.straggler_ranks()
        outcome.stopped_at = findings.stop_record()
        outcome.lost = sorted((x for x in findings.recovery.lost.values() if not self._own_exit(x.node)),
                              key=lambda x: x.rank)
        outcome.blame_earliest(findings.worker_failed_at())
        outcome.blame_own_error(*findings.exception_nodes())
        outcome.blame_lost()
        outcome.worker_codes = {n.index: c for n in self.nodes if (c := findings.worker_code(n.index)) is not None}

    def _in(self, *states: NodeState) -> list[NodeTrack]:
        return [t for t in self.tracks.values() if t.state in states]

    def _own_exit(self, index: int) -> bool:
        """Node `index` failed by its own exit status (NodeTrack.own_exit);
        False for an index the run has no node of (a garbled report)."""
        track = self.tracks.get(index)
        return track is not None and track.own_exit

    def _note_end(self, outcome: Outcome, read_first: NodeHandle | None) -> None:
        """The run's end in its events; `read_first`: the node whose exit the loop read first."""
        first = outcome.first_failure
        if first is not None and read_first is not None and first.index != read_first.index:
            # The events said that node's exit stopped the run; the summary blames this one: say why.
            self.note("failed first", f"{self.reason(first, outcome)}: its worker failed before node "
                                      f"{read_first.index}'s, whose exit reached the launcher first", first.index)
        if outcome.interrupted:
            self.note("interrupted", f"Ctrl-C or SIGTERM: every node stopped with {self.interrupt_grace_s:g} s grace; "
                                     f"{checkpoint_text(outcome.stopped_at)}")
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
        for track in self.tracks.values():
            track.move(NodeState.RUNNING)
            track.node.start(self.printer, functools.partial(self.events.put, NodeExited(track.node)))

    def _wait(self, outcome: Outcome) -> None:
        """Until every node succeeded, one failed, or a source asked to stop."""
        while any(t.state.live for t in self.tracks.values()):
            try:
                event = self.events.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(event, StopRequested):
                outcome.stop_request = event
                self.note("stop", event.reason)
                return
            if isinstance(event, NodeReturned):
                self._rejoin(event.node)
                continue
            if isinstance(event, NodeReportedLost):
                lost = self.tracks.get(event.index)
                if lost is not None and lost.state is NodeState.RUNNING:
                    self._stop_lost(lost)
                continue
            track = self.tracks[event.node.index]
            # (a handle tells its exit once; a second word of it, or of a replaced handle, changes nothing)
            if track.node is event.node and track.state.live and self._exited(track, outcome):
                return

    def _exited(self, track: NodeTrack, outcome: Outcome) -> bool:
        """A node's exit read by the loop; True when it ends the run."""
        code = track.node.exit_code()
        if code == 0:
            track.move(NodeState.FINISHED)
            return False
        track.own_exit = track.state is NodeState.RUNNING and code != NO_EXIT_STATUS
        # The same error twice (an agent's verdict: a bug) ends the run, from that node; bringing a node back
        # would repeat it. Another node's agent may end first (the rendezvous it closed): it is not revived.
        bug = self._same_error_node()
        if bug is not None and bug is not track and code != ExitCode.SAME_ERROR:
            track.move(NodeState.FAILED)
            self.note("failed", f"{self.reason(track.node)}: another node's agent saw the same error twice",
                      track.index)
            return False
        if code != ExitCode.SAME_ERROR and self._excludes(track):
            self._leave_out(track)
            return False
        track.move(NodeState.FAILED)
        outcome.first_failure = track.node
        self.note("failed", f"{self.reason(track.node)}: stopping every other node", track.index)
        return True

    def _same_error_node(self) -> NodeTrack | None:
        """The running node whose agent said it saw the same error twice, if one did."""
        return next((t for t in self.tracks.values()
                     if t.state is NodeState.RUNNING and self.findings.same_error(t.index) is not None), None)

    def _stop_lost(self, track: NodeTrack) -> None:
        """A node the job's watchdog found silent: stopped (TERM, then KILL:
        a frozen process takes only KILL) on a thread of its own, since its
        host may not answer; its exit then goes the way of any failed node's
        (left out in an elastic job, the job stopped in a static one)."""
        track.move(NodeState.STOPPING_LOST)
        self.note("lost", "no heartbeat (the job's watchdog): stopping what is left of it", track.index)
        node = track.node
        threading.Thread(target=node.stop, args=(self.grace_s,), name=f"stop lost {node.label}", daemon=True).start()

    def _excludes(self, track: NodeTrack) -> bool:
        """Elastic policy: the job goes on without a failed node while another
        node still runs and at least min_nodes can be in it: the others not
        excluded for good, counting those being brought back, and this one if
        it is brought back too (two nodes lost at once both come back; the
        survivors wait for them in the rendezvous, at most its timeout_s).
        Never where it is node 0 and its agent holds the rendezvous store (the
        launcher holds it where `any_node`)."""
        if self.elastic is None or (track.index == 0 and not self.elastic.any_node):
            return False
        others = [t for t in self.tracks.values() if t is not track]
        if all(t.state in (NodeState.AWAY, NodeState.EXCLUDED) for t in others):
            return False  # nobody left to carry the job on
        can_be_in = sum(t.state is not NodeState.EXCLUDED for t in others) + self._revives(track)
        return can_be_in >= self.elastic.min_nodes

    def _revives(self, track: NodeTrack) -> bool:
        """A failed node is brought back while it failed fewer than max_node_failures times."""
        assert self.elastic is not None
        return track.failures + 1 < self.elastic.max_node_failures  # its earlier failures, and this one

    def _leave_out(self, track: NodeTrack) -> None:
        """Revived while it has failed fewer than max_node_failures times;
        otherwise excluded from the rest of the run."""
        assert self.elastic is not None  # _excludes said yes
        node = track.node
        if not self._revives(track):
            track.move(NodeState.EXCLUDED)
            self.note("excluded", f"{self.reason(node)}: failed {track.failures} times", node.index)
            return
        self.note("failed", f"{self.reason(node)}: the job goes on without it until it is back", node.index)
        track.move(NodeState.AWAY)
        threading.Thread(target=self._revive, args=(node,), name=f"revive {node.label}", daemon=True).start()

    def _revive(self, node: NodeHandle) -> None:
        assert self.elastic is not None
        new = self.elastic.reviver.revive(node, self._cancel)
        if new is not None:
            self.events.put(NodeReturned(new))

    def _rejoin(self, new: NodeHandle) -> None:
        track = self.tracks[new.index]
        why = self.reason(track.node)
        self.printer.forget(new.index)
        track.rejoin(new, why)
        self.note("restart", f"back after it failed ({why})", new.index)
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
        for track in [t for t in self.tracks.values() if t.state.live]:
            code = track.node.exit_code()  # an exit the loop had not read yet is how it ended
            track.move(NodeState.STOPPED if code is None else NodeState.FINISHED if code == 0 else NodeState.FAILED)
        # A node that ended is stopped too: what it left behind may still run.
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(self.tracks)))) as pool:
            grace = self.interrupt_grace_s if outcome.interrupted else self.grace_s
            outcome.problems = [p for p in pool.map(lambda n: n.stop(grace), self.nodes) if p]

    def summary(self, outcome: Outcome, text: RunText) -> RunSummary:
        """The end-of-run table, then one line on how the run ended; the same
        rows and lines are recorded in the run folder's run.json (`ddpkit
        status` shows them again), with the exit code and end state."""
        from rich.text import Text

        self.printer.close()  # (a run interrupted before it began has lines held too)
        first = None if outcome.first_failure is None else outcome.first_failure.index
        record = RunSummary(title=text.title, elapsed_s=outcome.elapsed_s,
                            rows=[self._row(node, outcome) for node in self.nodes],
                            closing=self.closing_line(outcome, text), causes=self.findings.cause_lines(first),
                            problems=list(outcome.problems))
        self.console.print(summary_table(record))
        for problem in record.problems:
            self.console.print(Text(f"teardown problem: {problem}"))
        # One line whatever its length (a stalled rank's call, a long exception): a terminal wraps it
        # for the eye, and a log or pipe keeps it whole for grep and for whoever reads the last line.
        self.console.print(Text(record.closing, style="bold red" if outcome.code else "green"), soft_wrap=True)
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
        return NodeRow(node=node.index, exit_code=code_text(outcome.node_code(node)),
                       status=status_text(node, outcome), host=node.host,
                       first_failure=self._failure_cell(node, outcome),
                       straggler=straggler_cell(outcome.stragglers, node.index))

    def _failure_cell(self, node: NodeHandle, outcome: Outcome) -> str:
        track = outcome.track(node)
        excluded = track.state is NodeState.EXCLUDED
        stalled = [s.line for s in outcome.stalled if s.node == node.index]
        if stalled:
            return "\n".join(["hang watchdog: stalled", *stalled])
        if not outcome.stalled and track.rejoined_after and not excluded and node is not outcome.first_failure:
            return "\n".join(f"rejoined after: {why}" for why in track.rejoined_after)
        if outcome.stalled or (node is not outcome.first_failure and not excluded):
            return ""
        exception = self.findings.exception(node.index)
        if exception is not None:  # its cause, not the warnings printed before it
            at = [f"at {exception.at}"] if exception.at else []
            return "\n".join([self.reason(node, outcome), exception.line, *at, f"its traceback: {self._log_of(node)}"])
        return "\n".join([self.reason(node, outcome), *self.findings.tail(node.index)[-SUMMARY_LINES:]])

    def _log_of(self, node: NodeHandle) -> str:
        """Where the node's whole output is: its log in the run's record, else "the node's log"."""
        try:
            logs = [] if self.run_folder is None else self.run_folder.record().logs
        except (OSError, ValueError):
            logs = []
        return next((log.path for log in logs if log.node == node.index), "the node's log")

    def reason(self, node: NodeHandle, outcome: Outcome | None = None) -> str:
        lost = self.findings.recovery.of_node(node.index)
        if lost is not None and not self._own_exit(node.index):
            return lost.reason
        code = node_code(node, self.findings.worker_code(node.index)) if outcome is None else outcome.node_code(node)
        same = self.findings.same_error(node.index)
        if same is not None and code in (ExitCode.SAME_ERROR, ExitCode.FAILED):
            return same.verdict
        return node.no_status_reason() if code == NO_EXIT_STATUS else f"exit status {code}"

    def closing_line(self, outcome: Outcome, text: RunText) -> str:
        return closing_line(outcome, text, lambda node: self.reason(node, outcome), self.findings.recovery.summary())
