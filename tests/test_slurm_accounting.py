"""A submitted job on a Slurm cluster that keeps accounting (a real slurmdbd
and MariaDB beside slurmctld, tests/infra/slurm_cluster.py): once the job
has left the queue, `ddpkit status` and `ddpkit runs` read its end from
sacct (docs/guides/runs.md). tests/test_slurm_real.py runs the same path on a
cluster without accounting, where scontrol answers. A module of its own: its
cluster is not the shared one, so xdist runs it beside the others."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.infra import slurm_cluster
from tests.infra.slurm_cluster import SlurmCluster
from tests.test_slurm_real import PYTHON, ROOT

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_a_job_that_left_the_queue_is_read_from_sacct(tmp_path: Path) -> None:
    reason = slurm_cluster.available() or slurm_cluster.accounting_available()
    if reason or os.geteuid() != 0:
        pytest.skip(reason or "needs root")
    folder, runs_dir = tmp_path / "job", tmp_path / "runs"
    folder.mkdir()
    args = ["--model=tiny", "--image-size=8", "--workers=0", "--progress=plain", "--data=synthetic",
            "--synthetic-size=16", "--batch-size=4", "--epochs=1", "--no-eval"]
    spec = {"name": "acct", "nodes": 1, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "module": "ddpkit.train", "args": args},
            "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, "slurm": {"mode": "torchrun"}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    with SlurmCluster(tmp_path / "c", nodes=1, prefix=f"sa{os.getpid() % 100000}", accounting=True) as cluster:
        def ddpkit(*argv: str) -> subprocess.CompletedProcess[str]:
            return cluster.run(["ddpkit", *argv], cwd=folder, env={"DDPKIT_RUNS_DIR": str(runs_dir)})

        done = ddpkit("submit", "slurm", "-f", str(folder / "job.yaml"), "--dir", str(folder))
        assert done.returncode == 0, done.stdout + done.stderr
        job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
        assert cluster.wait(job_id, timeout=180).state == "COMPLETED"
        (run,) = [json.loads(p.read_text()) for p in runs_dir.glob("*/run.json")]
        # slurmctld hands the job's end to slurmdbd on its own time: wait for sacct to know it.
        deadline = time.monotonic() + 60
        while "COMPLETED" not in (acct := cluster.run(["sacct", "-n", "-X", "-P", "-j", str(job_id),
                                                        "-o", "State"])).stdout:
            assert time.monotonic() < deadline, f"sacct never listed job {job_id}: {acct.stdout}{acct.stderr}"
            time.sleep(0.5)
        status = ddpkit("status", str(job_id))
        listed = ddpkit("runs")
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.splitlines()[0] == f"run {run['id']}: finished, exit code 0", status.stdout
    # squeue no longer lists an ended job; the cluster keeps accounting, so sacct is asked, not scontrol.
    assert "where     Slurm COMPLETED on node1 (sacct)" in status.stdout, status.stdout
    assert re.search(rf"{run['id']}\s*│\s*acct\s*│\s*slurm\s*│\s*finished", listed.stdout), listed.stdout
