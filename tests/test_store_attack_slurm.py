"""A stranger on a real Slurm cluster's network (tests/infra/slurm_cluster.py:
hosts are network namespaces on one bridge) against a running `ddpkit train`
job submitted from the rendered sbatch script, 2 nodes x 1 process, gloo.
From the submit host (`slurmctl`, a login node's place), a client of its own
opens the job's master port, printed by the batch script, and forges
ddpkit's control records under the public prefix every ddpkit used before
run keys and under every prefix a stranger could derive (the job's name, its
Slurm job id, an empty key): the job trains on and completes. The same
forged verdict under the run's own prefix (the key read from a task's
environment, as only root or the job's user can) stops it: the records are
real ones, and only the key, made by the batch script at run time, keeps
them out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.rendezvous import runkey
from tests.helpers.store_stranger import EVIL
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
STALL_S = 6
SLOW_S, MAX_STEPS = 0.3, 80  # rank 0 sleeps SLOW_S in each step: the job trains for at least 24 s
AFTER = 20  # steps the job must make after the forgeries: SLOW_S x AFTER is at least STALL_S
TRAIN = ["--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain", "--log-every", "1",
         "--data", "synthetic", "--batch-size", "4", "--synthetic-size", "100000", "--eval-size", "16",
         "--max-steps", str(MAX_STEPS)]
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


class Job:
    """The rendered script of a 2-node `ddpkit train` job, submitted and followed through its output file."""

    def __init__(self, cluster: SlurmCluster, tmp: Path, name: str, mode: str) -> None:
        spec = {"name": name, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
                "command": {"python": PYTHON, "module": "ddpkit.train", "args": TRAIN},
                "env": {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}, "watchdog": {"stall_s": STALL_S},
                "slurm": {"mode": mode}}
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(tmp / f"{name}.yaml"),
                               "-o", str(tmp)], capture_output=True, text=True, cwd=ROOT, check=False)
        assert done.returncode == 0, done.stderr
        self.cluster, self.name = cluster, name
        self.id = cluster.sbatch(tmp / f"{name}.sbatch", env={"DDPKIT_TEST_SLOW_RANK": f"0:{SLOW_S}"})
        self.out = tmp / f"{name}-{self.id}.out"
        self.submitted_from = tmp  # sbatch runs there (SLURM_SUBMIT_DIR)

    @property
    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text)
            if match:
                return match
            time.sleep(0.3)
        raise AssertionError(f"never saw {pattern!r}:\n{self.text[-4000:]}")

    def started(self) -> tuple[str, int]:
        master = self.wait_for(r"master (\S+):(\d+)\n")
        self.wait_for(r"\bstep 3\b")  # training: the watchdog is up and every rank has published
        return master.group(1), int(master.group(2))

    def stranger(self, *argv: str) -> str:
        """The stranger's client, run on the submit host: another machine on the job's network."""
        done = self.cluster.ctl.run([PYTHON, "-m", "tests.helpers.store_stranger", *argv], cwd=ROOT, timeout=120,
                                    env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"})
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def key(self) -> str:
        """The run key, from the environment of one of the job's tasks (root reads any process's).
        Job ids are per cluster, and each test worker has a cluster of its own: a task is
        this job's by its id and by the folder it was submitted from."""
        keys = set()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
            except OSError:
                continue
            mine = (env.get(b"SLURM_JOB_ID") == str(self.id).encode()
                    and env.get(b"SLURM_SUBMIT_DIR") == str(self.submitted_from).encode())
            if mine and runkey.ENV.encode() in env:
                keys.add(env[runkey.ENV.encode()].decode())
        assert len(keys) == 1, f"every task of the job holds one key: {len(keys)} found"
        return keys.pop()


@pytest.mark.full  # a stranger's forgery: test_store_attack_local.py
@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_forged_records_without_the_run_key_do_not_reach_the_job(cluster: SlurmCluster, tmp_path: Path,
                                                                 mode: str) -> None:
    job = Job(cluster, tmp_path, f"forge-{mode}", mode)
    host, port = job.started()
    key = job.key()
    said = job.stranger(host, str(port), "--job-name", job.name, "--run-id", str(job.id), "--world", "2")
    running = cluster.job(job.id).state
    assert "forged every record" in said, said + job.text[-4000:]
    assert running == "RUNNING", f"{running} right after the forged records:\n{job.text[-4000:]}"
    last = max(int(step) for step in re.findall(r"\bstep (\d+)\b", job.text))
    job.wait_for(rf"\bstep {last + AFTER}\b", timeout=120)  # it trains on, under the watchdog's eye
    info = cluster.wait(job.id, timeout=240)
    text = job.text
    assert info.state == "COMPLETED", text[-4000:]
    assert "ddpkit train finished" in text, text[-4000:]
    assert EVIL not in text, text[-4000:]
    assert "watchdog: STALL" not in text and "watchdog: LOST" not in text and "straggler rank 1" not in text
    assert key not in text  # the batch script never printed it


@pytest.mark.full  # the positive control runs on launch local in make test
def test_the_same_verdict_under_the_run_key_stops_the_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    job = Job(cluster, tmp_path, "forge-key", "torchrun")
    host, port = job.started()
    key = job.key()
    job.stranger(host, str(port), "--key", key)
    info = cluster.wait(job.id, timeout=120)
    text = job.text
    assert info.state == "FAILED", text[-4000:]
    assert f"STALL rank 1 node 1 host {EVIL} pid 1: step 0" in text, text[-4000:]
    assert key not in text  # the batch script never printed it
