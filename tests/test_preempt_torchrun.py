"""Pre-emption through a real torchrun agent (no scheduler): the launch line
every torchrun target renders (contract.torchrun_argv, with stop_args) makes
the agent forward SIGUSR2 to its workers, which checkpoint, write the `stop`
record and exit 75. torchrun's default signal list, which the Slurm script's
old TORCHELASTIC_SIGNALS_TO_HANDLE export could not change, lets SIGUSR2 kill
the agent: no checkpoint, and the workers end with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.contract import RowKey, sources, stop_args, torchrun_argv
from ddpkit.launch.local import free_port
from ddpkit.shared import envnames
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.spec import JobSpec
from tests.helpers.runs import ROOT, TINY, cmdline, metrics, orphans_in, processes_in

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

EXIT_DIR = "DDPKIT_TEST_EXIT_DIR"
STOPPED = r"ddpkit.agent: node 0: SIGUSR2: its 2 workers stopped \(exit 75\); SIGTERM too, while stopping"


def job(tmp: Path, *, checkpoint_s: int = 20) -> JobSpec:
    train = [*TINY, "--data", "synthetic", "--synthetic-size", "4096", "--batch-size", "4", "--epochs", "50",
             "--no-eval", "--log-every", "1", "--checkpoint-dir", str(tmp / "ckpt"),
             "--metrics", str(tmp / "metrics.jsonl"), "--log-dir", str(tmp / "logs")]
    return JobSpec(name="preempt-local", nodes=1, nproc_per_node=2, device="cpu", backend="gloo",
                   master_port=free_port(), preemption={"checkpoint_s": checkpoint_s},
                   command={"python": sys.executable, "module": "tests.helpers.exit_code", "args": train})


def launch_line(spec: JobSpec, *, with_stop_args: bool) -> list[str]:
    """The local target's rendered torchrun line, resolved as node 0 would;
    without stop_args it is the line before this change."""
    argv = torchrun_argv(spec, sources(spec, RowKey.LOCAL))
    if not with_stop_args:
        argv = [a for a in argv if a not in stop_args(spec)]
    return [a.resolve({envnames.DDPKIT_NODE_RANK: "0"}) for a in argv]


def start(tmp: Path, argv: list[str]) -> subprocess.Popen[bytes]:
    (tmp / "exit").mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", EXIT_DIR: str(tmp / "exit")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        env.pop(name, None)
    with open(tmp / "agent.out", "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)


def wait_for_training(tmp: Path, agent: subprocess.Popen[bytes], step: int = 3, timeout: float = 150) -> None:
    """Until rank 0 logged `step`: the handlers are installed and training runs."""
    deadline = time.monotonic() + timeout
    while not any(r["kind"] == "train" and r["step"] >= step for r in metrics(tmp / "metrics.jsonl")):
        assert agent.poll() is None, (tmp / "agent.out").read_text()[-4000:]
        assert time.monotonic() < deadline, f"no step {step} in {timeout} s"
        time.sleep(0.1)


def kill_leftovers(tmp: Path) -> list[int]:
    left = processes_in(tmp)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def test_rendered_line_forwards_sigusr2_to_the_workers(tmp_path: Path) -> None:
    spec = job(tmp_path)
    argv = launch_line(spec, with_stop_args=True)
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in argv
    assert f"--shutdown-timeout={spec.grace.shutdown_s}" in argv
    agent = start(tmp_path, argv)
    try:
        wait_for_training(tmp_path, agent)
        agent.send_signal(signal.SIGUSR2)  # the agent only, as a scheduler that signals the launcher does
        sent = time.time()
        # and SIGTERM while its workers checkpoint, as Slurm sends every process of a job it requeues:
        # the agent goes on waiting for them, where torch's handler raised again and gave up on them
        time.sleep(0.02)
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(spec.grace.shutdown_s + 60)
        print(f"PREEMPT-TIMING torchrun SIGUSR2 -> agent exit {time.time() - sent:.1f} s")
    finally:
        left = kill_leftovers(tmp_path)
    log = (tmp_path / "agent.out").read_text()
    assert left == [], f"processes left: {left}\n{log[-4000:]}"
    # the agent forwarded SIGUSR2 to each worker, which checkpointed and exited 75: so does the agent (torchrun's
    # own end is 1), with one line that says so, none of torch's traceback or shutdown warnings
    assert code == ExitCode.PREEMPTED, log[-4000:]
    said = [line for line in log.splitlines() if line.startswith("ddpkit.agent:")]
    assert len(said) == 1 and re.fullmatch(STOPPED, said[0]), log[-4000:]
    for chatter in ("Traceback", "SignalException", "death signal", "closing signal"):
        assert chatter not in log, log[-4000:]
    assert "forcefully exiting via" not in log  # every worker ended within --shutdown-timeout
    codes = {p.name: int(p.read_text()) for p in (tmp_path / "exit").glob("rank*.code")}
    assert codes == {"rank0.code": ExitCode.PREEMPTED, "rank1.code": ExitCode.PREEMPTED}, log[-4000:]
    records = metrics(tmp_path / "metrics.jsonl")
    (stop,) = [r for r in records if r["kind"] == "stop"]
    assert stop["signal"] == "SIGUSR2" and stop["slurm_restart_count"] == 0
    # the checkpoint the stop path wrote is the job's latest, at the stop step
    assert stop["checkpoint"] == str(tmp_path / "ckpt" / f"ckpt-{stop['step']:08d}.pt")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == Path(stop["checkpoint"]).name
    assert [r["status"] for r in records if r["kind"] == "summary"] == ["preempted"]


def test_torchruns_default_signals_let_sigusr2_kill_the_agent(tmp_path: Path) -> None:
    """The line before this change: SIGUSR2 ends the agent at once (its default
    action), nothing is forwarded, no checkpoint, and the workers end with it
    (SIGKILLed through their zygote: torchrun's own Popen workers would live on)."""
    spec = job(tmp_path)
    agent = start(tmp_path, launch_line(spec, with_stop_args=False))
    try:
        wait_for_training(tmp_path, agent)
        agent.send_signal(signal.SIGUSR2)
        code = agent.wait(60)
        orphans = orphans_in(tmp_path)
        deadline = time.monotonic() + 10  # the workers' SIGKILL follows the zygote's end
        while orphans and time.monotonic() < deadline:
            time.sleep(0.1)
            orphans = orphans_in(tmp_path)
        cmdlines = {pid: cmdline(pid) for pid in orphans}
    finally:
        kill_leftovers(tmp_path)
    assert code == -signal.SIGUSR2
    # no worker orphaned: each ended with the zygote, which ended with its agent
    assert orphans == [], [(pid, cmdlines.get(pid)) for pid in orphans]
    assert not any(r["kind"] == "stop" for r in metrics(tmp_path / "metrics.jsonl"))
    assert list((tmp_path / "exit").glob("rank*.code")) == []


def test_launch_local_gives_an_interrupt_time_to_checkpoint_and_a_failure_none(tmp_path: Path) -> None:
    """`ddpkit launch local --grace 0`: the fail-fast teardown would SIGKILL at
    once; SIGTERM to the launcher (a scheduler, a CI timeout, Ctrl-C) gets the
    grace chain's time instead, so both nodes' workers checkpoint and exit 75.
    A ResNet-18 (CPU, one thread): its stop (two steps and a 45 MB save)
    takes far longer than the instant SIGKILL of a failure's teardown."""
    train = ["--model", "resnet18", "--image-size", "32", "--workers", "0", "--progress", "plain",
             "--data", "synthetic", "--synthetic-size", "4096", "--batch-size", "16", "--epochs", "50",
             "--no-eval", "--log-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
             "--metrics", str(tmp_path / "metrics.jsonl"), "--log-dir", str(tmp_path / "logs")]
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2", "--nproc-per-node", "1",
            "--grace", "0", "--set", "command.module=ddpkit.train", "--set", "preemption.checkpoint_s=20", "--", *train]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GLOO_", "NCCL_", "DDPKIT_", "RANK", "WORLD"))
           or k == "DDPKIT_RUNS_DIR"}  # the suite's run folders (conftest), not ~/.ddpkit
    env |= {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "agent.out", "wb") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_for_training(tmp_path, launcher)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(120)
    finally:
        left = kill_leftovers(tmp_path)
    log = (tmp_path / "agent.out").read_text()
    assert code == 130 and "interrupted; stopped all nodes" in log, log[-4000:]
    assert left == [], f"processes left: {left}\n{log[-4000:]}"
    (stop,) = [r for r in metrics(tmp_path / "metrics.jsonl") if r["kind"] == "stop"]
    assert stop["signal"] == "SIGTERM"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == Path(stop["checkpoint"]).name
    for rank in (0, 1):  # each worker stopped itself at the agreed step, nobody was killed first
        assert f"checkpointing at step {stop['step']} " in (tmp_path / "logs" / f"rank{rank}.log").read_text()
