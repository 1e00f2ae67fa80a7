"""A lost node, noticed by its heartbeats: every rank of a node silent for
`watchdog.loss_s` (a link cut, a frozen host, SIGSTOPped agent and workers).

A node that dies closes its connections and the others' collectives fail at
once; a node that goes silent without a reset leaves them waiting in a
collective until it times out (30 minutes by default). The hang watchdog's
monitors already read every rank's heartbeat once a second (train/watchdog/stall.py);
this module is the rule they apply to it, its report lines and its `lost`
record (on stderr for the launcher, and in the metrics file). The watchdog thread acts on the verdict: every rank exits with
ExitCode.NODE_LOST. gloo cannot abort a pending collective (pytorch#130345),
but a process can always leave, even from another thread while its main
thread waits in one: in an elastic job each surviving agent sees a failed
worker and re-forms the job without the silent node (its rendezvous
keep-alive expired by then, rdzv_timing.py); in a static job the job stops.

No torch import: the rule is tested without a process group.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from ... import records
from ...records import LostRank, NodeLost
from ...shared import envnames
from ...shared.agreed import LOSS_FLOOR_S, LOSS_S
from ...shared.exitcodes import ExitCode
from ..startup.launchinfo import AgentRestarts
from .stall_model import UNJUDGED, Judge, Phase

# The report's per-rank line, for people; launchers read the `lost` record instead.
LOST_LINE = ("ddpkit watchdog: LOST rank {rank} node {node} host {host} pid {pid}: no heartbeat for {silent_s:.1f}s "
             "(limit {limit_s:g}s), last at step {step}, phase {phase}")
NOTICED_BY = "heartbeat"  # how the loss was noticed (the metrics record and the launchers say so)


def loss_s_from_env(env: Mapping[str, str] = os.environ) -> float:
    """watchdog.loss_s as the job environment carries it (absent: the
    default); a value that is no number or below the floor is refused at
    start-up (exit 2)."""
    raw = env.get(envnames.DDPKIT_WATCHDOG_LOSS_S)
    try:
        value = float(raw) if raw else LOSS_S
    except ValueError:
        value = -1.0
    if value < LOSS_FLOOR_S:
        raise ValueError(f"{envnames.DDPKIT_WATCHDOG_LOSS_S}={raw!r}: give seconds as a number, at least "
                         f"{LOSS_FLOOR_S:g} (three heartbeats)")
    return value


class LossWatch:
    """The monitor's loss rule over time: silence counts only while this
    monitor itself was watching. A monitor that was not running (the whole
    job paused, SIGSTOP on every rank, a VM frozen and thawed) sees every
    heartbeat stale when it wakes, and the others' threads need a moment to
    publish again: after such a gap each rank gets a fresh window."""

    def __init__(self, loss_s: float, period_s: float) -> None:
        self.loss_s, self.gap_s = loss_s, 3 * period_s
        self._last: float | None = None
        self._since = 0.0

    def observe(self, judge: Judge, now: float) -> list[LostRank]:
        if self._last is None or now - self._last > self.gap_s:
            self._since = now
        self._last = now
        return lost_ranks(judge, now, self.loss_s, self._since)


def lost_ranks(judge: Judge, now: float, loss_s: float, since: float = float("-inf")) -> list[LostRank]:
    """The ranks of every node whose ranks were all silent (no new heartbeat
    at all, not merely no progress) for longer than loss_s, as the monitor's
    judge last saw them. A node counts whole: one silent rank among live
    ones of its node is a frozen process, the stall verdict's business.
    Finished ranks (done) are not judged, nor ranks still starting (setup)
    before the job's first step; once any rank finished a step every rank
    had finished its setup (that step's all-reduce needed them all), so a
    rank whose last heartbeat still says setup froze before it published
    again (its thread publishes once a second)."""
    by_node: dict[int, list[LostRank]] = {}
    live_nodes: set[int] = set()
    started = any(seen.beat.warm for seen in judge.seen.values())
    for seen in judge.seen.values():
        b = seen.beat
        silent = now - max(seen.alive_at, since)
        unjudged = b.phase is Phase.DONE or (b.phase in UNJUDGED and not started)
        if unjudged or silent <= loss_s:
            live_nodes.add(b.node)
            continue
        by_node.setdefault(b.node, []).append(LostRank(b.rank, b.node, b.host, b.pid, b.step, b.phase.value,
                                                       round(silent, 1)))
    return sorted((r for node, ranks in by_node.items() if node not in live_nodes for r in ranks),
                  key=lambda r: r.rank)


def elastic_restarts_left(env: Mapping[str, str] | None = None) -> bool:
    """torchrun's agent will re-form the job when this worker exits: it has
    restarts left (an elastic job; a static one runs --max-restarts=0)."""
    restarts = AgentRestarts.from_env(env)
    return restarts is not None and restarts.restart < restarts.max_restarts


def verdict(lost: list[LostRank], loss_s: float, by: int, elastic: bool) -> NodeLost:
    """What the declaring monitor writes to the verdict key (and, with the
    time, to --metrics): which ranks were lost, how it was noticed, and what
    the job does about it."""
    return NodeLost(by=by, noticed_by=NOTICED_BY, loss_s=loss_s, action="re-form" if elastic else "stop",
                    lost=tuple(lost))


def _nodes(verdict: NodeLost) -> str:
    return ", ".join(f"node {n} ({h})" for n, h in dict.fromkeys((r.node, r.host) for r in verdict.lost))


def reason(verdict: NodeLost) -> str:
    """The verdict in a few words (the checkpoint written for it says this)."""
    return f"lost {_nodes(verdict)}: no heartbeat for {verdict.loss_s:g}s, noticed by the {verdict.noticed_by}s"


def report_lines(verdict: NodeLost) -> list[str]:
    code = int(ExitCode.NODE_LOST)
    then = ("the others leave their workers (exit {c}) so that the agents re-form the job without it"
            if verdict.action == "re-form" else "stopping every rank (exit {c})").format(c=code)
    lines = [f"ddpkit watchdog: lost {_nodes(verdict)}: no heartbeat from any of its ranks for {verdict.loss_s:g}s "
             f"(frozen, or cut off without a reset); {then}"]
    lines += [LOST_LINE.format(limit_s=verdict.loss_s, **asdict(r)) for r in verdict.lost]
    return lines


def report(verdict: NodeLost, metrics: Path | None) -> None:
    """The declaring monitor's report: its lines and the `lost` record on
    stderr (the launchers read the record), and the record in --metrics."""
    for line in report_lines(verdict):
        print(line, file=sys.stderr, flush=True)
    records.emit(verdict)
    if metrics is not None:
        records.append(metrics, verdict, time.time())
