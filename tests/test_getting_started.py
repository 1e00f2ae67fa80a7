"""docs/getting-started.md as a newcomer follows it: the page's `train.py`
and `my-first.yaml`, taken from the page itself, run with the page's command
(`ddpkit launch local -f my-first.yaml`) as two torchrun agents on this
machine; then the fault the page invites ("make rank 3 raise an exception at
step 100") ends the way the page says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.shared.exitcodes import ExitCode
from tests.test_launch_local import clean_env
from tests.test_launch_summary import summary_table
from tests.test_startup import ROOT

PAGE = ROOT / "docs" / "getting-started.md"
DDPKIT = str(Path(sys.executable).with_name("ddpkit"))

pytestmark = pytest.mark.slow


def block_after(text: str, name: str) -> str:
    """The fenced block that follows the first mention of `name` in backticks."""
    at = text.index(f"`{name}`")
    match = re.compile(r"```[a-z]*\n(.*?)```", re.S).search(text, at)
    assert match, f"no code block after `{name}` in {PAGE}"
    return match.group(1)


def the_page_command(text: str) -> list[str]:
    commands = [line.split() for line in re.findall(r"^ddpkit launch local .*$", text, re.M)]
    assert commands == [["ddpkit", "launch", "local", "-f", "my-first.yaml"]], commands
    return [DDPKIT, *commands[0][1:]]


def write_the_pages_files(folder: Path, script: str | None = None) -> list[str]:
    """The page's train.py (or `script` in its place) and my-first.yaml in
    `folder`; the page's command to run them."""
    text = PAGE.read_text()
    (folder / "train.py").write_text(block_after(text, "train.py") if script is None else script)
    (folder / "my-first.yaml").write_text(block_after(text, "my-first.yaml"))
    return the_page_command(text)


def run(folder: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = clean_env(DDPKIT_RUNS_DIR=str(folder / "runs"), OMP_NUM_THREADS="1")
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_the_pages_program_runs_as_two_nodes_with_the_pages_command(tmp_path: Path) -> None:
    argv = write_the_pages_files(tmp_path)
    done = run(tmp_path, argv)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # the program's own line, once, from rank 0 only
    assert len(re.findall(r"step 250 loss \d+\.\d{3}", done.stdout)) == 1, done.stdout[-4000:]
    header, rows = summary_table(output)
    assert sorted(rows) == ["node0", "node1"], output[-4000:]
    assert {row["status"] for row in rows.values()} == {"ok"}, rows
    assert output.rstrip().splitlines()[-1].startswith("launch local: every node finished"), output[-2000:]
    assert os.listdir(tmp_path / "runs"), "the run was not recorded"


def test_the_pages_fault_names_node_1_and_the_exception_once(tmp_path: Path) -> None:
    script = block_after(PAGE.read_text(), "train.py").replace(
        "    opt.step()\n",
        "    opt.step()\n"
        "    if dist.get_rank() == 3 and step == 100:\n"
        "        raise ValueError('rank 3 stops here')\n")
    assert "rank 3 stops here" in script, "the page's loop changed: update this test's fault"
    argv = write_the_pages_files(tmp_path, script)
    done = run(tmp_path, argv)
    output = done.stdout + done.stderr
    assert done.returncode == ExitCode.FAILED, (done.returncode, output[-4000:])
    header, rows = summary_table(output)
    # node 0's ranks may fail on the closed connection before the launcher's stop reaches them
    assert rows["node1"]["status"] == "failed first" and rows["node0"]["status"] in ("stopped", "failed"), rows
    # the console shows the exception once before the summary (whose cell quotes it again), no traceback
    console = output.split("launch local: 2 nodes, ")[0]
    assert len(re.findall(r"\[node1 rank3\] ValueError: rank 3 stops here", console)) == 1, output[-4000:]
    assert "ValueError: rank 3 stops here" in rows["node1"]["first failure"], rows
    assert "Traceback (most recent call last)" not in output, output[-4000:]
    closing = output.rstrip().splitlines()[-1]  # one closing line
    assert re.fullmatch(r"launch local: node 1 \(\S+\) failed first: exit status 1; every other node was stopped",
                        closing), output[-2000:]
