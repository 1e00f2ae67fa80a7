"""The supervisor's elastic policy with a reviver (what `launch ssh` does
when a node is lost, tests/test_elastic_ssh.py runs it on real hosts): a
failed node is brought back while it has failed fewer than
max_node_failures times (two at once too), a node that keeps failing is
excluded, a host that never answers again is excluded when the others
finish, and a failure after which fewer than min_nodes can be in the job
(counting the nodes being brought back), or nobody runs, ends the run.
Nodes here are scripted handles, driven by the test."""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from ddpkit.launch.supervise.events import ElasticPolicy
from ddpkit.launch.supervise.nodeoutput import LinePrinter, NodeHandle
from ddpkit.launch.supervise.nodestate import NodeState
from ddpkit.launch.supervise.outcome import Outcome
from ddpkit.launch.supervise.summary import RunText, SummaryStatus, node_status
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.runs import RunFolder, RunState

WAIT_S = 10.0


class ScriptedNode:
    def __init__(self, index: int) -> None:
        self.index, self.host, self.label = index, f"h{index}", f"node{index}"
        self.code: int | None = None
        self.started = threading.Event()
        self.stopped = False
        self._exited: Callable[[], None] | None = None

    def start(self, printer: LinePrinter, exited: Callable[[], None]) -> None:
        self._exited = exited
        self.started.set()

    def finish(self, code: int) -> None:
        assert self.started.wait(WAIT_S) and self._exited is not None
        self.code = code
        self._exited()

    def exit_code(self) -> int | None:
        return self.code

    def no_status_reason(self) -> str:
        return "cut off"

    def stop(self, grace_s: float) -> str | None:
        self.stopped = True
        if self.code is None and self._exited is not None:
            self.finish(143)
        return None


class Hosts:
    """The reviver: a failed node's host answers again once the test says so."""

    def __init__(self) -> None:
        self.asked: queue.Queue[int] = queue.Queue()
        self.answers: dict[int, threading.Event] = {}
        self.made: queue.Queue[ScriptedNode] = queue.Queue()
        self.cancelled: list[int] = []

    def revive(self, node: NodeHandle, cancelled: threading.Event) -> NodeHandle | None:
        answer = self.answers.setdefault(node.index, threading.Event())
        self.asked.put(node.index)
        while not cancelled.is_set():
            if answer.wait(0.02):
                answer.clear()
                new = ScriptedNode(node.index)
                self.made.put(new)
                return new
        self.cancelled.append(node.index)
        return None

    def answer(self, index: int) -> ScriptedNode:
        assert self.asked.get(timeout=WAIT_S) == index
        self.answers.setdefault(index, threading.Event()).set()
        new = self.made.get(timeout=WAIT_S)
        assert new.started.wait(WAIT_S), "the supervisor did not start the returned node"
        return new


def run(nodes: list[ScriptedNode], hosts: Hosts, drive: Callable[[], None],
        max_node_failures: int = 2, folder: RunFolder | None = None) -> tuple[Supervisor, Outcome]:
    """The supervisor in this (the main) thread, as launchers run it (it
    installs signal handlers); `drive` plays the nodes from another thread."""
    sup = Supervisor(nodes, Console(file=io.StringIO(), width=200), 1.0,
                     elastic=ElasticPolicy(min_nodes=2, max_node_failures=max_node_failures, reviver=hosts),
                     run=folder)
    errors: list[BaseException] = []

    def driver() -> None:
        try:
            assert all(n.started.wait(WAIT_S) for n in nodes)
            drive()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
            for node in sup.nodes:  # end the run, or it would wait for ever
                if node.exit_code() is None:
                    node.finish(0)  # type: ignore[attr-defined]

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    outcome = sup.run()
    thread.join(WAIT_S)
    if errors:
        raise errors[0]
    return sup, outcome


def closing(sup: Supervisor, outcome: Outcome) -> str:
    return sup.closing_line(outcome, RunText("launch ssh", "interrupted"))


def test_a_node_whose_host_answers_again_rejoins_and_the_summary_says_so() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    made: list[ScriptedNode] = []

    def drive() -> None:
        nodes[2].finish(137)
        made.append(hosts.answer(2))
        for node in (nodes[0], nodes[1], made[0]):
            node.finish(0)

    sup, outcome = run(nodes, hosts, drive)
    [back] = made
    assert outcome.code == 0 and outcome.excluded == []
    assert sup.nodes[2] is back
    assert [node_status(n, outcome) for n in sup.nodes] == [SummaryStatus.OK, SummaryStatus.OK, SummaryStatus.REJOINED]
    assert closing(sup, outcome) == ("launch ssh: every node finished; node 2 (h2) rejoined after it failed "
                                     "(exit status 137)")
    assert str(sup._failure_cell(back, outcome)) == "rejoined after: exit status 137"


def test_the_run_folder_records_the_failure_the_restart_and_the_summary(tmp_path: Path) -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    folder = RunFolder.create(name="rejoin", target="ssh", nodes=3, nproc_per_node=1, spec_yaml="", root=tmp_path)

    def drive() -> None:
        nodes[2].finish(137)
        back = hosts.answer(2)
        for node in (nodes[0], nodes[1], back):
            node.finish(0)

    sup, outcome = run(nodes, hosts, drive, folder=folder)
    sup.summary(outcome, RunText("launch ssh", "interrupted"))
    events = [(e.kind, e.node) for e in folder.events()]
    assert events == [("start", None), ("failed", 2), ("restart", 2), ("exit", None)], events
    record = folder.record()
    assert (record.state, record.exit_code) == (RunState.FINISHED, 0)
    assert record.summary is not None
    assert [r.status for r in record.summary.rows] == ["ok", "ok", "ok, rejoined"]
    assert record.summary.rows[2].first_failure == "rejoined after: exit status 137"


def test_a_node_that_keeps_failing_is_excluded_at_its_last_allowed_failure() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    made: list[ScriptedNode] = []

    def drive() -> None:
        nodes[2].finish(1)
        made.append(hosts.answer(2))
        made[0].finish(1)  # its second failure: not revived again
        nodes[0].finish(0)
        nodes[1].finish(0)

    sup, outcome = run(nodes, hosts, drive, max_node_failures=2)
    [back] = made
    assert hosts.asked.empty(), "a node at max_node_failures was revived again"
    assert outcome.code == 0 and outcome.excluded == [back]
    assert node_status(back, outcome) == SummaryStatus.EXCLUDED
    assert "node 2 (h2: exit status 1): excluded after it failed; the job went on with 2 of 3 nodes" \
        in closing(sup, outcome)


def test_with_max_node_failures_1_a_failed_node_is_excluded_at_once() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    def drive() -> None:
        nodes[2].finish(137)
        nodes[0].finish(0)
        nodes[1].finish(0)

    sup, outcome = run(nodes, hosts, drive, max_node_failures=1)
    assert hosts.asked.empty()
    assert outcome.excluded == [nodes[2]] and nodes[2].stopped  # what it left behind is stopped at the end


def test_a_host_that_never_answers_is_excluded_when_the_others_finish() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    def drive() -> None:
        nodes[2].finish(137)
        assert hosts.asked.get(timeout=WAIT_S) == 2
        nodes[0].finish(0)
        nodes[1].finish(0)

    sup, outcome = run(nodes, hosts, drive)
    assert outcome.code == 0 and outcome.excluded == [nodes[2]]
    assert node_status(nodes[2], outcome) == SummaryStatus.EXCLUDED and nodes[2].stopped
    deadline = threading.Event()
    for _ in range(100):  # the reviver's thread saw the run end and gave up
        if hosts.cancelled == [2]:
            break
        deadline.wait(0.05)
    assert hosts.cancelled == [2]


def test_a_failure_that_leaves_fewer_than_min_nodes_ends_the_run() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    def drive() -> None:
        nodes[2].finish(137)  # excluded (max_node_failures 1): 2 remain, min_nodes 2
        nodes[1].finish(1)  # 1 would remain, and nobody comes back: the run ends

    sup, outcome = run(nodes, hosts, drive, max_node_failures=1)
    assert hosts.asked.empty()
    assert outcome.first_failure is nodes[1] and outcome.code == 1
    assert nodes[0].stopped and node_status(nodes[0], outcome) == SummaryStatus.STOPPED
    # each node's one state at the end: none is left running
    assert [t.state for t in outcome.nodes] == [NodeState.STOPPED, NodeState.FAILED, NodeState.EXCLUDED]


def test_two_nodes_lost_at_once_both_come_back_and_the_run_goes_on() -> None:
    """Two of three nodes fail back to back (min_nodes 2): the one left waits in the
    rendezvous while both are brought back; had the second failure ended the run,
    a switch's hiccup would end every job it touched."""
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    made: list[ScriptedNode] = []

    def drive() -> None:
        nodes[2].finish(137)
        nodes[1].finish(137)
        made.extend(hosts.answer(i) for i in (2, 1))
        for node in (nodes[0], *made):
            node.finish(0)

    sup, outcome = run(nodes, hosts, drive)
    assert outcome.code == 0 and outcome.first_failure is None and outcome.excluded == []
    assert [node_status(n, outcome) for n in sup.nodes] == [SummaryStatus.OK, SummaryStatus.REJOINED, SummaryStatus.REJOINED]


def test_a_run_whose_every_node_failed_ends_though_all_could_come_back() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    def drive() -> None:
        for node in reversed(nodes):  # nodes 2 and 1 are being brought back when node 0 fails: nobody runs
            node.finish(137)

    sup, outcome = run(nodes, hosts, drive, max_node_failures=3)
    assert outcome.first_failure is nodes[0] and outcome.code == 137
    assert [t.state for t in outcome.nodes] == [NodeState.FAILED, NodeState.EXCLUDED, NodeState.EXCLUDED]


def test_a_rejoined_node_that_fails_first_is_summarised_by_its_failure() -> None:
    nodes, hosts = [ScriptedNode(i) for i in range(2)], Hosts()
    made: list[ScriptedNode] = []

    def drive() -> None:
        nodes[1].finish(137)  # brought back: node 0 waits for it (min_nodes 2)
        made.append(hosts.answer(1))
        made[0].finish(1)  # its second failure: not brought back, 1 would remain: it ends the run

    sup, outcome = run(nodes, hosts, drive, max_node_failures=2)
    [back] = made
    assert outcome.first_failure is back and outcome.code == 1
    assert node_status(back, outcome) == SummaryStatus.FAILED_FIRST
    assert str(sup._failure_cell(back, outcome)).startswith("exit status 1")


def test_a_node_that_tells_its_exit_twice_is_left_out_once() -> None:
    """A handle calls exited() once; a second call (here while the node is
    away) is an exit already read: it neither fails the run nor counts."""
    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    made: list[ScriptedNode] = []

    def drive() -> None:
        nodes[2].finish(137)
        assert hosts.asked.get(timeout=WAIT_S) == 2
        nodes[2].finish(137)
        hosts.asked.put(2)  # (answer() reads the ask again)
        made.append(hosts.answer(2))
        for node in (nodes[0], nodes[1], made[0]):
            node.finish(0)

    sup, outcome = run(nodes, hosts, drive)
    assert outcome.code == 0 and outcome.rejoined == {2: ["exit status 137"]}
    assert [t.state for t in outcome.nodes] == [NodeState.FINISHED] * 3
