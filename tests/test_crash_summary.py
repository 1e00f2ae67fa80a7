"""A crash's summary reads as its exception: the first-failure cell holds the
exception, where it was raised and where its traceback is, not the warnings
printed before it; one closing line; and the other rank's knock-on (gloo's
`Connection closed by peer` once its peer died) is named as that, not shown
as a second failure.

The nodes' output is real: tests/data/hf_crash holds both nodes' logs of a
Hugging Face `Trainer` (GPT-2 from a config, gloo) under `ddpkit launch
local` 2x1 whose callback raises on rank 1 at step 5 (hf_crash.py there);
rank 0 then fails in the Trainer's all_gather. The workers' lines go through
the agent's own copier (agent/tailing.tail_logfile), which makes the
traceback records, then the agent's own lines follow, into a real
Supervisor on scripted nodes."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from ddpkit import records
from ddpkit.agent.tailing import tail_logfile
from ddpkit.launch.supervise.summary import RunText
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.records.tracebacks import Tracebacks, is_knock_on, raised_at
from ddpkit.runs import NodeLog, RunFolder, RunSummary
from tests.test_supervisor_rejoin import WAIT_S, ScriptedNode

pytestmark = pytest.mark.timeout(60)  # a drive that broke leaves the supervisor waiting
DATA = Path(__file__).parent / "data" / "hf_crash"
EXCEPTION = "ValueError: Expected input batch_size (8) to match target batch_size (16)."
RAISED_AT = "/tmp/h55/hf_crash.py:16 in on_step_end"  # the callback's raise, not the Trainer's frames around it
GLOO = "Connection closed by peer [127.0.0.1]:26021"


def copied(node: int, tmp_path: Path, exit_first: bool = False, skew_s: float = 0.0) -> list[str]:
    """Node `node`'s output as its launcher reads it: the worker's lines as
    the agent copies them (with its traceback record), then the agent's own;
    `exit_first`: the agent's worker_exit record ahead of the worker's lines
    (its monitor can beat the copier); `skew_s`: that node's clock ahead."""
    header = f"[rank{node}]:"
    lines = (DATA / f"node{node}.log").read_text().splitlines()
    worker = tmp_path / f"worker{node}.log"
    worker.write_text("".join(f"{line.removeprefix(header)}\n" for line in lines if line.startswith(header)))
    finished, out = threading.Event(), io.StringIO()
    finished.set()  # the worker has ended: the copier takes the whole file
    tail_logfile(header, str(worker), out, finished, 0.01)
    agent = [_skewed(line, skew_s) for line in lines if not line.startswith(header)]
    exits = [line for line in agent if line.startswith(records.FRAME) and '"worker_exit"' in line]
    if exit_first:
        return [*exits, *out.getvalue().splitlines(), *(line for line in agent if line not in exits)]
    return [*out.getvalue().splitlines(), *agent]


def hooked(node: int) -> list[str]:
    """Node `node`'s output where no agent copied the worker's lines (launch
    ssh, docker): its traceback's lines as torch's hook tags each (`[rank1]: `),
    with no record; the agent's lines as they came."""
    header = f"[rank{node}]:"
    lines = (DATA / f"node{node}.log").read_text().splitlines()
    start = lines.index(f"{header}Traceback (most recent call last):")
    end = max(i for i, line in enumerate(lines) if line.startswith(header))
    return [f"{header} {line.removeprefix(header)}" if start <= i <= end else line for i, line in enumerate(lines)]


def _skewed(line: str, skew_s: float) -> str:
    if not skew_s or not line.startswith(records.FRAME):
        return line
    obj = json.loads(line.removeprefix(records.FRAME))
    if "time" not in obj:  # (an agent_report has none)
        return line
    obj["time"] += skew_s
    return records.FRAME + json.dumps(obj)


@dataclass(frozen=True)
class Ended:
    """What a run left: the console's text, the recorded summary, the events (kind, node)."""

    text: str
    summary: RunSummary
    events: list[tuple[str, int | None]]


def summarised(tmp_path: Path, drive: Callable[[Supervisor, list[ScriptedNode]], None]) -> Ended:
    """Two scripted nodes driven by `drive`: what the run left."""
    folder = RunFolder.create(name="crash", target="local", nodes=2, nproc_per_node=1, spec_yaml="", root=tmp_path)
    folder.set_logs([NodeLog(node=n, host=f"h{n}", path=f"/logs/node{n}/agent.log") for n in (0, 1)])
    nodes = [ScriptedNode(0), ScriptedNode(1)]
    out = io.StringIO()
    sup = Supervisor(nodes, Console(file=out, width=400), 1.0, run=folder)

    def run() -> None:
        assert all(n.started.wait(WAIT_S) for n in nodes)
        drive(sup, nodes)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome = sup.run()
    thread.join(WAIT_S)
    sup.summary(outcome, RunText("launch local", "interrupted; stopped all nodes"))
    summary = folder.record().summary
    assert summary is not None
    return Ended(out.getvalue(), summary, [(e.kind, e.node) for e in folder.events()])


def replay(sup: Supervisor, node: ScriptedNode, lines: list[str], code: int | None = 1) -> None:
    for line in lines:
        sup.printer.line(node, line)
    if code is not None:
        node.finish(code)


def check_the_crash(text: str, summary: RunSummary) -> None:
    """Node 1 failed first with its exception; node 0's knock-on is no second failure."""
    rows = {row.node: row for row in summary.rows}
    assert (rows[1].status, rows[0].status) == ("failed first", "stopped"), summary.rows
    assert rows[1].first_failure.splitlines() == [
        "exit status 1", f"[node1 rank1] {EXCEPTION}", f"at {RAISED_AT}", "its traceback: /logs/node1/agent.log"]
    assert rows[0].first_failure == "", rows[0]
    assert summary.closing == "launch local: node 1 (h1) failed first: exit status 1; every other node was stopped"
    assert text.rstrip().splitlines()[-1] == summary.closing, text[-2000:]  # one closing line, said once
    assert "Warning" in text.split(summary.title)[0], text  # the warnings stay on the console, above the table
    assert text.count(EXCEPTION) == 2, text  # once as it happened, once in the cell
    assert GLOO not in text.split(summary.title)[1] and "GLHF" not in text, text  # nor its advice and emoji
    assert "Traceback (most recent call last)" not in text and records.FRAME not in text, text


def test_a_crash_reads_as_its_exception_and_the_peer_s_gloo_error_as_its_knock_on(tmp_path: Path) -> None:
    def drive(sup: Supervisor, nodes: list[ScriptedNode]) -> None:  # as it ran: node 1's exit came first
        replay(sup, nodes[1], copied(1, tmp_path))
        replay(sup, nodes[0], copied(0, tmp_path), code=None)  # it fails as the launcher stops it

    ended = summarised(tmp_path, drive)
    text = ended.text
    check_the_crash(text, ended.summary)
    assert GLOO not in text, text  # its peer had failed already: the line says whose failure it is
    assert ("[node0 rank0] a knock-on of rank 1's failure: its collective lost a peer (RuntimeError)  "
            "(its traceback: the node's log)") in text.splitlines(), text


def test_the_same_crash_where_no_agent_copied_the_workers_lines_reads_the_same(tmp_path: Path) -> None:
    def drive(sup: Supervisor, nodes: list[ScriptedNode]) -> None:
        replay(sup, nodes[1], hooked(1))
        replay(sup, nodes[0], hooked(0), code=None)

    ended = summarised(tmp_path, drive)
    check_the_crash(ended.text, ended.summary)
    assert ("[node0 rank0] a knock-on of rank 1's failure: its collective lost a peer (RuntimeError)  "
            "(its traceback: the node's log)") in ended.text.splitlines(), ended.text


def test_the_failed_worker_s_traceback_after_its_agent_s_report_still_fills_the_cell(tmp_path: Path) -> None:
    """The agent's monitor may report the failed worker before its copier has
    given out the traceback: the cell is still that worker's exception."""
    def drive(sup: Supervisor, nodes: list[ScriptedNode]) -> None:
        replay(sup, nodes[1], copied(1, tmp_path, exit_first=True))
        replay(sup, nodes[0], copied(0, tmp_path), code=None)

    ended = summarised(tmp_path, drive)
    check_the_crash(ended.text, ended.summary)


def test_a_knock_on_whose_exit_and_clock_come_first_is_not_the_first_failure(tmp_path: Path) -> None:
    """Node 0's gloo error reaches the launcher first, and node 1's clock runs
    5 s ahead (another host): node 1, whose worker raised an error of its
    own, still failed first; node 0's line, said before anything else failed,
    says what a lost peer most often is."""
    def drive(sup: Supervisor, nodes: list[ScriptedNode]) -> None:
        replay(sup, nodes[0], copied(0, tmp_path), code=None)
        replay(sup, nodes[1], copied(1, tmp_path, skew_s=5.0), code=None)
        nodes[0].finish(1)
        nodes[1].finish(1)

    ended = summarised(tmp_path, drive)
    text = ended.text
    check_the_crash(text, ended.summary)
    # node 0's exit stopped the run (its event says so); the run's events then say who failed first
    assert [e for e in ended.events if e[0].startswith("failed")] == [("failed", 0), ("failed first", 1)]
    assert (f"[node0 rank0] RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
            f"{GLOO}: its collective lost a peer, most often the knock-on of another rank's failure  (its "
            "traceback: the node's log)") in text.splitlines(), text


def test_a_lost_peer_with_no_other_failure_is_the_first_failure(tmp_path: Path) -> None:
    """The control: no other rank raised anything (a network fault), so the
    knock-on-looking error is the first failure, and its cell says it."""
    def drive(sup: Supervisor, nodes: list[ScriptedNode]) -> None:
        replay(sup, nodes[0], copied(0, tmp_path))

    summary = summarised(tmp_path, drive).summary
    rows = {row.node: row for row in summary.rows}
    assert (rows[0].status, rows[1].status) == ("failed first", "stopped"), summary.rows
    cell = rows[0].first_failure.splitlines()
    assert cell[1] == f"[node0 rank0] RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] {GLOO}"
    assert cell[2] == "at /tmp/h55/hf_crash.py:24 in main", cell  # the program's own frame, not accelerate's


@pytest.mark.parametrize(("line", "knock_on"), [
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4471",
     True),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [10.0.0.2]:20361: Connection "
     "reset by peer", True),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
     "remote process exited or there was a network error, NCCL version 2.21.5", True),
    ("torch.distributed.DistNetworkError: failed to recv, got 0 bytes", True),
    ("ConnectionResetError: [Errno 104] Connection reset by peer", False),  # the program's own download, say
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for "
     "recv operation to complete", False),  # a peer that hangs, not one that died
    (EXCEPTION, False),
])
def test_a_collective_s_lost_peer_is_told_from_an_error_of_its_own(line: str, knock_on: bool) -> None:
    assert is_knock_on(line) is knock_on


def test_where_an_exception_was_raised_is_the_program_s_innermost_frame() -> None:
    lines = [line.removeprefix("[rank1]:") for line in (DATA / "node1.log").read_text().splitlines()]
    start = lines.index("Traceback (most recent call last):")
    tracebacks = Tracebacks()
    out = tracebacks.feed(lines[start:], 0.0) + tracebacks.idle(0.0)
    record = out[0][0]
    assert isinstance(record, records.Traceback) and record.at == RAISED_AT, record
    library_only = ["Traceback (most recent call last):", '  File "/x/site-packages/torch/a.py", line 3, in f',
                    '  File "/x/site-packages/torch/b.py", line 7, in g']
    assert raised_at(library_only) == "/x/site-packages/torch/b.py:7 in g"  # none of the program's: the innermost
    chained = ['  File "/job/a.py", line 1, in x', "During handling of the above exception, another exception "
               "occurred:", '  File "/job/b.py", line 2, in y']
    assert raised_at(chained) == "/job/b.py:2 in y"  # the last exception's frames
    assert raised_at(["Traceback (most recent call last):"]) is None
