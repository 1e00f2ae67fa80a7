"""The Slurm backend's API on the real cluster (tests/infra/slurm_cluster.py):
`submit slurm --follow` (schedule, then log_iter followed) prints the very
lines `ddpkit logs RUN` and `ddpkit logs RUN --follow` print for the same
job, with the same prefixes, and the job's end is recorded in its run
folder once, however many commands see it afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.runs import RunState, all_runs
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

PYTHON = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python")
_reason = slurm_cluster.available()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(300), pytest.mark.root]

# Two lines per rank, one write each; rank 3 (node 1) fails with its own code.
SAY = """import os, sys
rank = int(os.environ["RANK"])
os.write(1, f"SAY {rank} first\\n".encode())
os.write(1, f"SAY {rank} last\\n".encode())
sys.exit(3 if rank == 3 else 0)
"""


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


@pytest.mark.full  # tests/test_slurm_real.py::test_submit_follow_streams_node_logs_and_exits_zero
def test_submit_follow_prints_what_logs_prints_and_records_the_end_once(cluster: SlurmCluster,
                                                                        tmp_path: Path) -> None:
    script = tmp_path / "say.py"
    script.write_text(SAY)
    spec = {"name": "say", "nodes": 2, "nproc_per_node": 2, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "script": str(script)}, "slurm": {"mode": "srun"}}
    job = tmp_path / "say.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = {"DDPKIT_RUNS_DIR": str(tmp_path / "runs")}
    followed = cluster.run(["ddpkit", "submit", "slurm", "-f", str(job), "--dir", str(tmp_path / "run"), "--follow"],
                           cwd=tmp_path, timeout=180, env=env)
    job_id = int(followed.stdout.split("submitted Slurm job ")[1].split(":")[0])
    said = followed.stdout + followed.stderr
    assert followed.returncode != 0, said
    assert followed.stderr.splitlines()[-1].startswith(f"ddpkit: job {job_id} ended FAILED (exit code "), said

    logs = cluster.run(["ddpkit", "logs", str(job_id)], cwd=tmp_path, env=env)
    logs_followed = cluster.run(["ddpkit", "logs", str(job_id), "--follow"], cwd=tmp_path, env=env)
    shown = followed.stdout.splitlines()[1:]  # after the `submitted` line
    assert logs.returncode == logs_followed.returncode == 0, logs.stderr + logs_followed.stderr
    assert shown == logs.stdout.splitlines() == logs_followed.stdout.splitlines(), said + logs.stdout
    for rank in range(4):
        assert f"[node{rank // 2} rank{rank}] SAY {rank} last" in shown, said
    assert any(line.startswith("[batch] ") for line in shown), said

    status = cluster.run(["ddpkit", "status", str(job_id)], cwd=tmp_path, env=env)
    assert status.returncode == 0, status.stderr
    (run,) = all_runs(tmp_path / "runs")
    record = run.folder.record()
    assert (record.state, record.exit_code) == (RunState.FAILED, followed.returncode), said
    assert [e.kind for e in run.folder.events()].count("exit") == 1, run.folder.events()
