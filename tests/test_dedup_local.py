"""Logs without spew on a real `ddpkit launch local` job:
2 nodes x 2 processes whose ranks all print the same warning. The console
shows it once with the ranks named; each node's log keeps every copy;
--no-dedup prints every copy as before."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.same_warning import BARRIER, WARNING, own_line
from tests.test_launch_local import clean_env, launch_argv
from tests.test_startup import ROOT

JOB = ("--nodes", "2", "--nproc-per-node", "2", "--set", "command.module=tests.helpers.same_warning")


def run(tmp_path: Path, *extra: str) -> tuple[str, Path]:
    logs, barrier = tmp_path / "logs", tmp_path / "barrier"
    barrier.mkdir()
    res = subprocess.run(launch_argv(*JOB, "--log-dir", str(logs), *extra), env=clean_env(**{BARRIER: str(barrier)}),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout, logs


def every_copy_in_the_node_logs(logs: Path) -> None:
    for node in (0, 1):
        agent_log = (logs / f"node{node}" / "agent.log").read_text()
        assert agent_log.count(WARNING) == 2, agent_log  # both local ranks' copies, with their rank prefix
        assert {f"[rank{2 * node + r}]:" for r in (0, 1)} <= {
            line.split(WARNING)[0].split("/")[0] for line in agent_log.splitlines() if WARNING in line}, agent_log


@pytest.mark.slow
def test_a_warning_every_rank_prints_is_one_line_naming_the_ranks(tmp_path: Path) -> None:
    out, logs = run(tmp_path)
    warned = [line for line in out.splitlines() if WARNING in line]
    assert len(warned) == 1 and warned[0].startswith("[all 4 ranks] "), out
    assert sum(line.startswith("[all 4 ranks]   warnings.warn(") for line in out.splitlines()) == 1, out
    for r in range(4):  # each rank's own line: as before
        assert f"[node{r // 2} rank{r}] {own_line(str(r), '4')}" in out.splitlines(), out
    every_copy_in_the_node_logs(logs)
    # torchrun's OMP_NUM_THREADS banner is gone: the job environment sets the variable
    assert "OMP_NUM_THREADS" not in out, out


@pytest.mark.full  # the merge itself: the test above and the dedup units
@pytest.mark.slow
def test_no_dedup_prints_every_ranks_copy(tmp_path: Path) -> None:
    out, logs = run(tmp_path, "--no-dedup")
    warned = sorted(line.split(" /")[0] for line in out.splitlines() if WARNING in line)
    assert warned == ["[node0 rank0]", "[node0 rank1]", "[node1 rank2]", "[node1 rank3]"], out
    every_copy_in_the_node_logs(logs)
