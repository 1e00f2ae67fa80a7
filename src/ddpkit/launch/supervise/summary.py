"""The words of a supervised run's end: each node's status in the summary
table (`node_status`, from its track and the run's outcome), the closing line,
and the table itself (`summary_table`, from the recorded rows, which `ddpkit
status` prints again)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from ...runs import NO_EXIT_STATUS_CELL
from ...shared.exitcodes import ExitCode
from .nodeoutput import NO_EXIT_STATUS
from .nodestate import NodeState

if TYPE_CHECKING:
    from rich.table import Table

    from ...records import Stop
    from ...runs import RunSummary
    from .nodeoutput import NodeHandle
    from .outcome import Outcome


class SummaryStatus(Enum):
    OK = "ok"
    FAILED_FIRST = "failed first"
    FAILED = "failed"
    STOPPED = "stopped"
    NOT_STARTED = "not started"
    EXCLUDED = "failed, excluded"  # elastic: the job went on without it
    REJOINED = "ok, rejoined"  # elastic: it failed, its host answered again, it joined and finished
    STALLED = "stalled"
    LOST = "lost"  # its ranks sent no heartbeat for watchdog.loss_s: a static job stopped for it


_S = SummaryStatus
STATUS_STYLE = {_S.LOST: "bold red", _S.OK: "green", _S.FAILED_FIRST: "bold red", _S.FAILED: "red",
                _S.STOPPED: "yellow", _S.NOT_STARTED: "yellow", _S.EXCLUDED: "yellow",
                _S.STALLED: "bold red", _S.REJOINED: "green"}

# The node states that name the status themselves (once a stall or the first failure has not).
STATE_STATUS = {NodeState.EXCLUDED: SummaryStatus.EXCLUDED, NodeState.NOT_STARTED: SummaryStatus.NOT_STARTED,
                NodeState.STOPPED: SummaryStatus.STOPPED}


@dataclass(frozen=True)
class RunText:
    """What the summary says that differs between launchers."""

    title: str  # e.g. "launch local"
    interrupted: str  # after Ctrl-C, e.g. "interrupted; stopped all nodes"


def node_status(node: NodeHandle, outcome: Outcome) -> SummaryStatus:
    """The status column of `node` (by its index) at the run's end."""
    track = outcome.track(node)
    if any(s.node == node.index for s in outcome.stalled):
        return SummaryStatus.STALLED
    if outcome.stalled and track.state is not NodeState.NOT_STARTED:
        return SummaryStatus.STOPPED  # its ranks left because the watchdog stopped the job, not by a fault of theirs
    if node is outcome.first_failure:
        return SummaryStatus.LOST if any(x.node == node.index for x in outcome.lost) else SummaryStatus.FAILED_FIRST
    if outcome.first_failure is not None and node.index in outcome.knocked_on:
        return SummaryStatus.STOPPED  # its workers only lost their peer to the first failure: no failure of its own
    if track.state in STATE_STATUS:
        return STATE_STATUS[track.state]
    if outcome.node_code(node) != 0:
        return SummaryStatus.FAILED
    return SummaryStatus.REJOINED if track.rejoined_after else SummaryStatus.OK


def status_text(node: NodeHandle, outcome: Outcome) -> str:
    """The status cell: `node_status`; a node stopped by Ctrl-C or a cancel
    says whether the job checkpointed on that stop (`stopped, checkpoint at
    step N`, `stopped, no checkpoint`)."""
    status = node_status(node, outcome)
    if status is SummaryStatus.STOPPED and outcome.interrupted:
        return f"{status.value}, {checkpoint_text(outcome.stopped_at)}"
    return status.value


def checkpoint_text(stop: Stop | None) -> str:
    """Whether the job's stop record (ddpkit train's, or the preamble's for a
    program with a stop handler) says a checkpoint was written, and at which step."""
    return f"checkpoint at step {stop.step}" if stop is not None and stop.checkpoint else "no checkpoint"


def status_style(status: str) -> str:
    """The style of a status cell as recorded (`stopped, ...` is styled as `stopped`)."""
    exact = next((s for s in SummaryStatus if s.value == status), None)
    found = exact or next((s for s in SummaryStatus if status.startswith(f"{s.value}, ")), None)
    return "" if found is None else STATUS_STYLE[found]


def closing_line(outcome: Outcome, text: RunText, reason: Callable[[NodeHandle], str], recovery: str) -> str:
    """The line after the table: how the run ended. `reason`: why a node
    failed; `recovery`: "; recovery: ..." for an elastic job that went on."""
    if outcome.interrupted:
        return f"{text.title}: {text.interrupted}; {checkpoint_text(outcome.stopped_at)}"
    if outcome.stalled:
        # Each rank with the call it sits in (a frozen one sent no stack): what the user acts on.
        named = "; ".join(f"rank {s.rank} (node {s.node}, {s.host})"
                          + (", frozen" if s.frozen_s is not None else f" at {s.frame}" if s.frame else "")
                          for s in outcome.stalled)
        return (f"{text.title}: the hang watchdog found stalled rank(s): {named}; stacks were dumped "
                f"(see the lines above), every node was stopped, exit {int(ExitCode.STALLED)}")
    if outcome.stop_request is not None:
        return f"{text.title}: {outcome.stop_request.reason}; stopped every node"
    failed = outcome.first_failure
    if failed is None:
        return (f"{text.title}: every node finished" + _rejoined_text(outcome) + _excluded_text(outcome, reason)
                + recovery)
    # One line, read by scripts and tests: keep its wording. The node's exit code is the
    # table's; the run's is said where it is not the node's (a lost node's 137 ends the run with 14).
    node = code_text(outcome.node_code(failed))
    run = "" if node == str(outcome.code) else f" (the run's exit code: {outcome.code})"
    return (f"{text.title}: node {failed.index} ({failed.host}) failed first: {reason(failed)}; "
            f"every other node was stopped{run}")


def _rejoined_text(outcome: Outcome) -> str:
    back = [t for t in outcome.nodes if t.rejoined_after and t.state is not NodeState.EXCLUDED]
    if not back:
        return ""
    return "; " + ", ".join(f"node {t.index} ({t.node.host}) rejoined after it failed "
                            f"({'; '.join(t.rejoined_after)})" for t in back)


def _excluded_text(outcome: Outcome, reason: Callable[[NodeHandle], str]) -> str:
    excluded = outcome.excluded
    if not excluded:
        return ""
    names = ", ".join(f"node {n.index} ({n.host}: {reason(n)})" for n in excluded)
    return (f" but {names}: excluded after it failed; the job went on with "
            f"{len(outcome.nodes) - len(excluded)} of {len(outcome.nodes)} nodes")


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
        style = status_style(row.status)
        # Text, not markup: log lines hold brackets (our own prefix, for one).
        cells = [Text(f"node{row.node}"), Text(row.exit_code), Text(row.status, style=style), Text(row.host),
                 Text(row.first_failure)]
        table.add_row(*cells, *([Text(row.straggler, style="yellow")] * stragglers))
    return table


def code_text(code: int | None) -> str:
    """The exit code column: "-" while it has none, "none" for a node that ended without one."""
    if code is None:
        return "-"
    return NO_EXIT_STATUS_CELL if code == NO_EXIT_STATUS else str(code)
