"""The agent's copy of each worker's output (ddpkit/agent/tailing.py): whole
lines, a redrawn progress bar as a terminal shows it and not once per redraw,
one rank tag, and a traceback behind the record that has a launcher show its
exception line; torch's TailLog thread running it on a real file."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from ddpkit import records
from ddpkit.agent.tailing import RedrawnLines, tail_logfile, untagged
from ddpkit.records.tracebacks import Tracebacks, exception_line

TRACE = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>', "    loss.backward()",
         "RuntimeError: Connection reset by peer"]
AT = "train.py:9 in <module>"  # where TRACE raised its exception (the record says it)


def test_a_bar_redrawn_with_carriage_returns_is_copied_when_it_starts_every_interval_and_when_it_ends() -> None:
    lines = RedrawnLines(every_s=10)
    assert lines.feed("\rtrain 0%", 0.0) == ["train 0%"]  # (tqdm writes each state after its CR) at once
    assert lines.feed("\rtrain 10%\rtrain 20%", 1.0) == []
    assert lines.feed("\rtrain 30%", 5.0) == [] and lines.due(9.0) == []
    assert lines.due(11.5) == ["train 30%"] and lines.due(30.0) == []  # no new state: nothing again
    assert lines.feed("\rtrain 100%\n", 31.0) == ["train 100%"]
    assert lines.feed("plain\r\nwindows line\n", 32.0) == ["plain", "windows line"]
    assert lines.feed("loading...", 33.0) == [] and lines.due(100.0) == []  # a line being written is no bar
    assert lines.feed(" done\n", 101.0) == ["loading... done"]
    assert lines.feed("\n", 102.0) == [""]
    assert lines.feed("\rbar 1%", 102.5) == ["bar 1%"]
    assert lines.feed("[W1127 c10d] a warning\n", 102.6) == ["[W1127 c10d] a warning"]  # not glued to the bar
    assert lines.feed("\rbar 2%", 102.7) == ["bar 2%"] and lines.feed("\rbar 3%\n", 102.8) == ["bar 3%"]
    assert lines.feed("last words", 103.0) == [] and lines.close() == ["last words"]


def test_a_rank_tag_the_workers_own_line_repeats_is_taken_off() -> None:
    warning = "[W1127 10:00:00 reducer.cpp:1529] Warning"
    assert untagged("[rank1]:", f"[rank1]:{warning}") == [warning]
    assert untagged("[rank1]:", '[rank1]:   File "x.py"') == ['  File "x.py"']  # the hook's one space only
    assert untagged("[rank1]:", f"train:  0%|  | 0/40[rank1]:{warning}") == ["train:  0%|  | 0/40", warning]
    assert untagged("[rank1]:", "[rank2]: other") == ["[rank2]: other"]
    assert untagged("", "[rank1]: x") == ["[rank1]: x"]


def test_a_whole_traceback_goes_out_behind_its_record_and_a_broken_one_as_it_came() -> None:
    tracebacks = Tracebacks()
    assert tracebacks.feed(["before", *TRACE[:2]], 0.0) == [(None, ["before"])]
    assert tracebacks.idle(0.5) == []  # no exception yet: held
    out = tracebacks.feed(TRACE[2:], 1.0) + tracebacks.idle(1.0)
    assert out == [(records.Traceback(lines=4, at=AT, line="RuntimeError: Connection reset by peer  (its traceback: the "
                                      "node's log)"), TRACE)]
    assert tracebacks.feed(TRACE[:2], 10.0) == [] and tracebacks.idle(11.0) == []
    assert tracebacks.idle(12.5) == [(None, TRACE[:2])]  # never whole: out as it came, no record


def test_lines_that_come_one_by_one_give_the_traceback_out_at_its_exception() -> None:
    """As torch's hook tags them where no agent copied them (launch ssh): `[rank0]: ` before each line."""
    tracebacks = Tracebacks(at_exception=True)
    hooked = [f" {line}" for line in TRACE]
    out = [item for line in [*hooked, " after"] for item in tracebacks.feed([line], 0.0)]
    assert out == [(records.Traceback(lines=4, at=AT, line="RuntimeError: Connection reset by peer  (its traceback: the "
                                      "node's log)"), hooked), (None, [" after"])]


def test_the_exception_of_a_chained_traceback_is_the_last_one() -> None:
    chained = [*TRACE, "", "During handling of the above exception, another exception occurred:", "",
               "Traceback (most recent call last):", '  File "train.py", line 12, in <module>',
               "SystemExit: 3"]
    assert exception_line(chained) == "SystemExit: 3"
    assert exception_line(chained[:6]) == "RuntimeError: Connection reset by peer"
    assert exception_line(TRACE[:3]) is None



def test_torchs_cpp_frames_after_the_exception_are_part_of_the_traceback() -> None:
    tracebacks = Tracebacks()
    cpp = [*TRACE, "", "At:", "  default_hooks.py(31): <lambda>", "next line"]
    [(record, lines)] = tracebacks.feed(cpp, 0.0) + tracebacks.idle(0.1)
    assert record == records.Traceback(lines=7, at=AT, line=f"{TRACE[-1]}  (its traceback: the node's log)")
    assert lines == cpp  # the line after it is shown: the record counts 7


def test_torchs_tail_thread_copies_a_real_file_as_the_worker_wrote_it(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_bytes(b"\r 0%|\r 50%|\r100%|\n[rank3]:[W1127 c10d] warned\n" +
                    "".join(f"[rank3]: {line}\n" for line in TRACE).encode() + "caf\xc3".encode("latin-1"))
    finished, dst = threading.Event(), io.StringIO()
    finished.set()  # the worker ended: the tail copies what is there and stops
    tail_logfile("[rank3]:", str(log), dst, finished, 0.01)
    record = records.frame(records.Traceback(lines=4, at=AT, line=f"{TRACE[-1]}  (its traceback: the node's log)",
                                             hides=records.keys_of(TRACE)))
    assert dst.getvalue().splitlines() == [
        "[rank3]:100%|", "[rank3]:[W1127 c10d] warned", f"[rank3]:{record}", *(f"[rank3]:{line}" for line in TRACE),
        "[rank3]:caf\ufffd"]
