"""The supervisor's node output in its three parts: the reader decodes each
line once (launch/supervise/reader.py), the findings keep what the records
say as data (launch/supervise/findings.py), and the printer prints only what
it is handed (launch/supervise/nodeoutput.py)."""

from __future__ import annotations

import io

from rich.console import Console

from ddpkit import records
from ddpkit.launch.supervise.findings import Findings, WorkerFailure
from ddpkit.launch.supervise.nodeoutput import ConsoleLines, LinePrinter
from ddpkit.launch.supervise.reader import OutputReader
from ddpkit.launch.supervise.reads import LineRead, RecordRead

EXIT = records.WorkerExit(rank=1, local_rank=1, pid=9, exitcode=12)


def test_the_reader_gives_out_lines_and_records_in_order() -> None:
    reader = OutputReader()
    out = reader.read(0, "node0", "[rank1]:before", 0.0)
    out += reader.read(0, "node0", "[rank1]:" + records.frame(EXIT, 5.0), 0.0)
    out += reader.read(0, "node0", "torchrun: failed", 0.0)
    assert out == [LineRead(0, 1, "[node0 rank1] ", "before"),
                   RecordRead(0, 1, "[node0 rank1] ", EXIT, 5.0),
                   LineRead(0, None, "[node0] ", "torchrun: failed")]


def test_the_lines_a_record_announces_are_the_node_logs_not_the_consoles() -> None:
    reader = OutputReader()
    cause = records.Cause("ddpkit train", "no data", 2)
    out = reader.read(1, "node1", records.frame(records.AgentReport(lines=2)), 0.0)
    out += reader.read(1, "node1", "Traceback (most recent call last):", 0.0)
    out += reader.read(1, "node1", "ChildFailedError", 0.0)
    out += reader.read(1, "node1", "[rank2]:" + records.frame(cause), 0.0)
    out += reader.read(1, "node1", f"[rank2]:{cause.line}", 0.0)  # shown once, at the run's end
    out += reader.read(1, "node1", "the agent goes on", 0.0)
    assert [type(r).__name__ for r in out] == ["RecordRead", "RecordRead", "LineRead"]
    assert out[-1] == LineRead(1, None, "[node1] ", "the agent goes on")


def test_an_unreadable_frame_is_a_line_and_a_rank_traceback_no_agent_copied_is_its_record() -> None:
    reader = OutputReader()
    later = "[rank0]:" + records.FRAME + '{"kind": "later"}'
    assert reader.read(0, "node0", later, 0.0) == [LineRead(0, 0, "[node0 rank0] ", later.removeprefix("[rank0]:"))]
    lines = ["Traceback (most recent call last):", '  File "/job/train.py", line 3, in <module>',
             "    boom()", "ValueError: boom"]
    out = [r for line in lines for r in reader.read(0, "node0", f"[rank0]:{line}", 1.0)]
    assert len(out) == 1 and isinstance(out[0], RecordRead) and not out[0].framed
    assert isinstance(out[0].record, records.Traceback) and out[0].record.line.startswith("ValueError: boom")
    assert reader.read(0, "node0", "[rank0]:Traceback (most recent call last):", 2.0) == []
    assert reader.close() == [LineRead(0, 0, "[node0 rank0] ", "Traceback (most recent call last):")]


def test_findings_keep_each_nodes_first_failed_worker_as_data() -> None:
    findings = Findings()
    findings.shown(1, "[node1 rank1] the worker's last line")
    findings.take(RecordRead(1, 1, "[node1 rank1] ", EXIT, 5.0), 100.0)
    findings.take(RecordRead(1, 0, "[node1 rank0] ", records.WorkerExit(0, 0, 8, 1), 6.0), 100.0)  # not the first
    findings.shown(1, "[node1] torchrun: failed")
    assert findings.failures == {1: WorkerFailure(1, 1, 12, 5.0)}
    assert findings.worker_code(1) == 12 and findings.worker_failed_at() == {1: 5.0}
    assert findings.tail(1) == ["[node1 rank1] the worker's last line", f"[node1 rank1] {EXIT.line}"]
    findings.forget(1)  # it came back (elastic)
    assert findings.worker_code(1) is None and findings.tail(1)[-1] == "[node1] torchrun: failed"


def test_a_lost_node_is_told_once_and_a_traceback_shows_its_exception() -> None:
    findings = Findings()
    lost = records.LostRank(rank=2, node=1, host="h", pid=3, step=4, phase="step", silent_s=11.0)
    verdict = records.NodeLost(by=0, noticed_by="heartbeats", loss_s=10.0, action="stop", lost=(lost,))
    assert findings.take(RecordRead(0, 0, "[node0 rank0] ", verdict), 100.0).lost == (1,)
    assert findings.take(RecordRead(0, 0, "[node0 rank0] ", verdict), 100.0).lost == ()
    trace = records.Traceback(lines=3, line="ValueError: boom  (its traceback: the node's log)")
    taken = findings.take(RecordRead(1, 2, "[node1 rank2] ", trace), 100.0)
    assert taken.shown == trace.line and findings.exception_nodes() == ({1}, set())


def test_the_console_prints_only_what_it_is_handed() -> None:
    out = io.StringIO()
    lines = ConsoleLines(Console(file=out, width=300), None, lambda: 0.0)
    lines.show(0, 1, "[node0 rank1] ", records.frame(EXIT))  # a frame handed to it is printed as it is
    assert out.getvalue() == f"[node0 rank1] {records.frame(EXIT)}\n"


def test_the_line_printer_keeps_records_in_the_findings_it_is_given() -> None:
    out, findings = io.StringIO(), Findings()
    printer = LinePrinter(Console(file=out, width=300), findings=findings)

    class _Node:
        index, label = 1, "node1"

    printer.line(_Node(), "[rank1]:" + records.frame(EXIT))  # type: ignore[arg-type]
    printer.close()
    assert out.getvalue() == "" and findings.worker_code(1) == 12 and printer.findings is findings


TRACE = ["Traceback (most recent call last):", '  File "/job/train.py", line 3, in <module>', "    boom()",
         "RuntimeError: boom"]
REPORT = ["Traceback (most recent call last):", '  File "run.py", line 9, in main', "ChildFailedError: ",
          "=" * 20, "train.py FAILED", "=" * 20]


def shown_in(order: list[tuple[int, str]]) -> dict[str, list[str]]:
    """Each prefix's lines as the console showed them, for lines fed in `order` ((node, line))."""
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    for index, line in order:
        printer.line(_Node(index), line)  # type: ignore[arg-type]
    printer.close()
    by_prefix: dict[str, list[str]] = {}
    for line in out.getvalue().splitlines():
        by_prefix.setdefault(line.split("] ", 1)[0] + "]", []).append(line)
    return by_prefix


class _Node:
    def __init__(self, index: int) -> None:
        self.index, self.host, self.label = index, f"h{index}", f"node{index}"


def interleavings(streams: list[list[tuple[int, str]]], seeds: range) -> list[list[tuple[int, str]]]:
    """The streams merged in several orders, each stream's own order kept."""
    import random

    out = []
    for seed in seeds:
        rng, left, merged = random.Random(seed), [list(s) for s in streams], []
        while any(left):
            merged.append(rng.choice([s for s in left if s]).pop(0))
        out.append(merged)
    return out


def test_what_a_record_stands_for_is_matched_by_content_so_any_arrival_order_shows_the_same() -> None:
    """Node 0 rank 1's traceback, copied by its agent with its record (before, amid or after
    its lines), and node 1's agent report with other lines of node 1's agent among its lines:
    whatever the order the two nodes' lines arrive in, the console shows the same."""
    from ddpkit.records.tracebacks import record_of

    record = "[rank1]:" + records.frame(record_of(TRACE, 3))
    trace = [f"[rank1]:{line}" for line in TRACE]
    rank_streams = {"before": [record, *trace], "amid": [*trace[:2], record, *trace[2:]],
                    "after": [*trace, record]}
    report = records.frame(records.AgentReport.of("".join(f"{line}\n" for line in REPORT)))
    agent = [report, REPORT[0], REPORT[1], "ddpkit: node 1 goes on", *REPORT[2:], "torchrun: failed"]
    seen = []
    for where, stream in rank_streams.items():
        node0 = [(0, "[rank1]:step 5"), *((0, line) for line in stream), (0, "[rank1]:after it")]
        node1 = [(1, line) for line in agent]
        other = [(0, "[rank0]:another rank goes on")]
        for order in interleavings([node0, node1, other], range(6)):
            seen.append((where, shown_in(order)))
    first = seen[0][1]
    assert first == {"[node0 rank1]": ["[node0 rank1] step 5",
                                       "[node0 rank1] RuntimeError: boom  (its traceback: the node's log)",
                                       "[node0 rank1] after it"],
                     "[node0 rank0]": ["[node0 rank0] another rank goes on"],
                     "[node1]": ["[node1] ddpkit: node 1 goes on", "[node1] torchrun: failed"]}
    assert all(console == first for _, console in seen), [w for w, console in seen if console != first]


def test_a_record_of_a_writer_that_names_no_lines_hides_the_number_it_says_follow() -> None:
    """An older agent's report says only how many lines follow: those are hidden, as before."""
    shown = shown_in([(1, records.frame(records.AgentReport(lines=2))), (1, "torch's report"), (1, "its box"),
                      (1, "the agent goes on")])
    assert shown == {"[node1]": ["[node1] the agent goes on"]}
