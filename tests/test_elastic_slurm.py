"""An elastic job on a real Slurm cluster (tests/infra/slurm_cluster.py:
slurmctld and three slurmds in network namespaces), torchrun mode, 3 nodes,
min_nodes 2. Right after the first checkpoint of the 3-node world
(tests/helpers/elastic_gate.py), node3 is lost: its slurmd, its job step's
slurmstepd and its trainer are SIGKILLed. The two others re-form the job and
train on from the checkpoint with world size 2; the batch script relaunches
the step on the nodes still up, and the job ends COMPLETED."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.infra import slurm_cluster
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
_reason = slurm_cluster.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

TRAIN = ["--model", "tests.helpers.tiny:cnn", "--image-size", "8", "--workers", "0", "--progress", "plain",
         "--synthetic-size", "96", "--batch-size", "4", "--epochs", "2", "--no-eval", "--lr", "0.05",
         "--base-batch", "8", "--seed", "0", "--checkpoint-every", "4", "--keep", "100", "--resume", "auto"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path_factory.mktemp("slurm-elastic"), nodes=3) as c:
        yield c


def render(tmp: Path, gate: Path) -> Path:
    spec = {
        "name": "elastic", "nodes": 3, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 120}, "elastic": {"min_nodes": 2, "max_restarts": 2},
        "command": {"python": PYTHON, "module": "tests.helpers.elastic_gate",
                    "args": [*TRAIN, "--checkpoint-dir", str(tmp / "ckpt")]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                "ELASTIC_TEST_GATE_DIR": str(gate), "ELASTIC_TEST_GATE_WORLD": "3"},
        "slurm": {"requeue": False},
    }
    job = tmp / "elastic.yaml"
    job.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(job), "-o", str(tmp)],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return tmp / "elastic.sbatch"


def wait_for_gate(gate: Path, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        marks = [p.name for p in gate.iterdir() if ".tmp-" not in p.name and p.name != "go"]
        for step in {int(m.split(".")[0]) for m in marks}:
            if sum(m.startswith(f"{step}.rank") for m in marks) == 3:
                return step
        time.sleep(0.2)
    raise AssertionError(f"no 3-node world at the gate: {sorted(p.name for p in gate.iterdir())}")


@pytest.mark.timeout(900)
def test_a_lost_node_leaves_two_that_complete_the_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    script = render(tmp_path, gate)
    job = cluster.sbatch(script)
    assert cluster.net is not None
    try:
        step = wait_for_gate(gate)
        for pid in cluster.net["node3"].pids():  # the node is gone: slurmd, slurmstepd, the trainer
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        (gate / "go").write_text("")
        info = cluster.wait(job, timeout=600)
    finally:
        cluster.run(["scancel", str(job)])
    text = (tmp_path / f"elastic-{job}.out").read_text()
    assert info.state == "COMPLETED", text[-6000:]
    assert f"ckpt-{step:08d}.pt at step {step}" in text, text[-6000:]
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in text, text[-6000:]
