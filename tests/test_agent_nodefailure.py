"""A node's failure file in a Slurm job's records folder (agent/nodefailure.py),
which the batch script reads to end the job with the first failure's code, not
srun's highest: left by the agent of a node whose workers failed, or (srun mode,
no agent) by a task that ended with a failure of its own, never by one that a
stop ended. On the real cluster: tests/test_slurm_first_failure.py."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from ddpkit.agent import nodefailure
from ddpkit.train import __main__ as train_main


def slurm_env(tmp: Path, node: str = "node2", restarts: str = "0") -> dict[str, str]:
    return {"DDPKIT_RECORDS": str(tmp / "job-7.records"), "SLURM_JOB_ID": "7", "SLURMD_NODENAME": node,
            "SLURM_RESTART_COUNT": restarts}


def left(tmp: Path, node: str = "node2", run: int = 0) -> tuple[int, int] | None:
    path = tmp / "job-7.records" / f"{node}.run{run}.failed"
    if not path.exists():
        return None
    at, code = path.read_text().split()
    return int(at), int(code)


def test_a_task_that_failed_leaves_its_code_and_the_nodes_first_failure_stays(tmp_path: Path) -> None:
    env = slurm_env(tmp_path)
    nodefailure.task_ended(13, stopped=False, env=env)
    first = left(tmp_path)
    assert first is not None and first[1] == 13
    nodefailure.task_ended(1, stopped=False, env=env)  # another task of the node, failed later
    assert left(tmp_path) == first
    assert [p.name for p in (tmp_path / "job-7.records").iterdir()] == ["node2.run0.failed"]  # no part file left
    nodefailure.task_ended(1, stopped=False, env=slurm_env(tmp_path, restarts="1"))  # the requeued run's own
    assert left(tmp_path, run=1) is not None and left(tmp_path, run=1)[1] == 1  # type: ignore[index]


@pytest.mark.parametrize(("code", "stopped", "extra"), [
    (0, False, {}),                             # it finished
    (1, True, {}),                              # a stop signal reached it: srun stopped it after another failed
    (75, False, {}),                            # checkpointed on a stop
    (143, False, {}),                           # a signal's code
    (1, False, {"TORCHELASTIC_RUN_ID": "x"}),  # a worker under torchrun's agent: the agent speaks for the node
])
def test_a_task_that_a_stop_ended_or_that_finished_leaves_nothing(
        tmp_path: Path, code: int, stopped: bool, extra: dict[str, str]) -> None:
    nodefailure.task_ended(code, stopped=stopped, env={**slurm_env(tmp_path), **extra})
    assert not (tmp_path / "job-7.records").exists()


def test_outside_a_slurm_job_nothing_is_left(tmp_path: Path) -> None:
    env = {k: v for k, v in slurm_env(tmp_path).items() if k != "SLURM_JOB_ID"}  # compose, Kubernetes
    nodefailure.task_ended(1, stopped=False, env=env)
    assert not (tmp_path / "job-7.records").exists()


def fail_in_training() -> int:
    raise RuntimeError("loss is nan at step 7")


def test_ddpkit_train_as_an_srun_task_says_its_error_in_one_line_and_leaves_its_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**slurm_env(tmp_path), "RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_main, "main", fail_in_training)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert train_main.main_alone() == 1
    log = tmp_path / "job-7.records" / "node2.log"
    raised = fail_in_training.__code__.co_firstlineno + 1
    assert err.getvalue() == (f"[rank1]:RuntimeError: loss is nan at step 7, raised at {__file__}:{raised} in "
                              f"fail_in_training  (its traceback: {log})\n")
    assert 'raise RuntimeError("loss is nan at step 7")' in log.read_text()
    assert left(tmp_path) is not None and left(tmp_path)[1] == 1  # type: ignore[index]


def test_ddpkit_train_under_torchruns_agent_leaves_its_error_to_the_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**slurm_env(tmp_path), "RANK": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_main, "main", fail_in_training)
    with pytest.raises(RuntimeError):  # the worker's own handler (agent/worker.become) says it
        train_main.main_alone()
    assert not (tmp_path / "job-7.records").exists()
