"""The same crash again and again on a real Slurm cluster
(tests/infra/slurm_cluster.py: slurmctld and slurmds in network
namespaces), torchrun mode, 2 nodes x 1 process, elastic (max_restarts 3),
slurm.requeue on. A program of the user's own and `ddpkit train` that
raise the same error at the same step at every start: the agent that sees
it twice ends with exit 76 after one restart, the batch script does not
relaunch the step, and the job is not requeued: FAILED, exit 76, Restarts=0.
The CI tier proves the agent's rule under `launch local`
(tests/test_same_error_local.py)."""

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

from ddpkit.shared.exitcodes import ExitCode
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster
from tests.test_same_error_local import HELPERS, SCRIPT, TRAIN, bad_line

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
_reason = slurm_cluster.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.full,
              pytest.mark.skipif(_reason is not None, reason=_reason or "")]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


def render(tmp: Path, program: str) -> Path:
    command: dict[str, object] = (
        {"python": PYTHON, "script": str(SCRIPT)} if program == "own"
        else {"python": PYTHON, "module": "tests.helpers.train_same_error", "args": TRAIN})
    spec = {"name": "same-error", "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "rendezvous": {"timeout_s": 120}, "elastic": {"min_nodes": 1, "max_restarts": 3},
            "command": command,
            "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                    "SAME_ERROR_MODE": "raise"},
            "slurm": {"requeue": True}}
    job = tmp / "same-error.yaml"
    job.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(job), "-o", str(tmp)],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return tmp / "same-error.sbatch"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("program", ["own", "train"])
def test_the_same_error_twice_is_neither_relaunched_nor_requeued(cluster: SlurmCluster, tmp_path: Path,
                                                                 program: str) -> None:
    began = time.monotonic()
    job = cluster.sbatch(render(tmp_path, program))
    try:
        info = cluster.wait(job, timeout=400)
    finally:
        cluster.run(["scancel", str(job)])
    text = (tmp_path / f"same-error-{job}.out").read_text()
    if program == "own":
        where = f"{SCRIPT}:{bad_line(SCRIPT, 'raise ValueError')}"
        starts = sorted(int(n) for n in re.findall(r"start restart=(\d+) rank=1 ", text))
    else:
        helper = HELPERS / "train_same_error.py"
        where = f"{helper}:{bad_line(helper, 'raise ValueError')}"
        starts = sorted({0, *(int(n) for n in re.findall(r"elastic: restart (\d+) of at most 3", text))})
    print(f"SAME-ERROR slurm {program}: {info.state} {info.exit_code} restarts {info.restarts} after "
          f"{time.monotonic() - began:.1f} s, starts {starts}")
    assert info.state == "FAILED" and info.exit_code == f"{int(ExitCode.SAME_ERROR)}:0", text[-6000:]
    assert info.restarts == 0, text[-6000:]  # not requeued
    assert starts == [0, 1], text[-6000:]  # one restart burned, not max_restarts' 3
    assert (f"the same error twice, rank 1, {where}: a bug in the program, not a fault of the machine"
            in text), text[-6000:]
    assert "job step ended with status 76: the same error twice in a worker" in text, text[-6000:]
    assert "relaunch 1" not in text, text[-6000:]
