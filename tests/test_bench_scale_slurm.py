"""bench/scale_slurm.py: its short version end to end (`ddpkit submit slurm
--follow` on the real Slurm cluster of tests/infra, 2 slurmd hosts, `ddpkit
train` and a program of the user's own, one node's agent and worker
SIGKILLed and the survivor training again, the job cancelled), and its
slurm/ssh table from two runs' figures. What happened is asserted, never how
fast (tests/test_bench_smoke.py says what a smoke test asserts)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench.scale_slurm import ratio_table, ratios

from tests.infra import slurm_cluster
from tests.test_bench_scale import COMMON, PER_PROGRAM
from tests.test_bench_smoke import run_bench

_REASON = slurm_cluster.available()
CLOSING = re.compile(r"^ddpkit: job \d+ ended CANCELLED \(exit code (\d+):(\d+)\)$")


def result(launcher: str, first_step_s: float, recovery_s: float) -> dict:
    return {"program": f"ddpkit train ({launcher})", "launcher": launcher, "nodes": 4,
            "figures": {"first_step_s": first_step_s, "recovery_s": recovery_s}}


def test_slurm_over_ssh_is_each_figure_both_runs_have_at_the_same_n() -> None:
    other_n = result("ssh", 1.0, 1.0) | {"nodes": 8}
    rows = ratios([result("slurm", 30.0, 6.0), other_n, result("ssh", 20.0, 0.0)])
    # recovery: the ssh run has none to divide by; the N=8 ssh run has no Slurm run beside it
    assert rows == [{"program": "ddpkit train", "nodes": 4, "measure": "first_step_s", "slurm": 30.0, "ssh": 20.0,
                     "slurm_over_ssh": 1.5}]
    assert "| ddpkit train | command to rank 0's first step | 30 / 20 = x1.50 |" in ratio_table(rows)
    assert ratio_table([]) == ""


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
@pytest.mark.full  # a bench on real hosts: tests/test_bench_smoke.py::test_launch_bench_times_start_and_teardown_on_real_hosts
def test_scale_slurm_bench_trains_on_both_nodes_recovers_and_measures_each_figure(tmp_path: Path) -> None:
    run_bench("bench.scale_slurm", "--short", "--out", str(tmp_path), "--img", str(tmp_path / "img"),
              "--name", "s")
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["machine"]["torch"] and data["command"] and data["crash"] and not data["ssh"]
    assert data["stopped"] == {}
    assert sorted(r["program"] for r in data["results"]) == ["ddpkit train (slurm)", "own program (slurm)"]
    for r in data["results"]:
        what = r["program"]
        assert r["nodes"] == 2 and r["launcher"] == "slurm", what
        # the first step was taken by a world of both slurmd hosts (the rank report's rows), nothing restarted
        assert r["rank_hosts"] == ["node1", "node2"] and r["first_world"] == 2, what
        assert r["stopped_at_start"] == [], what
        assert r["trained_steps"] >= 13, what  # 8 before the crash, 5 after the survivor's first
        assert r["recovery_rounds"] >= 1, what  # the workers the survivor started again after the crash
        # what the user saw last: --follow's closing line, and its exit status the cancelled job's (its
        # batch script's code, else 128 + the signal that ended it)
        closing = CLOSING.match(r["closing_line"])
        assert closing, (what, r["closing_line"])
        assert r["exit_code"] == (int(closing[1]) or 128 + int(closing[2])) != 0, (what, r["closing_line"])
        base = what.removesuffix(" (slurm)")
        assert set(r["figures"]) == {*COMMON, *PER_PROGRAM[base]}, what
        assert all(v > 0 for v in r["figures"].values()), (what, r["figures"])
        assert len(r["host_memory_mb"]) == 2 and all(m > 0 for m in r["host_memory_mb"]), what
    for png in ("slurm_start.png", "slurm_launcher.png"):
        assert (tmp_path / "img" / png).stat().st_size > 0
    assert "| ddpkit train (slurm) | command to rank 0's first step | s |" in (tmp_path / "s.md").read_text()
