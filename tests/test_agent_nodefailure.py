"""A node's failure file in a Slurm job's records folder (agent/nodefailure.py),
which the batch script reads to end the job with the first failure's code, not
srun's highest: left by the agent of a node whose workers failed, or (srun mode,
no agent) by a task that ended with a failure of its own, never by one that a
stop ended. On the real cluster: tests/test_slurm_first_failure.py."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.agent import nodefailure
from ddpkit.train import __main__ as train_main

ROOT = Path(__file__).resolve().parents[1]


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


def as_an_srun_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as srun's rank 1 of slurm_env's job, with no agent around it."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**slurm_env(tmp_path), "RANK": "1"}.items():
        monkeypatch.setenv(name, value)


def fail_in_training() -> int:
    raise RuntimeError("loss is nan at step 7")


def test_ddpkit_train_as_an_srun_task_says_its_error_in_one_line_and_leaves_its_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    as_an_srun_task(tmp_path, monkeypatch)
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


def test_ddpkit_train_as_an_srun_task_refused_by_its_parser_leaves_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    as_an_srun_task(tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["ddpkit.train", "--epochs=many"])
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert train_main.main_alone() == 2  # argparse exits 2 on a value it cannot read, said on stderr
    assert left(tmp_path) is not None and left(tmp_path)[1] == 2  # type: ignore[index]


def test_ddpkit_train_under_torchruns_agent_leaves_its_error_to_the_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**slurm_env(tmp_path), "RANK": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_main, "main", fail_in_training)
    with pytest.raises(RuntimeError):  # the worker's own handler (agent/worker.become) says it
        train_main.main_alone()
    assert not (tmp_path / "job-7.records").exists()


# Two srun-mode tasks (no agent); both report steps to the hang watchdog, then rank 1 stops reporting:
# the watchdog's verdict ends both with os._exit(13) (train/watchdog/stall.py).
STALLING = """\
import time
import torch.distributed as dist
from ddpkit import watchdog
dist.init_process_group("gloo")
for step in range(1, 4):
    watchdog.progress(step)
    dist.barrier()
if dist.get_rank() == 1:
    time.sleep(120)
dist.barrier()
"""


def srun_task_env(tmp: Path, rank: int, port: int) -> dict[str, str]:
    """What srun gives task `rank` of a step of 2 tasks on node2 (run.py derives torchrun's variables from it)."""
    inherited = {k: v for k, v in os.environ.items()
                 if not k.startswith(("SLURM", "TORCHELASTIC", "DDPKIT", "PET_"))
                 and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")}
    return {**inherited, **slurm_env(tmp), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
            "SLURM_NODEID": "0", "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DDPKIT_WATCHDOG_STALL_S": "2",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_an_srun_task_the_hang_watchdog_ends_leaves_its_nodes_failure_file(tmp_path: Path) -> None:
    """The watchdog ends a stuck task with os._exit, which skips the task's last lines:
    its verdict's code still reaches the node's failure file (nodefailure.exit_now), so the
    batch script ends the job 13, not the 143 of a task srun stopped."""
    (tmp_path / "stalling.py").write_text(STALLING)
    port = free_port()
    tasks = [subprocess.Popen([sys.executable, "-m", "ddpkit.run", str(tmp_path / "stalling.py")], cwd=tmp_path,
                              env=srun_task_env(tmp_path, rank, port), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [task.communicate(timeout=150)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [13, 13], "\n".join(outputs)
    assert "no progress for 2s (limit 2s); stalled rank(s): 1;" in "".join(outputs), "\n".join(outputs)
    found = left(tmp_path)
    assert found is not None and found[1] == 13, f"{found}\n" + "\n".join(outputs)
    # rank 0's process held the store: it left last, and rank 1 never asked a store that was gone
    assert "recvValue failed" not in outputs[1] and "Exception raised from" not in outputs[1], outputs[1]


def test_an_srun_task_that_ends_before_its_program_leaves_its_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m ddpkit.run` in an srun task whose launch environment is wrong (no master to
    be found) ends with one line and exit 2 before the program's first line: its node's file too."""
    from ddpkit import run

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT", "RANK", "MASTER_ADDR", "SLURM_JOB_NODELIST",
                 "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**slurm_env(tmp_path), "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        run.main([str(tmp_path / "program.py")])
    assert ended.value.code == 2
    assert left(tmp_path) is not None and left(tmp_path)[1] == 2  # type: ignore[index]
