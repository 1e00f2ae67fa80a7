"""A lost node without a job: the rule (every rank of a node silent for
loss_s), the verdict on a real TCPStore with three watchdogs ticked by hand
(every live rank leaves with NODE_LOST, the declarer writes the `lost`
record), and the supervisor's reading of the report (a static job's exit 14
naming the node; an elastic job's closing line with the recovery time).
The real thing (launch ssh, a link cut, a SIGSTOPped node): tests/test_elastic_ssh.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from bench.recovery import wait_until

from ddpkit import records
from ddpkit.launch.supervise.nodestate import NodeState, NodeTrack
from ddpkit.launch.supervise.outcome import Outcome
from ddpkit.launch.supervise.summary import SummaryStatus, node_status
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.shared.exitcodes import WORKER_CODES, ExitCode
from ddpkit.train.watchdog import node_loss as loss_judge
from ddpkit.train.watchdog import stall
from ddpkit.train.watchdog.stall_model import PULSE, Beat, Judge, Phase, Settings

S = Settings(stall_s=60.0)


def beat(rank: int, seq: int, node: int, phase: Phase = Phase.BACKWARD) -> Beat:
    return Beat(rank, seq, seq, 5, phase, 0.1, True, node, 1000 + rank, f"host{node}")


def test_a_node_is_lost_when_every_rank_of_it_is_silent_past_loss_s() -> None:
    judge = Judge(4, S)
    lost = []
    for t in range(13):
        # node 1 (ranks 2, 3) stops at t=1; node 0 publishes on
        judge.observe([beat(0, t, 0), beat(1, t, 0), beat(2, min(t, 1), 1), beat(3, min(t, 1), 1)], float(t))
        lost.append(loss_judge.lost_ranks(judge, float(t), 10.0))
    assert lost[:12] == [[]] * 12  # 10 s of silence at t=11 is not more than 10 s
    assert [(r.rank, r.node, r.host, r.silent_s) for r in lost[12]] == [(2, 1, "host1", 11.0), (3, 1, "host1", 11.0)]


def beat_as(b: Beat, phase: Phase, warm: bool) -> Beat:
    return Beat(b.rank, b.seq, b.beats, b.step, phase, b.step_s, warm, b.node, b.pid, b.host)


@pytest.mark.parametrize(("phase", "started", "lost"), [(Phase.DONE, True, False), (Phase.SETUP, False, False),
                                                        (Phase.SETUP, True, True)])
def test_a_finished_rank_or_one_starting_before_the_first_step_is_not_judged(phase: Phase, started: bool,
                                                                              lost: bool) -> None:
    """A frozen node's last heartbeat may still say setup when it froze
    within a second of the first steps: once the job trained, it counts."""
    judge = Judge(3, S)
    for t in range(20):
        live = [beat_as(beat(r, t, 0), Phase.BACKWARD if started else Phase.SETUP, started) for r in (0, 1)]
        judge.observe([*live, beat_as(beat(2, min(t, 1), 1), phase, False)], float(t))
    assert [r.rank for r in loss_judge.lost_ranks(judge, 19.0, 10.0)] == ([2] if lost else [])


def test_one_silent_rank_beside_live_ones_of_its_node_is_no_lost_node() -> None:
    judge = Judge(3, S)
    for t in range(20):  # rank 1 frozen beside live rank 0 on node 0: the stall verdict's case
        judge.observe([beat(0, t, 0), beat(1, min(t, 1), 0), beat(2, t, 1)], float(t))
    assert loss_judge.lost_ranks(judge, 19.0, 10.0) == []


def test_silence_counts_only_while_the_monitor_watched() -> None:
    """Every rank paused (the monitor too) and thawed: the monitor wakes to
    stale heartbeats everywhere and must give the others a fresh window."""
    judge, watch = Judge(2, S), loss_judge.LossWatch(10.0, 1.0)
    for t in [*range(5), *range(25, 40)]:  # paused from t=5 to t=25; node 1 publishes again at t=27
        judge.observe([beat(0, t, 0), beat(1, t if t < 5 or t >= 27 else 4, 1)], float(t))
        assert watch.observe(judge, float(t)) == [], t
    for t in range(40, 52):  # then node 1 really goes silent: lost after 10 s of watching
        judge.observe([beat(0, t, 0), beat(1, 39, 1)], float(t))
        found = watch.observe(judge, float(t))
    assert [r.rank for r in found] == [1]


def test_stall_s_no_longer_than_loss_s_leaves_the_verdict_to_the_stall_rule() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ident = stall.Identity(0, 2, 1, 0, "h0", 5000)
    store = stall.open_store("127.0.0.1", server.port)
    assert stall.Watchdog(store, ident, Settings(stall_s=8.0), stall.Outputs(), loss_s=10.0).loss is None
    assert stall.Watchdog(store, ident, Settings(stall_s=60.0), stall.Outputs(), loss_s=10.0).loss is not None


def test_loss_s_from_env() -> None:
    assert loss_judge.loss_s_from_env({}) == 10.0
    assert loss_judge.loss_s_from_env({"DDPKIT_WATCHDOG_LOSS_S": "4.5"}) == 4.5
    for bad in ("ten", "1"):
        with pytest.raises(ValueError, match="DDPKIT_WATCHDOG_LOSS_S"):
            loss_judge.loss_s_from_env({"DDPKIT_WATCHDOG_LOSS_S": bad})
    assert ExitCode.NODE_LOST in WORKER_CODES  # launchers pass the worker's 14 on


def test_an_elastic_worker_re_forms_a_static_one_stops() -> None:
    assert loss_judge.elastic_restarts_left({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not loss_judge.elastic_restarts_left({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert not loss_judge.elastic_restarts_left({"TORCHELASTIC_MAX_RESTARTS": "0"})


class _Exited(Exception):
    pass


def _exit(code: int) -> None:
    raise _Exited(code)


def test_the_store_protocol_three_nodes_one_silent(tmp_path: Path) -> None:
    """Three watchdogs (one rank per node) on a real TCPStore, ticked by hand
    with the test's clock: rank 2 stops publishing; past loss_s rank 0
    declares, ranks 0 and 1 leave with NODE_LOST, and the record says which
    rank was lost and that its heartbeat showed it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dogs = [stall.Watchdog(stall.open_store("127.0.0.1", server.port), stall.Identity(r, 3, 1, r, f"h{r}", 5000 + r),
                           S, stall.Outputs(tmp_path, tmp_path / "m.jsonl"), exit=_exit, loss_s=5.0) for r in range(3)]
    PULSE.phase, PULSE.step = Phase.BACKWARD, 4
    for t in range(6):  # rank 2 published once, at t=0: 5 s silent at t=5 is not yet lost
        for dog in dogs[:2] if t else dogs:
            dog.publish(float(t))
        assert dogs[0]._check(float(t)) is None  # no stall: that limit is 60 s
        assert dogs[0].loss is not None and dogs[0].loss.observe(dogs[0].judge, float(t)) == []  # type: ignore[arg-type]
    codes: dict[int, object] = {}

    def act(dog: stall.Watchdog) -> None:
        try:
            dog.tick(7.0)
        except _Exited as exc:
            codes[dog.ident.rank] = exc.args[0]

    act(dogs[1])  # rank 1 judges too (node 1's first rank) but has not seen rank 2 live for long: nothing yet
    assert codes == {}
    declarer = threading.Thread(target=act, args=(dogs[0],))
    declarer.start()  # rank 0 declares, reports, and waits (it holds the store) for rank 1 to see the verdict
    while not dogs[1].store.check([stall.STALL_KEY]):
        assert declarer.is_alive(), codes
    act(dogs[1])
    declarer.join(timeout=60)
    assert codes == {0: ExitCode.NODE_LOST, 1: ExitCode.NODE_LOST}
    [stamped] = records.read_file(tmp_path / "m.jsonl")
    record = stamped.record
    assert isinstance(record, records.NodeLost) and record.noticed_by == "heartbeat" and record.loss_s == 5.0
    assert [(r.rank, r.node, r.host) for r in record.lost] == [(2, 2, "h2")]
    assert record.action == "stop"  # no elastic agent here


def _leave(dogs: list[stall.Watchdog], verdict: records.NodeLost, gap_s: float = 0.0) -> dict[int, float]:
    """Each watchdog acts on the lost-node verdict on a thread of its own, started in
    the order given, `gap_s` apart; when each left with NODE_LOST (any other exit: absent)."""
    left: dict[int, float] = {}

    def leave(dog: stall.Watchdog) -> None:
        try:
            dog.on_lost(verdict)
        except _Exited as exc:
            if exc.args[0] == ExitCode.NODE_LOST:
                left[dog.ident.rank] = time.monotonic()

    threads = [threading.Thread(target=leave, args=(dog,)) for dog in dogs]
    for thread in threads:
        thread.start()
        time.sleep(gap_s)
    for thread in threads:
        thread.join(timeout=60)
    return left


def test_the_survivors_leave_only_once_rank_0_wrote_the_last_step(tmp_path: Path) -> None:
    """Rank 1 declared node 2 lost and would leave at once; had it, its agent
    would re-form the job and node 0's agent stop rank 0 while it writes the
    last completed step. It leaves after that write (here a slow one), and
    rank 0 after it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dogs = [stall.Watchdog(stall.open_store("127.0.0.1", server.port), stall.Identity(r, 3, 1, r, f"h{r}", 5000 + r),
                           S, stall.Outputs(), exit=_exit, loss_s=5.0) for r in range(3)]
    written: list[float] = []
    # as train/main.py wires it: the trainer's write, then its done hook
    dogs[0].last_words = lambda reason: (time.sleep(1.0), written.append(time.monotonic()), dogs[0].last_step_written())
    lost = [records.LostRank(2, 2, "h2", 5002, 4, Phase.BACKWARD.value, 6.0)]
    verdict = loss_judge.verdict(lost, 5.0, by=1, elastic=True)
    left = _leave([dogs[1], dogs[0]], verdict, gap_s=0.2)  # the declarer sees it first
    assert sorted(left) == [0, 1] and len(written) == 1
    assert written[0] <= left[1] <= left[0]


class _Node:
    def __init__(self, index: int, code: int | None = 1) -> None:
        self.index, self.host, self.label, self.code = index, f"h{index}", f"node{index}", code

    def exit_code(self) -> int | None:
        return self.code


# What the declaring monitor sends (train/watchdog/node_loss.py report), as a launcher reads it.
LOST_LINE = "[rank0]:" + records.frame(records.NodeLost(
    by=0, noticed_by="heartbeat", loss_s=10.0, action="stop",
    lost=(records.LostRank(rank=2, node=2, host="h2", pid=77, step=9, phase="backward", silent_s=11.0),)))


def _supervisor(nodes: list[_Node]) -> tuple[Supervisor, list[int]]:
    from rich.console import Console

    console = Console(file=open("/dev/null", "w"), width=200)  # noqa: SIM115  (closed with the test process)
    sup = Supervisor(nodes, console, 1.0)  # type: ignore[arg-type]  # _Node has what these calls read
    told: list[int] = []
    sup.printer.on_lost = told.append
    return sup, told


def test_a_static_job_stopped_for_a_lost_node_names_it_and_exits_14() -> None:
    nodes = [_Node(0), _Node(1), _Node(2, code=137)]
    sup, told = _supervisor(nodes)
    sup.printer.line(nodes[0], LOST_LINE)  # type: ignore[arg-type]
    sup.printer.line(nodes[0], LOST_LINE)  # type: ignore[arg-type]  # the backup monitor's copy: told once
    assert told == [2]
    outcome = Outcome(nodes=[NodeTrack(n, NodeState.FAILED) for n in nodes],  # type: ignore[arg-type]
                      first_failure=nodes[0], lost=list(sup.findings.recovery.lost.values()))  # type: ignore[arg-type]
    outcome.blame_lost()  # a survivor's exit 14 reached the loop first: the lost node is still blamed
    assert outcome.first_failure is nodes[2] and outcome.code == ExitCode.NODE_LOST
    assert node_status(nodes[2], outcome) is SummaryStatus.LOST  # type: ignore[arg-type]
    closing = sup.closing_line(outcome, type("T", (), {"title": "x"})())  # type: ignore[arg-type]
    assert "node 2 (h2) failed first: no heartbeat for 11s, noticed by the job's heartbeats" in closing
    # the run's code (14) named apart from the table's (137)
    assert closing.endswith("; every other node was stopped (the run's exit code: 14)"), closing
    assert "\n" not in closing, closing


def test_an_elastic_job_that_went_on_says_how_long_recovery_took() -> None:
    nodes = [_Node(0, code=0), _Node(1, code=0), _Node(2, code=137)]
    sup, _ = _supervisor(nodes)
    now = [100.0]
    sup.printer.clock = lambda: now[0]
    sup.printer.line(nodes[0], LOST_LINE)  # type: ignore[arg-type]  # at 100 s: silent since 89 s
    now[0] = 120.0
    reformed = records.Reformed(restart=1, max_restarts=3, world=2, saved_world=3)
    sup.printer.line(nodes[0], "[rank0]:" + records.frame(reformed))  # type: ignore[arg-type]
    states = [NodeState.FINISHED, NodeState.FINISHED, NodeState.EXCLUDED]
    outcome = Outcome(nodes=[NodeTrack(n, s) for n, s in zip(nodes, states, strict=True)],  # type: ignore[arg-type]
                      lost=list(sup.findings.recovery.lost.values()))
    assert outcome.code == ExitCode.OK
    closing = sup.closing_line(outcome, type("T", (), {"title": "x"})())  # type: ignore[arg-type]
    assert ("every node finished but node 2 (h2: no heartbeat for 11s, noticed by the job's heartbeats (frozen, "
            "or cut off without a reset)): excluded after it failed; the job went on with 2 of 3 nodes; recovery: "
            "the others trained again 31s after the node went silent (world size 3 -> 2)") in closing, closing



class _ScriptedNode(_Node):
    """A node whose run is a thread: `play(node, printer, sup)` prints its
    lines and returns its exit code, or None to run until stopped (a frozen
    node: `stop` ends it with SIGKILL's 137, the only signal it takes)."""

    def __init__(self, index: int, play: Play, sup: Callable[[], Supervisor]) -> None:
        super().__init__(index, code=None)
        self.play, self.sup, self.stopped = play, sup, threading.Event()

    def start(self, printer: Any, exited: Callable[[], None]) -> None:
        def run() -> None:
            self.code = 1  # a play that raised: the run still ends, and the test's checks fail
            try:
                code = self.play(self, printer, self.sup())
                if code is None:
                    self.stopped.wait(30)
                self.code = 137 if code is None else code
            finally:
                exited()

        threading.Thread(target=run, daemon=True).start()

    def stop(self, grace_s: float) -> str | None:
        self.stopped.set()
        return None

    def no_status_reason(self) -> str:
        return "connection closed without an exit status"


Play = Callable[[_ScriptedNode, Any, Supervisor], "int | None"]


def _elastic_run(plays: list[Play]) -> tuple[Supervisor, Outcome]:
    """A 3-node elastic run (min_nodes 2, a failed node excluded at once)
    of scripted nodes, through the supervisor's own loop."""
    from rich.console import Console

    from ddpkit.launch.supervise.supervisor import ElasticPolicy

    held: list[Supervisor] = []
    nodes = [_ScriptedNode(i, play, lambda: held[0]) for i, play in enumerate(plays)]
    console = Console(file=open("/dev/null", "w"), width=200)  # noqa: SIM115  (closed with the test process)
    policy = ElasticPolicy(min_nodes=2, max_node_failures=1, reviver=None)  # type: ignore[arg-type]  # never revives
    held.append(Supervisor(nodes, console, 1.0, elastic=policy))  # type: ignore[arg-type]  # _ScriptedNode suffices
    return held[0], held[0].run()


def _closing(sup: Supervisor, outcome: Outcome) -> str:
    return sup.closing_line(outcome, type("T", (), {"title": "x"})())  # type: ignore[arg-type]


def test_a_killed_node_reported_silent_afterwards_failed_with_its_exit_status() -> None:
    """SIGKILL ends node 2 (137), the launcher sees it and the job goes on;
    then a survivor's watchdog also finds node 2's ranks silent (their
    heartbeats stopped with them). The exit status came first: it is how
    node 2 failed (in CI the summary named the heartbeats instead)."""
    def survivor(node: _ScriptedNode, printer: Any, sup: Supervisor) -> int:
        wait_until(lambda: sup.tracks[2].failures == 1, 30, "the supervisor to handle node 2's exit")
        if node.index == 1:
            printer.line(node, LOST_LINE)
        return 0

    sup, outcome = _elastic_run([survivor, survivor, lambda node, printer, sup: 137])
    assert 2 in sup.findings.recovery.silent_since  # the lost record was read, after the exit
    assert outcome.code == ExitCode.OK and outcome.lost == []
    assert "every node finished but node 2 (h2: exit status 137): excluded after it failed" in _closing(sup, outcome)
    assert node_status(sup.nodes[2], outcome) is SummaryStatus.EXCLUDED


def test_a_frozen_node_stopped_for_its_silence_failed_by_the_heartbeats() -> None:
    """The other order: node 2 answers nothing until the job's watchdog
    reports it silent and the supervisor stops it (its 137 is that stop)."""
    def survivor(node: _ScriptedNode, printer: Any, sup: Supervisor) -> int:
        if node.index == 1:
            printer.line(node, LOST_LINE)
        wait_until(lambda: sup.tracks[2].failures == 1, 30, "the supervisor to handle node 2's exit")
        return 0

    sup, outcome = _elastic_run([survivor, survivor, lambda node, printer, sup: None])
    assert sup.nodes[2].stopped.is_set()  # type: ignore[attr-defined]  # stopped because it was reported silent
    assert outcome.code == ExitCode.OK and [x.node for x in outcome.lost] == [2]
    assert ("every node finished but node 2 (h2: no heartbeat for 11s, noticed by the job's heartbeats (frozen, "
            "or cut off without a reset)): excluded after it failed") in _closing(sup, outcome)


def test_a_dropped_connection_then_reported_silent_is_named_by_the_heartbeats() -> None:
    """A host cut off: launch ssh's keepalive drops its connection first (no
    exit status), the job's watchdog reports its ranks silent after: that
    report, which names the ranks and how long they were silent, is the
    cause the summary gives."""
    from ddpkit.launch.supervise.nodeoutput import NO_EXIT_STATUS

    def survivor(node: _ScriptedNode, printer: Any, sup: Supervisor) -> int:
        wait_until(lambda: sup.tracks[2].failures == 1, 30, "the supervisor to handle node 2's exit")
        if node.index == 1:
            printer.line(node, LOST_LINE)
        return 0

    sup, outcome = _elastic_run([survivor, survivor, lambda node, printer, sup: NO_EXIT_STATUS])
    assert [x.node for x in outcome.lost] == [2]
    assert "node 2 (h2: no heartbeat for 11s, noticed by the job's heartbeats" in _closing(sup, outcome)
    assert sup._row(sup.tracks[2].node, outcome).exit_code == "none"  # no exit status: not the watchdog's "lost"


def test_the_first_failure_is_the_earliest_worker_failure_unless_the_node_read_first_had_none() -> None:
    """The nodes' own times order the failures their agents reported (a node whose worker failed
    first may end last); a node that ended with no worker failure of its own (its container or
    host killed from outside) and was read first stays first: nothing says the others were earlier."""
    nodes = [_Node(0, code=1), _Node(1, code=143)]
    read_first_late = Outcome(nodes=[NodeTrack(n, NodeState.FAILED) for n in nodes],  # type: ignore[arg-type]
                              first_failure=nodes[0])  # type: ignore[arg-type]
    read_first_late.blame_earliest({0: 100.4, 1: 100.1})
    assert read_first_late.first_failure is nodes[1]
    killed = [_Node(0, code=1), _Node(1, code=137)]
    outside = Outcome(nodes=[NodeTrack(n, NodeState.FAILED) for n in killed],  # type: ignore[arg-type]
                      first_failure=killed[1])  # type: ignore[arg-type]
    outside.blame_earliest({0: 100.4})  # node 1's container was killed: no record of its own
    assert outside.first_failure is killed[1]


@pytest.mark.parametrize("stopped_code", [143, 137, 15, 9])
def test_a_node_the_launcher_stopped_reports_its_workers_code(stopped_code: int) -> None:
    """The node whose worker failed first may still run when another node's exit makes the
    launcher stop the rest: its code is then the stop's (a shell's 143, or the bare 15 that
    launch ssh's `setsid -w` reports for a node SIGTERM ended), its worker's is the run's."""
    node = _Node(1, code=stopped_code)
    outcome = Outcome(nodes=[NodeTrack(node, NodeState.STOPPED)], first_failure=node,  # type: ignore[arg-type]
                      worker_codes={1: 1})
    assert outcome.node_code(node) == 1  # type: ignore[arg-type]


def test_a_survivor_stops_waiting_for_a_rank_0_that_died_writing(tmp_path: Path) -> None:
    """Rank 0 starts writing the last step and dies (its node lost too): its
    heartbeats stop, and rank 1 leaves loss_s later instead of after
    WRITTEN_WAIT_S (its agent's SIGTERM cannot reach a main thread that waits
    in a collective: torchrun then kills it after 30 s, seen in the chaos run).
    A rank 0 that writes slowly but lives keeps beating from a thread of its
    own, and rank 1 waits for it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fast = dataclasses.replace(S, interval_s=0.2)
    dogs = [stall.Watchdog(stall.open_store("127.0.0.1", server.port), stall.Identity(r, 3, 1, r, f"h{r}", 5000 + r),
                           fast, stall.Outputs(), exit=_exit, loss_s=1.0) for r in range(3)]
    lost = [records.LostRank(2, 2, "h2", 5002, 4, Phase.BACKWARD.value, 6.0)]
    verdict = loss_judge.verdict(lost, 1.0, by=1, elastic=True)
    written: list[float] = []
    dogs[0].last_words = lambda reason: (time.sleep(2.5), written.append(time.monotonic()), dogs[0].last_step_written())
    for dog in dogs[:2]:
        dog.publish()
    left = _leave(dogs[:2], verdict)
    assert written and written[0] <= left[1], "rank 1 left while a live rank 0 was still writing (2.5 s > loss_s)"

    # rank 0 dies as it starts writing: nothing beats, nothing is written
    server2 = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    survivor = stall.Watchdog(stall.open_store("127.0.0.1", server2.port), stall.Identity(1, 3, 1, 1, "h1", 5001),
                              fast, stall.Outputs(), exit=_exit, loss_s=1.0)
    stall.Watchdog(stall.open_store("127.0.0.1", server2.port), stall.Identity(0, 3, 1, 0, "h0", 5000),
                   fast, stall.Outputs(), exit=_exit, loss_s=1.0).publish()
    start = time.monotonic()
    left = _leave([survivor], verdict)
    assert 1.0 <= left[1] - start < 5.0, f"waited {left[1] - start:.1f}s for a dead rank 0 (bound {stall.WRITTEN_WAIT_S}s)"


def test_with_rank_0_lost_the_lowest_survivor_writes_the_last_step_and_leaves_last(tmp_path: Path) -> None:
    """Node 0 is the one lost: rank 1 writes the last completed step (every DDP
    rank holds it whole), rank 2 waits for that write, and rank 1 leaves last."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dogs = [stall.Watchdog(stall.open_store("127.0.0.1", server.port), stall.Identity(r, 3, 1, r, f"h{r}", 5000 + r),
                           S, stall.Outputs(), exit=_exit, loss_s=5.0) for r in range(3)]
    written: list[tuple[int, float]] = []
    for dog in dogs[1:]:
        dog.last_words = lambda reason, d=dog: (time.sleep(1.0), written.append((d.ident.rank, time.monotonic())),
                                                d.last_step_written())
    lost = [records.LostRank(0, 0, "h0", 5000, 4, Phase.BACKWARD.value, 6.0)]
    verdict = loss_judge.verdict(lost, 5.0, by=2, elastic=True)
    left = _leave([dogs[2], dogs[1]], verdict)
    assert [r for r, _ in written] == [1] and sorted(left) == [1, 2]
    assert written[0][1] <= left[2] <= left[1]


def test_one_rank_claims_the_last_step_of_a_loss() -> None:
    """Both threads of every rank may reach the write (a failed collective, the
    verdict): one claim wins, the others write nothing; rank 0 wins where it
    asks within CLAIM_DEFER_S of the others, and the others win without it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def dogs() -> list[stall.Watchdog]:
        store = stall.open_store("127.0.0.1", server.port)
        prefix = f"try{time.monotonic_ns()}/"
        return [stall.Watchdog(dist.PrefixStore(prefix, store), stall.Identity(r, 3, 1, r, f"h{r}", 5000 + r), S,
                               stall.Outputs(), exit=_exit) for r in range(3)]

    alive = dogs()
    won: dict[int, bool] = {}
    asking = [threading.Thread(target=lambda r=r: won.update({r: alive[r].claim_last_step()})) for r in (2, 1)]
    for thread in asking:
        thread.start()
    time.sleep(0.3)  # rank 0's main thread fails a moment after the others'
    won[0] = alive[0].claim_last_step()
    for thread in asking:
        thread.join(timeout=10)
    assert won == {0: True, 1: False, 2: False}

    gone = dogs()  # rank 0 lost with its node: rank 1 or 2, once
    start = time.monotonic()
    results = [gone[r].claim_last_step() for r in (2, 1, 2)]
    assert results == [True, False, True] and time.monotonic() - start >= stall.CLAIM_DEFER_S

    named = dogs()  # a verdict named rank 0 lost: the writer it picked does not wait for rank 0
    named[1]._rank0_lost = True
    start = time.monotonic()
    assert named[1].claim_last_step() and time.monotonic() - start < stall.CLAIM_DEFER_S


def test_the_last_step_is_written_by_its_claimant_alone_and_a_job_without_one_says_done() -> None:
    """A rank whose claim lost writes nothing and leaves 'done' to the claimant; a
    rank with nothing to write (no restart to come) says done at once, so nobody waits."""
    import logging

    from torch import nn

    from ddpkit.train.checkpoint.last_step import LastStep

    said: list[str] = []
    lost_claim = LastStep(None, nn.Linear(2, 2), lambda: None, enabled=True,  # type: ignore[arg-type]
                          log=logging.getLogger("t"), rank=1)
    lost_claim.claim, lost_claim.done = (lambda: False), (lambda: said.append("done"))
    assert lost_claim.write("peer gone") is None and said == []
    static = LastStep(None, nn.Linear(2, 2), lambda: None, enabled=False,  # type: ignore[arg-type]
                      log=logging.getLogger("t"), rank=0)
    static.done = lambda: said.append("done")
    assert static.write("peer gone") is None and said == ["done"]
