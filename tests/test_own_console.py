"""What a console shows of a program of the user's own (real `launch local`,
2 nodes x 1 process, gloo): a tqdm bar redrawn 40 times is a few lines, none
with a tag glued to its end; torch's own warning has one prefix; a rank's
traceback after its peer died is one line (its node's log has all of it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_preamble import run
from tests.test_startup import ROOT

pytestmark = pytest.mark.slow
PROGRAM = ROOT / "tests" / "helpers" / "console_program.py"


def bar_lines(text: str, rank: int) -> list[str]:
    return [line for line in text.splitlines() if re.match(rf"\[(node{rank} rank{rank}|all 2 ranks)\] train:", line)]


def test_a_progress_bar_and_torchs_warning_take_a_line_each_not_one_per_redraw(tmp_path: Path) -> None:
    code, text = run(tmp_path, script=PROGRAM)
    assert code == 0, text
    for rank in (0, 1):
        bars = bar_lines(text, rank)
        # the first state, and the last: the 40 redraws in between are not lines of their own
        assert 1 <= len(bars) <= 4, text
        assert any("40/40" in line for line in bars) or any("40/40" in line for line in bar_lines(text, 1 - rank)), text
    assert "[rank0]:" not in text and "[rank1]:" not in text, text  # no tag glued on, none twice
    warned = [line for line in text.splitlines() if "find_unused_parameters=True" in line]
    assert warned and all(re.match(r"\[(node\d rank\d|all 2 ranks)\] \[W", line) for line in warned), warned


def test_a_survivors_traceback_is_one_line_on_the_console_and_whole_in_its_nodes_log(tmp_path: Path) -> None:
    code, text = run(tmp_path, "fail", script=PROGRAM, launch=("--log-dir", str(tmp_path / "logs")))
    assert code != 0, text
    assert "Traceback" not in text and 'File "' not in text, text
    # rank 0's gloo error, the knock-on of rank 1's: named so, with the exception's text or its kind
    error = [line for line in text.splitlines()
             if line.startswith("[node0 rank0] ") and "its collective lost a peer" in line]
    assert len(error) == 1 and error[0].endswith("(its traceback: the node's log)"), text
    said = error[0].split("] ", 1)[1]
    exception = "RuntimeError" if said.startswith("a knock-on of") else said.split(": its collective lost a peer")[0]
    log = (tmp_path / "logs" / "node0" / "agent.log").read_text(errors="replace")
    assert "[rank0]:Traceback (most recent call last):" in log and f"[rank0]:{exception}" in log, log

