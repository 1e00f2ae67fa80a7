"""A stop signal that reaches the agent after one of its workers failed, but
before torch's monitor saw it (agent/stopping.py's `_looked_at`): the agent
ends with its worker's code, not as stopped. srun's --kill-on-bad-exit sends
SIGTERM to every node once the first one's agent ended, and a node whose own
worker failed a moment later ended as stopped by SIGTERM, the job FAILED 143
instead of the stall's 13. Such a node also tells a Slurm job's batch script
when it failed and its code (agent/nodefailure.py), which the script reads
(tests/test_render_slurm_first_failure.py, and on the real cluster
tests/test_slurm_first_failure.py)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.api import SignalException

from ddpkit.agent import handler, nodefailure, stopping
from ddpkit.launch.local import free_port
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import ROOT


@pytest.fixture
def last(monkeypatch: pytest.MonkeyPatch) -> Iterator[stopping.SignalShutdown]:
    """A fresh LAST; torch's handler, the agent's methods and loggers put back after the test."""
    fresh = stopping.SignalShutdown()
    monkeypatch.setattr(stopping, "LAST", fresh)
    monkeypatch.setattr(stopping, "_worker_ended", stopping._worker_ended)
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    for method in ("_shutdown", "_invoke_run", "_initialize_workers", "_monitor_workers"):
        monkeypatch.setattr(LocalElasticAgent, method, getattr(LocalElasticAgent, method))
    monkeypatch.setattr(api.PContext, "close", api.PContext.close)
    for name in stopping.TORCH_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    yield fresh


def agent_with(states: list[WorkerState], monkeypatch: pytest.MonkeyPatch, ended: bool) -> SimpleNamespace:
    """torch's agent whose monitor finds `states` in turn, and whose worker has `ended` (seen or not)."""
    found = iter(states)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(state=next(found)))
    monkeypatch.setattr(LocalElasticAgent, "_initialize_workers", lambda self, group: None)
    stopping.install(lambda: ended)
    agent = SimpleNamespace(_pcontext=None)
    LocalElasticAgent._initialize_workers(agent, "group")  # type: ignore[arg-type]  # the workers run
    return agent


def test_a_stop_signal_after_a_worker_failed_unseen_waits_for_the_monitor_which_finds_the_failure(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = agent_with([WorkerState.FAILED], monkeypatch, ended=True)
    stopping.on_stop_signal(signal.SIGTERM, None)  # not raised: torch's monitor has not looked yet
    stopping.on_stop_signal(signal.SIGTERM, None)  # a repeat: the same
    assert last.deferred == signal.SIGTERM and last.first is None
    result = LocalElasticAgent._monitor_workers(agent, "group")  # type: ignore[arg-type]
    assert result.state == WorkerState.FAILED and last.first is None  # the failure ends the run: ChildFailedError
    stopping.on_stop_signal(signal.SIGTERM, None)  # while torch stops the rest of the group
    assert last.first is None


def test_a_stop_signal_after_a_worker_ended_raises_at_the_monitors_look_when_the_group_runs_on(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = agent_with([WorkerState.HEALTHY], monkeypatch, ended=True)
    stopping.on_stop_signal(signal.SIGUSR2, None)
    with pytest.raises(SignalException) as raised:
        LocalElasticAgent._monitor_workers(agent, "group")  # type: ignore[arg-type]
    assert raised.value.sigval == signal.SIGUSR2 and last.first == signal.SIGUSR2 and last.deferred is None


@pytest.mark.parametrize("code", [-signal.SIGTERM, 128 + signal.SIGTERM, 75])
def test_workers_that_ended_on_the_signal_itself_are_a_stop_not_a_failure(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """srun sends the signal to every process of the step: a worker that died of it, or checkpointed and
    exited 75, before the agent's handler ran, ended because of the stop."""
    found = iter([RunResult(state=WorkerState.FAILED, failures={1: SimpleNamespace(exitcode=code)})])
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: next(found))
    monkeypatch.setattr(LocalElasticAgent, "_initialize_workers", lambda self, group: None)
    stopping.install(lambda: True)
    agent = SimpleNamespace(_pcontext=None)
    LocalElasticAgent._initialize_workers(agent, "group")  # type: ignore[arg-type]
    stopping.on_stop_signal(signal.SIGTERM, None)
    with pytest.raises(SignalException):
        LocalElasticAgent._monitor_workers(agent, "group")  # type: ignore[arg-type]
    assert last.first == signal.SIGTERM


def test_a_failed_group_that_restarts_is_stopped_when_its_workers_would_start_again(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = agent_with([WorkerState.FAILED], monkeypatch, ended=True)
    stopping.on_stop_signal(signal.SIGTERM, None)
    LocalElasticAgent._monitor_workers(agent, "group")  # type: ignore[arg-type]
    with pytest.raises(SignalException):
        LocalElasticAgent._initialize_workers(agent, "group")  # type: ignore[arg-type]  # torch's restart
    assert last.first == signal.SIGTERM


def test_a_stop_signal_while_every_worker_runs_raises_at_once(last: stopping.SignalShutdown,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    agent_with([], monkeypatch, ended=False)
    with pytest.raises(SignalException):
        stopping.on_stop_signal(signal.SIGTERM, None)


def test_after_the_group_succeeded_a_stop_signal_is_no_longer_held_for_the_monitor(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's exit barrier after success: no look of the monitor follows to raise a held signal."""
    agent = agent_with([WorkerState.SUCCEEDED], monkeypatch, ended=True)
    LocalElasticAgent._monitor_workers(agent, "group")  # type: ignore[arg-type]
    with pytest.raises(SignalException):
        stopping.on_stop_signal(signal.SIGTERM, None)


def test_a_popen_worker_that_exited_is_seen_without_reaping_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(13)"])
    watched = handler.Watched(proc, {})
    deadline = time.monotonic() + 30
    while not watched.ended_unstopped():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert proc.returncode is None and watched.wait() == 13  # torchrun's poll still learns its code
    watched.stopping = True
    assert not watched.ended_unstopped()  # ended by torchrun's doing: no news


def test_the_node_file_names_the_node_and_the_run_and_holds_the_time_and_the_code(tmp_path: Path) -> None:
    env = {"DDPKIT_RECORDS": str(tmp_path / "rec"), "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node2",
           "SLURM_RESTART_COUNT": "1"}
    nodefailure.leave(13, 1700000000.25, env)
    written = tmp_path / "rec" / "node2.run1.failed"
    assert written.read_text() == "1700000000250000 13\n"
    assert [p.name for p in (tmp_path / "rec").iterdir()] == ["node2.run1.failed"]  # no part left
    assert nodefailure.path_for({**env, "SLURM_RESTART_COUNT": ""}) == tmp_path / "rec" / "node2.run0.failed"
    # not a Slurm job (compose, Kubernetes: a folder in each container), or no folder: nothing
    assert nodefailure.path_for({"DDPKIT_RECORDS": str(tmp_path / "rec")}) is None
    assert nodefailure.path_for({"SLURM_JOB_ID": "7"}) is None


WORKER = """\
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
if sys.argv[2] == "fail":
    os._exit(13)
time.sleep(120)
"""


def start_agent(tmp: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    """One agent, one worker; its monitor looks every 5 s, so the stop signal below comes between
    the worker's end and the monitor's look. The worker's pid once it started."""
    (tmp / "worker.py").write_text(WORKER)
    started = tmp / "started"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "DDPKIT_RECORDS": str(tmp / "rec"),
           "SLURM_JOB_ID": "5", "SLURMD_NODENAME": "node1"}
    env.pop("SLURM_RESTART_COUNT", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "ddpkit.agent", "--nnodes=1", "--nproc-per-node=1", "--master-addr=127.0.0.1",
         f"--master-port={free_port()}", "--monitor-interval=5", "--signals-to-handle=SIGTERM,SIGINT",
         str(tmp / "worker.py"), str(started), mode], cwd=tmp, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (started.exists() and started.read_text()):
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
        time.sleep(0.05)
    return agent, int(started.read_text())


@pytest.mark.slow
def test_an_agent_signalled_after_its_worker_failed_ends_with_the_workers_code(tmp_path: Path) -> None:
    agent, worker = start_agent(tmp_path, "fail")
    while Path(f"/proc/{worker}").exists():  # ended, and reaped by the zygote
        time.sleep(0.02)
    agent.send_signal(signal.SIGTERM)  # srun's --kill-on-bad-exit, before the monitor's look
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == ExitCode.STALLED, err[-3000:]
    assert "SIGTERM: its worker stopped" not in err, err[-3000:]
    at, code = (tmp_path / "rec" / "node1.run0.failed").read_text().split()
    assert code == "13" and abs(int(at) / 1e6 - time.time()) < 60


@pytest.mark.slow
def test_an_agent_signalled_while_its_worker_runs_is_stopped_and_leaves_no_failure(tmp_path: Path) -> None:
    """The control: a healthy node stopped by srun ends as stopped."""
    agent, _ = start_agent(tmp_path, "run")
    agent.send_signal(signal.SIGTERM)
    out, err = agent.communicate(timeout=120)
    assert agent.returncode != ExitCode.STALLED and "ddpkit.agent: node 0: SIGTERM: its worker stopped" in err, \
        err[-3000:]
    assert not (tmp_path / "rec" / "node1.run0.failed").exists()


def test_once_the_agents_end_is_settled_a_stop_signal_cannot_change_its_exit_status() -> None:
    """Python puts the default action back as it finalizes; srun's SIGTERM then killed an agent that had
    decided on 13 (`srun: error: node1: task 0: Terminated`, status 143)."""
    code = ("import os, signal, atexit; from ddpkit.agent import stopping; stopping.settled(); "
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM)); os.kill(os.getpid(), signal.SIGTERM); "
            "raise SystemExit(13)")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 13, done.stderr
