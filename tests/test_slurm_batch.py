"""train/stop/slurm_batch.py: a finished worker tells its elastic job's batch
shell, and only that shell, on that node (tests/test_elastic_slurm.py runs
it on real Slurm). The "batch shell" here is a real bash with the template's
trap, started with the job's SLURM_JOB_ID in its environment."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.shared import envnames
from ddpkit.train.stop import slurm_batch


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A bash that writes `told` on SIGUSR1, as the batch script's trap sets `finished`."""
    told = tmp_path / "told"
    ready = tmp_path / "ready"
    proc = subprocess.Popen(["bash", "-c", f"trap 'touch {told}' USR1; touch {ready}; "
                                           "while :; do sleep 0.05; done"],
                            env={**os.environ, envnames.SLURM_JOB_ID: "41"})
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the stand-in batch shell did not start"
        time.sleep(0.02)
    yield proc, told
    proc.kill()
    proc.wait()


def worker_env(pid: int, *, job: str = "41", node: str = "node1") -> dict[str, str]:
    """A worker's environment; the batch shell asked to be told on node1."""
    return {envnames.DDPKIT_SLURM_BATCH_PID: str(pid), envnames.DDPKIT_SLURM_BATCH_NODE: "node1",
            envnames.SLURM_JOB_ID: job, envnames.SLURMD_NODENAME: node}


def told_within(told: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if told.exists():
            return True
        time.sleep(0.02)
    return False


def test_the_batch_shell_of_this_job_on_this_node_is_told(shell: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, told = shell
    assert slurm_batch.tell_training_finished(worker_env(proc.pid))
    assert told_within(told, 10), "the batch shell's USR1 trap never ran"
    assert proc.poll() is None  # told, not ended


@pytest.mark.parametrize("case", ["another job", "another node", "not asked"])
def test_no_other_process_is_signalled(shell: tuple[subprocess.Popen[bytes], Path], case: str) -> None:
    proc, told = shell
    env = {"another job": worker_env(proc.pid, job="42"),  # the PID belongs to a stranger (another PID namespace)
           "another node": worker_env(proc.pid, node="node2"),
           "not asked": {envnames.SLURM_JOB_ID: "41", envnames.SLURMD_NODENAME: "node1"}}[case]
    assert slurm_batch.batch_shell_pid(env) is None
    assert not slurm_batch.tell_training_finished(env)
    assert not told_within(told, 0.3) and proc.poll() is None


def test_a_gone_batch_shell_is_not_an_error() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert slurm_batch.batch_shell_pid(worker_env(gone.pid)) is None
