"""bench/elastic.py end to end with the tiniest settings, on every target:
three elastic agents, one killed mid-run, and a static job started by hand
from the checkpoint (tests/test_bench_smoke.py says what a smoke test
asserts). A module of its own so that xdist runs it beside the other
benchmarks' smoke tests: each run here trains three times.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.elastic_gate import LAST_CALL_S
from tests.test_bench_smoke import run_bench

pytestmark = pytest.mark.slow


def test_elastic_bench_times_recovery_and_resubmitting(tmp_path: Path) -> None:
    """bench/elastic.py: three elastic agents here, one killed mid-run."""
    run_bench("bench.elastic", "--repeats", "1", "--samples", "1600", "--checkpoint-every", "4",
              "--last-call-s", str(LAST_CALL_S), "--out", str(tmp_path))
    data = json.loads((tmp_path / "elastic.json").read_text())
    (run,) = data["runs"]
    assert run["loss_to_resumed_s"] > 0 and run["by_hand_launch_to_first_step_s"] > 0
    assert 0 <= run["steps_lost"] <= run["killed_at_step"] and data["machine"]["torch"]


@pytest.mark.root
def test_elastic_bench_on_launch_ssh_and_real_slurm(tmp_path: Path) -> None:
    """bench/elastic.py's real targets: namespace hosts with sshd, and slurmctld with three slurmds."""
    from tests.infra import netns, slurm_cluster, sshd

    reason = netns.available() or sshd.available() or slurm_cluster.available()
    if reason or os.geteuid() != 0:
        pytest.skip(reason or "needs root")
    run_bench("bench.elastic", "--targets", "ssh,slurm", "--repeats", "1", "--samples", "1600",
              "--checkpoint-every", "4", "--last-call-s", str(LAST_CALL_S), "--out", str(tmp_path))
    data = json.loads((tmp_path / "elastic.json").read_text())
    assert [r["target"] for r in data["runs"]] == ["ssh", "slurm"]
    for run in data["runs"]:
        assert run["loss_to_resumed_s"] > 0 and run["by_hand_launch_to_first_step_s"] > 0, run
        assert 0 <= run["steps_lost"] <= run["killed_at_step"], run
    assert set(data["by_target"]) == {"ssh", "slurm"} and data["by_target"]["slurm"]["ratio"]["mean"] > 0
