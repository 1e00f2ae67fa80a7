"""Logs without spew: the launchers' console shows a line
several ranks print at about the same time once, with the ranks named
(launch/supervise/dedup.py), on a fake clock; and the supervisor's LinePrinter with it."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ddpkit.launch.supervise.dedup import Dedup, Released, Source, merge_key, ranges
from ddpkit.launch.supervise.nodeoutput import LinePrinter

WARN = "UserWarning: something every rank says"


def rank(r: int, per_node: int = 2) -> Source:
    node = r // per_node
    return Source(node, r, f"[node{node} rank{r}] ", "cyan")


def node(n: int) -> Source:
    return Source(n, None, f"[node{n}] ", "cyan")


def lines(out: list[Released]) -> list[str]:
    return [o.prefix + o.body for o in out]


def test_ranges() -> None:
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranges([3]) == "3"
    assert ranges([1, 3, 5]) == "1,3,5"


def test_every_rank_printed_it_is_one_line_at_once() -> None:
    d = Dedup(ranks=6, window_s=1.0)
    for r in range(5):
        assert d.add(rank(r), WARN, 0.1 * r) == []  # held: not every rank has printed it
    assert lines(d.add(rank(5), WARN, 0.5)) == [f"[all 6 ranks] {WARN}"]  # the sixth: out at once
    assert d.drain() == []


def test_a_line_every_rank_of_1024_nodes_x_8_prints_twice_is_two_lines() -> None:
    """8,192 ranks (bench/scale_sim.py's largest job) each print the same line
    twice: two lines, each out as its last copy arrives; no rank's second copy
    joins its first."""
    d = Dedup(ranks=8192, window_s=1.0)
    out = [released for _ in range(2) for r in range(8192) for released in d.add(rank(r, 8), WARN, 0.0)]
    assert lines(out) == [f"[all 8192 ranks] {WARN}"] * 2 and d.drain() == []


def test_some_ranks_are_named_once_the_window_is_up_not_before() -> None:
    d = Dedup(ranks=6, window_s=1.0)
    for r in (1, 2, 3, 5):
        d.add(rank(r), WARN, 0.0)
    assert d.due(0.99) == []
    assert lines(d.due(1.0)) == [f"[ranks 1-3,5] {WARN}"]
    assert d.next_due() is None


def test_a_line_of_one_rank_prints_as_today_within_the_window() -> None:
    d = Dedup(ranks=4, window_s=0.5)
    assert d.add(rank(0), "step 1/10 loss 2.3", 10.0) == []
    assert d.next_due() == 10.5
    assert d.due(10.5) == [Released("[node0 rank0] ", "cyan", "step 1/10 loss 2.3")]


def test_bodies_that_differ_are_never_merged() -> None:
    d = Dedup(ranks=2, window_s=1.0)
    d.add(rank(0), "rank 0 ready", 0.0)
    d.add(rank(1), "rank 1 ready", 0.0)
    assert lines(d.due(1.0)) == ["[node0 rank0] rank 0 ready", "[node0 rank1] rank 1 ready"]


def test_a_rank_printing_a_line_twice_is_two_lines() -> None:
    d = Dedup(ranks=2, window_s=1.0)
    d.add(rank(0), "----", 0.0)
    d.add(rank(0), "----", 0.1)
    # rank 1's copy completes the first group; rank 0's second copy stays its own line
    assert lines(d.add(rank(1), "----", 0.2)) == ["[all 2 ranks] ----"]
    assert lines(d.due(2.0)) == ["[node0 rank0] ----"]


def test_a_rank_that_printed_other_lines_between_still_joins() -> None:
    """Rank 1 prints B then A; rank 0 A then B. Each line comes out once,
    merged, in the order of first copies (rank 1's A moves up, less than a window)."""
    d = Dedup(ranks=2, window_s=1.0)
    d.add(rank(0), "A", 0.0)
    d.add(rank(1), "B", 0.1)
    d.add(rank(0), "B", 0.2)
    assert lines(d.add(rank(1), "A", 0.3)) == ["[all 2 ranks] A", "[all 2 ranks] B"]
    assert d.drain() == []


def test_a_held_line_keeps_younger_lines_behind_it_but_never_past_the_window() -> None:
    d = Dedup(ranks=4, window_s=1.0)
    d.add(rank(0), WARN, 0.0)
    d.add(rank(1), WARN, 0.1)
    for r in (0, 1, 2, 3):  # complete, but younger than the held warning
        d.add(rank(r), "all ranks ready", 0.2)
    assert d.due(0.9) == []
    assert lines(d.due(1.0)) == [f"[ranks 0-1] {WARN}", "[all 4 ranks] all ranks ready"]


def test_drain_releases_everything_held_in_order() -> None:
    d = Dedup(ranks=4, window_s=1.0)
    d.add(rank(2), "first", 0.0)
    d.add(rank(3), "first", 0.0)
    d.add(rank(0), "second", 0.1)
    assert lines(d.drain()) == ["[ranks 2-3] first", "[node0 rank0] second"]
    assert d.next_due() is None and d.due(100.0) == []


def test_rankless_copies_name_their_nodes_and_count_repeats() -> None:
    """launch docker / launch ssh run torchrun without the rank prefix, and
    torchrun's agent prints once per node: such lines are merged by node."""
    d = Dedup(ranks=4, window_s=1.0)
    for n in (0, 1):
        d.add(node(n), "agent banner", 0.0)
    d.add(node(0), WARN, 0.1)
    d.add(node(0), WARN, 0.1)
    d.add(node(1), WARN, 0.2)
    d.add(node(1), WARN, 0.2)
    d.add(node(1), "node1 only", 0.3)
    d.add(node(1), "node1 only", 0.3)
    assert lines(d.due(5.0)) == ["[nodes 0-1] agent banner", f"[nodes 0-1, 4 copies] {WARN}",
                                 "[node1, 2 copies] node1 only"]


def test_a_rank_line_and_an_agent_line_with_the_same_text_stay_apart() -> None:
    d = Dedup(ranks=2, window_s=1.0)
    d.add(node(0), "same text", 0.0)
    d.add(rank(0), "same text", 0.0)
    assert lines(d.due(1.0)) == ["[node0] same text", "[node0 rank0] same text"]


def test_the_same_warning_from_every_rank_is_one_line_whatever_its_timestamps() -> None:
    """torch's C++ warning header names its time and process id, which differ
    in every rank's copy: merged all the same, shown as the first copy came."""
    d = Dedup(ranks=4, window_s=1.0)
    copies = [f"[W1127 10:00:0{r}.{r}00000 {70 + r} reducer.cpp:1529] Warning: find_unused_parameters=True"
              for r in range(4)]
    for r in range(3):
        assert d.add(rank(r), copies[r], 0.1 * r) == []
    assert lines(d.add(rank(3), copies[3], 0.3)) == [f"[all 4 ranks] {copies[0]}"]


def test_python_loggings_time_is_masked_too_and_rankless_copies_merge_by_node() -> None:
    d = Dedup(ranks=4, window_s=1.0)
    d.add(node(0), "2026-11-27 10:00:00,123 WARNING the store is slow", 0.0)
    d.add(node(1), "2026-11-27 10:00:00,456 WARNING the store is slow", 0.1)
    assert lines(d.due(1.0)) == ["[nodes 0-1] 2026-11-27 10:00:00,123 WARNING the store is slow"]


def test_a_time_in_the_message_and_another_message_are_never_merged() -> None:
    d = Dedup(ranks=2, window_s=1.0)
    d.add(rank(0), "step 5 at 10:00:01", 0.0)
    d.add(rank(1), "step 5 at 10:00:02", 0.0)
    d.add(rank(0), "[W1127 10:00:01.1 77 a.cpp:1] one", 0.0)
    d.add(rank(1), "[W1127 10:00:01.2 78 a.cpp:1] two", 0.0)
    d.add(rank(0), "[E1127 10:00:01.1 77 a.cpp:1] one", 0.0)  # another severity: its own line
    assert len(d.drain()) == 5


def test_merge_key_masks_only_a_headers_time_and_process_id() -> None:
    assert merge_key("W1127 10:00:00.123000 140 torch/distributed/run.py:793] x") == \
        merge_key("W1128 11:22:33.999999 999 torch/distributed/run.py:793] x")
    assert merge_key("[W1127 reducer.cpp:1529] Warning") == "[W1127 reducer.cpp:1529] Warning"  # no time
    assert merge_key("W1127 10:00:00.1 77 done later") != merge_key("W1127 10:00:00.1 78 done later")  # no file:line]
    assert merge_key("[2026-11-27T10:00:00] z") == merge_key("[2026-11-28T09:59:59] z")
    for plain in ("step 10:00:00 done", "", "[", "W1127 1", "2026-11-27"):
        assert merge_key(plain) == plain


def test_the_line_printer_merges_torch_warnings_from_two_nodes() -> None:
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=400), Dedup(ranks=2, window_s=60.0))
    printer.line(FakeNode(0), "[rank0]:[W1127 10:00:00.100000000 71 ProcessGroupNCCL.cpp:1168] Warning: not destroyed")
    printer.line(FakeNode(1), "[rank1]:[W1127 10:00:00.900000000 72 ProcessGroupNCCL.cpp:1168] Warning: not destroyed")
    printer.close()
    assert out.getvalue() == "[all 2 ranks] [W1127 10:00:00.100000000 71 ProcessGroupNCCL.cpp:1168] Warning: not destroyed\n"


@dataclass(frozen=True)
class FakeNode:
    index: int
    host: str = "h"

    @property
    def label(self) -> str:
        return f"node{self.index}"


def test_the_line_printer_holds_merges_and_releases_on_close() -> None:
    out = io.StringIO()
    now = [0.0]
    printer = LinePrinter(Console(file=out, width=400), Dedup(ranks=4, window_s=60.0), clock=lambda: now[0])
    nodes = [FakeNode(0), FakeNode(1)]
    for r in range(4):
        printer.line(nodes[r // 2], f"[rank{r}]:{WARN}")  # every rank: out at once
    printer.line(nodes[0], f"[rank0]:{'x' * 3}")
    printer.line(nodes[1], f"[rank3]:{'x' * 3}")
    assert out.getvalue() == f"[all 4 ranks] {WARN}\n"
    # the node's tail (the summary's "first failure" cell) keeps every copy, as before
    assert printer.findings.tail(nodes[1].index) == [f"[node1 rank2] {WARN}", f"[node1 rank3] {WARN}", "[node1 rank3] xxx"]
    printer.close()
    assert out.getvalue() == f"[all 4 ranks] {WARN}\n[ranks 0,3] xxx\n"
    printer.line(nodes[0], "[rank0]:after close")  # printed at once
    assert out.getvalue().endswith("[node0 rank0] after close\n")


def test_the_line_printer_releases_a_held_line_on_its_own() -> None:
    """Nothing else arrives: the printer's thread releases the line when its time is up."""
    import time

    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=400), Dedup(ranks=4, window_s=0.2))
    printer.line(FakeNode(0), "[rank0]:alone")
    assert out.getvalue() == ""
    deadline = time.monotonic() + 10
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert out.getvalue() == "[node0 rank0] alone\n", "the held line was not released within 10 s"
    printer.close()


def test_without_dedup_every_copy_prints_at_once() -> None:
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=400))
    for r in range(2):
        printer.line(FakeNode(0), f"[rank{r}]:{WARN}")
    assert out.getvalue() == f"[node0 rank0] {WARN}\n[node0 rank1] {WARN}\n"


def test_launch_docker_node_log_keeps_every_copy_the_console_merges(tmp_path: Path) -> None:
    """launch docker runs torchrun without the rank prefix: a node's two local
    ranks' identical lines are one console line with their count; the node's
    log (--log-dir) has both, as the container printed them."""
    from ddpkit.launch.docker import ContainerNode, NodePlan
    from tests.test_supervisor_worker_code import _Container

    raw = f"{WARN}\n{WARN}\nrank 1 alone\n".encode()
    node1 = ContainerNode(NodePlan(1, "node1", [], {}), _Container([raw[:10], raw[10:]]), log=tmp_path / "node1.log")
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=400), Dedup(ranks=4, window_s=60.0))
    node1._pump(printer)
    printer.close()
    assert (tmp_path / "node1.log").read_bytes() == raw
    assert out.getvalue() == f"[node1, 2 copies] {WARN}\n[node1] rank 1 alone\n"
