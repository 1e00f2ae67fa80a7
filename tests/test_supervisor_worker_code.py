"""The supervisor passes on a ddpkit worker's own exit code and keeps
torchrun's traceback out of the console, on scripted nodes: torchrun's agent
exits 1 whatever its worker's code; ddpkit's agent sends the worker's code
as a record, and marks torchrun's traceback and ChildFailedError box with
another, so that they go to the node's log only. Every rank's cause line is
shown once, last."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from rich.console import Console

from ddpkit import records
from ddpkit.launch.supervise.summary import RunText
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.shared.exitcodes import ExitCode
from tests.test_supervisor_rejoin import WAIT_S, ScriptedNode

CAUSE_RECORD = records.Cause("ddpkit train", "--data imagefolder --data-dir /x is missing on host h0 (rank 0), host h1 "
                             "(rank 1): /x: no such directory; put the dataset at the same path on every node", 12)
CAUSE = CAUSE_RECORD.line
# What a worker prints: the record for its launcher, then the line for people.
CAUSE_PRINTED = [records.frame(CAUSE_RECORD), CAUSE]


def torchrun_report(code: int, rank: int) -> list[str]:
    """What ddpkit's agent prints when its worker exits `code` (torch 2.x): the
    worker's exit record, torchrun's line, the record that marks torchrun's
    report, and the report (its traceback and ChildFailedError box)."""
    report = [
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60,
        "ddpkit.train FAILED",
        "-" * 60,
        "Root Cause (first observed failure):",
        f"  rank      : {rank} (local_rank: 0)",
        f"  exitcode  : {code} (pid: 20011)",
        "=" * 60,
    ]
    return [
        records.frame(records.WorkerExit(rank=rank, local_rank=0, pid=20011, exitcode=code)),
        f"E1125 02:20:43.433000 19590 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        f"(exitcode: {code}) local_rank: 0 (pid: 20011) of binary: /usr/bin/python",
        records.frame(records.AgentReport(lines=len(report))),
        *report,
    ]


def run_job(worker_code: int, agent_code: int = 1, after: str | None = None) -> tuple[str, int]:
    """Two nodes: node 1's worker prints the cause line and exits
    `worker_code`, its agent reports it and exits `agent_code`; node 0 is
    stopped. The console's text and the run's exit code."""
    nodes = [ScriptedNode(0), ScriptedNode(1)]
    out = io.StringIO()
    sup = Supervisor(nodes, Console(file=out, width=400), 1.0)

    def drive() -> None:
        assert all(n.started.wait(WAIT_S) for n in nodes)
        for node in nodes:
            for printed in CAUSE_PRINTED:
                sup.printer.line(node, f"[rank{node.index}]:{printed}")
        sup.printer.line(nodes[1], "[rank1]:the worker's last line")
        for line in torchrun_report(worker_code, 1):
            sup.printer.line(nodes[1], line)
        if after is not None:
            sup.printer.line(nodes[1], after)
        nodes[1].finish(agent_code)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    outcome = sup.run()
    thread.join(WAIT_S)
    sup.summary(outcome, RunText("launch local", "interrupted"))
    return out.getvalue(), outcome.code


def test_the_run_exits_with_the_workers_ddpkit_code_and_shows_the_cause_once_last() -> None:
    text, code = run_job(int(ExitCode.DATA_MISSING))
    assert code == ExitCode.DATA_MISSING
    assert "node 1 (h1) failed first: exit status 12; every other node was stopped" in text, text
    assert text.count("failed first:") == 1 and "exited with code" not in text, text  # one closing line
    assert text.count(CAUSE) == 1, text
    assert text.rstrip("\n").splitlines()[-1] == CAUSE, text
    assert "Traceback" not in text and "ChildFailedError" not in text and "Root Cause" not in text, text
    assert "failed (exitcode: 12)" in text  # torchrun's one line naming the worker's code stays
    assert "[node1 rank1] the worker's last line" in text


def test_a_line_after_the_box_is_shown_again() -> None:
    text, _ = run_job(int(ExitCode.DATA_MISSING), after="agent: after the box")
    assert "[node1] agent: after the box" in text, text


def test_another_programs_code_stays_failed() -> None:
    """3 means "a host cannot run the job" in ddpkit's table; a user script's 3 does not."""
    text, code = run_job(3)
    assert code == ExitCode.FAILED, text
    assert "exit status 1;" in text
    assert "Traceback" not in text


def test_an_agent_killed_by_a_signal_keeps_its_own_code() -> None:
    _, code = run_job(int(ExitCode.DATA_MISSING), agent_code=137)
    assert code == 137


def test_an_agent_traceback_without_a_failed_worker_is_shown() -> None:
    """torchrun's own error (a rendezvous timeout, say) is the cause: shown."""
    nodes = [ScriptedNode(0)]
    out = io.StringIO()
    sup = Supervisor(nodes, Console(file=out, width=400), 1.0)
    for line in ("Traceback (most recent call last):", "RendezvousTimeoutError: timed out"):
        sup.printer.line(nodes[0], line)
    sup.printer.close()  # lines may be held (dedup) up to a second: release them
    assert "Traceback (most recent call last):" in out.getvalue()
    assert "RendezvousTimeoutError" in out.getvalue()


def test_a_rejoined_node_is_named_by_its_workers_code_and_starts_afresh() -> None:
    """Elastic: node 2's worker exits 12 (its agent 1); its host answers, it
    rejoins and finishes: the summary names 12, and the old code does not
    make the new run of the node a failure."""
    from ddpkit.launch.supervise.events import ElasticPolicy
    from ddpkit.launch.supervise.summary import SummaryStatus, node_status
    from tests.test_supervisor_rejoin import Hosts

    nodes, hosts = [ScriptedNode(i) for i in range(3)], Hosts()
    sup = Supervisor(nodes, Console(file=io.StringIO(), width=400), 1.0,
                     elastic=ElasticPolicy(min_nodes=2, max_node_failures=2, reviver=hosts))
    made: list[ScriptedNode] = []

    def drive() -> None:
        assert all(n.started.wait(WAIT_S) for n in nodes)
        for line in torchrun_report(int(ExitCode.DATA_MISSING), 2):
            sup.printer.line(nodes[2], line)
        nodes[2].finish(1)
        made.append(hosts.answer(2))
        for node in (nodes[0], nodes[1], made[0]):
            node.finish(0)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    outcome = sup.run()
    thread.join(WAIT_S)
    assert outcome.code == 0
    assert [node_status(n, outcome) for n in sup.nodes] == [SummaryStatus.OK, SummaryStatus.OK, SummaryStatus.REJOINED]
    assert outcome.rejoined == {2: ["exit status 12"]}


class _Container:
    """What ContainerNode reads of a container: its output, in arbitrary chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def logs(self, stream: bool, follow: bool) -> list[bytes]:
        return self.chunks


def test_launch_docker_keeps_what_the_console_leaves_out_in_its_log(tmp_path: Path) -> None:
    """The containers are removed at the end: with --log-dir the node's whole
    output, torchrun's traceback included, stays in DIR/node<I>.log."""
    from ddpkit.launch.docker import ContainerNode, NodePlan
    from ddpkit.launch.supervise.nodeoutput import LinePrinter

    # no rank prefix: launch docker and launch ssh run torchrun without --log-line-prefix-template
    text = "\n".join([*CAUSE_PRINTED, *CAUSE_PRINTED, *torchrun_report(12, 1)]) + "\n"
    raw = text.encode()
    node = ContainerNode(NodePlan(1, "node1", [], {}), _Container([raw[:50], raw[50:333], raw[333:]]),
                   log=tmp_path / "logs" / "node1.log")
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=400))
    node._pump(printer)
    assert (tmp_path / "logs" / "node1.log").read_bytes() == raw
    assert "Traceback" not in out.getvalue() and "ChildFailedError" not in out.getvalue()
    assert printer.findings.worker_code(1) == 12 and printer.findings.cause_lines(1) == [CAUSE]


def test_the_run_folder_records_a_stall_and_a_preempted_node_as_events(tmp_path: Path) -> None:
    """What the supervisor reads from the workers' lines (the watchdog's STALL
    report, torchrun's report of a worker's 75) becomes events of the run."""
    from ddpkit.runs import RunFolder, RunState

    folder = RunFolder.create(name="ev", target="local", nodes=2, nproc_per_node=1, spec_yaml="", root=tmp_path)
    nodes = [ScriptedNode(0), ScriptedNode(1)]
    sup = Supervisor(nodes, Console(file=io.StringIO(), width=400), 1.0, run=folder)

    def drive() -> None:
        assert all(n.started.wait(WAIT_S) for n in nodes)
        stalled = records.StalledRank(1, 1, "h1", 77, 12, "forward", 60.0, None, frame="model.py:30 in forward")
        sup.printer.line(nodes[1], "[rank1]:" + records.frame(records.Stall(60.0, 60.0, (stalled,), (), (), "here")))
        for line in torchrun_report(int(ExitCode.PREEMPTED), 0):
            sup.printer.line(nodes[0], line)
        nodes[0].finish(1)  # torchrun's agent: 1, whatever its worker's code

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    outcome = sup.run()
    thread.join(WAIT_S)
    sup.summary(outcome, RunText("launch local", "interrupted"))
    events = [(e.kind, e.node) for e in folder.events()]
    assert ("stall", 1) in events and ("preempted", 0) in events and events[-1] == ("exit", None), events
    assert next(e for e in folder.events() if e.kind == "stall").detail.startswith("rank 1 (h1): step 12")
    record = folder.record()
    assert (record.state, record.exit_code) == (RunState.FAILED, ExitCode.STALLED)
    assert record.summary is not None and record.summary.rows[1].status == "stalled"


WARNINGS = [  # what a Hugging Face program prints before its crash: long, and wrapped in a table's cell
    "/x/transformers/file_utils.py:1132: FutureWarning: `resume_download` is deprecated and will be removed in "
    "version 1.0.0. Downloads always resume when possible. If you want to force a new download, use "
    "`force_download=True`.",
    "  warnings.warn(",
    "/x/torch/nn/parallel/distributed.py:2014: UserWarning: find_unused_parameters=True was specified in DDP "
    "constructor, but did not find any unused parameters in the forward pass.",
    "  warnings.warn(",
] * 3
TRACE = ["Traceback (most recent call last):", '  File "/job/train.py", line 9, in <module>',
         "    trainer.train()", "ValueError: Expected input batch_size (8) to match target batch_size (16)."]


def crashed_summary(tmp_path: Path, lines: list[str]) -> tuple[str, str]:
    """Node 1 prints `lines` (its captured stderr) and its worker fails; the
    first failure cell as printed and as run.json records it."""
    from ddpkit.runs import NodeLog, RunFolder

    folder = RunFolder.create(name="crash", target="local", nodes=2, nproc_per_node=1, spec_yaml="", root=tmp_path)
    folder.set_logs([NodeLog(node=n, host=f"h{n}", path=f"/logs/node{n}/agent.log") for n in (0, 1)])
    nodes = [ScriptedNode(0), ScriptedNode(1)]
    out = io.StringIO()
    sup = Supervisor(nodes, Console(file=out, width=400), 1.0, run=folder)

    def drive() -> None:
        assert all(n.started.wait(WAIT_S) for n in nodes)
        for line in [*lines, *torchrun_report(1, 1)]:
            sup.printer.line(nodes[1], line)
        nodes[1].finish(1)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    outcome = sup.run()
    thread.join(WAIT_S)
    sup.summary(outcome, RunText("launch local", "interrupted"))
    summary = folder.record().summary
    assert summary is not None
    return out.getvalue(), summary.rows[1].first_failure


def test_a_crash_s_failure_cell_is_its_exception_and_where_its_traceback_is_not_the_warnings_before(
        tmp_path: Path) -> None:
    """Warnings, then a traceback: the cell is the exit, the exception line and
    the node's log; on both paths a traceback reaches the launcher (the agent's
    record ahead of the lines under launch local; the rank-tagged lines
    themselves under launch ssh and docker)."""
    copied = [records.frame(records.Traceback(lines=len(TRACE), line=f"{TRACE[-1]}  (its traceback: the node's "
                                                                       "log)", at="/job/train.py:9 in <module>")), *TRACE]
    copied = [f"[rank1]:{line}" for line in copied]  # torchrun's tag, as launch local's agent.log holds it
    for shape in (copied, [f"[rank1]: {line}" for line in TRACE]):
        text, cell = crashed_summary(tmp_path, [*(f"[rank1]:{w}" for w in WARNINGS), *shape])
        assert cell.splitlines() == ["exit status 1", f"[node1 rank1] {TRACE[-1]}", "at /job/train.py:9 in <module>",
                                     "its traceback: /logs/node1/agent.log"], cell
        assert "FutureWarning" in text and text.count("FutureWarning") == 3, text  # on the console, not in the cell
        assert f"[node1 rank1] {TRACE[-1]}  (its traceback: the node's log)" in text, text  # the console's line


def test_a_failure_without_a_traceback_keeps_its_last_lines_in_the_cell(tmp_path: Path) -> None:
    _, cell = crashed_summary(tmp_path, ["[rank1]:a line", "[rank1]:the last line"])
    assert cell.splitlines()[:3] == ["exit status 1", "[node1 rank1] a line", "[node1 rank1] the last line"], cell
