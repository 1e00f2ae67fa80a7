"""Reliability: a run killed (SIGKILL) or pre-empted (SIGTERM) at a random
step and resumed ends with parameters bitwise identical to an uninterrupted
run. Real torchrun agents on localhost as two nodes, gloo on the CPU.

Two ranks: a sum of two floats does not depend on order, so gloo's
all-reduce is bitwise reproducible and any difference is the resume's fault.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit.launch.supervise import proctree
from tests.helpers.runs import TINY, Job, assert_bitwise_equal, final_model, metrics, run_ok, torchrun, wait_for_step

pytestmark = pytest.mark.slow

EPOCHS, STEPS_PER_EPOCH = 3, 24  # 192 samples / 2 ranks / batch 4
TOTAL = EPOCHS * STEPS_PER_EPOCH


def job_args(tmp: Path, tag: str) -> list[str]:
    return [*TINY, "--synthetic-size", "192", "--eval-size", "50", "--batch-size", "4", "--epochs", str(EPOCHS),
            "--warmup-epochs", "1", "--lr", "0.4", "--checkpoint-dir", str(tmp / f"ckpt-{tag}"),
            "--checkpoint-every", "3", "--keep", "2", "--metrics", str(tmp / f"{tag}.jsonl"), "--log-every", "1",
            "--log-dir", str(tmp / f"logs-{tag}")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("reference")
    run_ok(torchrun(tmp, 2, 1, job_args(tmp, "ref"), tag="ref"))
    return final_model(tmp / "ckpt-ref")


@pytest.mark.full  # a killed job resumes bit for bit: test_elastic_train.py's crash and test_preempt_slurm.py
def test_sigkill_at_random_step_then_resume_is_bitwise_identical(tmp_path: Path, reference: dict) -> None:
    kill_at = random.Random().randint(4, TOTAL - 4)  # step 3 is the first checkpoint
    job = torchrun(tmp_path, 2, 1, job_args(tmp_path, "k"), tag="killed")
    wait_for_step(tmp_path / "k.jsonl", kill_at, job)
    job.kill(signal.SIGKILL)  # every agent and every worker at once
    ckpt_dir = tmp_path / "ckpt-k"
    if not (ckpt_dir / "latest").exists():
        pytest.fail(f"killed at step >= {kill_at} but no checkpoint was complete")
    resumed = run_ok(torchrun(tmp_path, 2, 1, [*job_args(tmp_path, "k"), "--resume", "auto"], tag="resumed"))
    assert "resumed from" in (tmp_path / "logs-k" / "rank1.log").read_text(), resumed[-3000:]
    assert_bitwise_equal(reference, final_model(ckpt_dir))
    assert [r["steps"] for r in metrics(tmp_path / "k.jsonl") if r["kind"] == "summary"][-1] == TOTAL
    # --keep 2: rotation left at most two complete checkpoints
    assert len(list(ckpt_dir.glob("ckpt-*.pt"))) <= 2


@pytest.mark.full  # SIGTERM's checkpoint: test_train_dist.py; a stop resumed bitwise: the SIGKILL test and test_preempt_slurm.py
def test_sigterm_mid_epoch_checkpoints_then_resume_is_bitwise_identical(tmp_path: Path, reference: dict) -> None:
    job = torchrun(tmp_path, 2, 1, job_args(tmp_path, "t"), tag="termed")
    wait_for_step(tmp_path / "t.jsonl", STEPS_PER_EPOCH + 2, job)  # inside the second epoch
    # A step takes milliseconds and torchrun's agent forwards a signal only when
    # the OS schedules it, so on a busy machine the workers ran 8 steps past the
    # signal, to the epoch's end (a landing CI run). Pausing the workers while
    # the agents forward it pins the stop to within a few steps of this point.
    workers = worker_pids(job)
    proctree.signal_all(workers, signal.SIGSTOP)
    try:
        wait_until(workers, is_stopped, "stopped")  # else a SIGTERM could still be taken before the stop
        for p in job.procs:  # what a scheduler does: signal the launcher on every node
            p.send_signal(signal.SIGTERM)
        wait_until(workers, pending(signal.SIGTERM), "SIGTERM forwarded by its agent")
    finally:
        proctree.signal_all(workers, signal.SIGCONT)
    job.wait(120)
    records = metrics(tmp_path / "t.jsonl")
    summary = [r for r in records if r["kind"] == "summary"]
    assert summary and summary[-1]["status"] == "preempted", job.output()[-4000:]
    stopped = summary[-1]["steps"]
    assert stopped < TOTAL and stopped % STEPS_PER_EPOCH != 0, f"stopped at {stopped}: not mid-epoch"
    # the agreed stop step was checkpointed by rank 0 and both ranks logged the same step
    assert (tmp_path / "ckpt-t" / "latest").read_text().strip() == f"ckpt-{stopped:08d}.pt"
    for rank in (0, 1):
        assert f"checkpointing at step {stopped} " in (tmp_path / "logs-t" / f"rank{rank}.log").read_text()
    run_ok(torchrun(tmp_path, 2, 1, [*job_args(tmp_path, "t"), "--resume", "auto"], tag="resumed"))
    assert_bitwise_equal(reference, final_model(tmp_path / "ckpt-t"))


def worker_pids(job: Job) -> list[int]:
    """The training processes the agents started (one per node here)."""
    pids = [pid for agent in job.procs for pid in proctree.descendants(agent.pid)
            if b"ddpkit.train" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 2, f"workers {pids}\n{job.output()[-3000:]}"
    return pids


def wait_until(pids: list[int], holds: Callable[[dict[str, str]], bool], what: str, timeout: float = 60) -> None:
    """Until `holds` is true of every process's /proc status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(holds(_status(pid)) for pid in pids):
            return
        time.sleep(0.02)
    raise AssertionError(f"workers {pids} not {what} within {timeout}s")


def is_stopped(status: dict[str, str]) -> bool:
    return status["State"].startswith("T")


def pending(sig: signal.Signals) -> Callable[[dict[str, str]], bool]:
    return lambda status: bool(int(status["ShdPnd"], 16) & 1 << (sig - 1))


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)
