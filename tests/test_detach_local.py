"""`ddpkit launch local --detach` on real processes (docs/guides/runs.md,
"A detached run"): the command returns at once with the run's name; the
run's supervisor lives in a session of its own, so closing the terminal
that started it (SIGHUP, then SIGKILL, to the shell's whole process group)
does not end the job, which completes with its end recorded in the run
folder; `ddpkit status`, `logs --follow`, `report` and `cancel` reach it
by name, and a cancel leaves nothing of the run running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpkit.runs import RunState, all_runs
from ddpkit.shared import envnames
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import TINY
from tests.test_runs import ROOT, ddpkit

DETACHED = r"launch local: run (\S+)-(\w{6}) detached: supervised by pid (\d+) on \S+, which outlives this terminal"


def job(name: str, *train: str) -> list[str]:
    """launch local's arguments: 2 nodes x 1 process of the tiny ddpkit train job, detached."""
    return ["--set", f"name={name}", "--nodes", "2", "--nproc-per-node", "1", "--grace", "3", "--detach", "--",
            *TINY, "--data", "synthetic", "--batch-size", "4", "--no-eval", "--log-every", "1", *train]


def env_of(runs_dir: Path) -> dict[str, str]:
    return {**os.environ, "DDPKIT_RUNS_DIR": str(runs_dir), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}",
            "OMP_NUM_THREADS": "1"}


def left_of(run_id: str) -> list[int]:
    """Every process still running with the run's id in its environment (its agents and workers)."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get(envnames.DDPKIT_RUN_ID) == run_id:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def alive(pid: int) -> bool:
    """Running (a process that ended, awaiting its parent's wait(), is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_all(run_id: str, supervisor: int) -> None:
    """After a failed test: nothing of the run left running."""
    for pid in [supervisor, *left_of(run_id)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _hangs_up_as_a_terminal() -> None:
    """SIGHUP's default action (the end) in the terminal's shell, as an
    interactive one has it, even when this test runs under nohup (which
    every child would otherwise inherit: the shell would outlive the hangup
    and the supervisor would ignore it whether or not it is detached)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.slow
def test_a_detached_run_outlives_its_terminal_and_completes(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    # The terminal: an interactive shell in a session of its own that ran the command and stays open.
    terminal = subprocess.Popen(
        ["bash", "-c", f'{sys.executable} -m ddpkit.cli launch local "$@"; echo "RETURNED $?"; exec sleep 600',
         "bash", *job("cut", "--synthetic-size", "256", "--epochs", "2")],
        env=env_of(runs_dir), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=_hangs_up_as_a_terminal)
    began = time.monotonic()
    assert terminal.stdout is not None
    said = []
    for line in terminal.stdout:
        said.append(line)
        if line.startswith("RETURNED"):
            break
    returned = time.monotonic() - began
    text = "".join(said)
    found = re.search(DETACHED, text)
    assert found and said[-1] == "RETURNED 0\n", text
    run_id, supervisor = found.group(2), int(found.group(3))
    try:
        assert f"follow it with `ddpkit logs {run_id} --follow`" in text, text
        # The terminal closed: SIGHUP to its process group, and whatever survived it killed.
        os.killpg(terminal.pid, signal.SIGHUP)
        terminal.wait(10)
        with _no_such_group():
            os.killpg(terminal.pid, signal.SIGKILL)
        status = ddpkit(runs_dir, "status", run_id)
        assert status.returncode == 0 and f"run {run_id}: running" in status.stdout, status.stdout + status.stderr
        assert alive(supervisor) and os.getsid(supervisor) == supervisor  # a session of its own
        followed = ddpkit(runs_dir, "logs", run_id, "--follow", timeout=240)
        assert followed.returncode == 0, followed.stderr
        assert re.search(r"\[node0 rank0\] ddpkit train finished: \d+ steps, 2 epochs, world size 2", followed.stdout)
        # It ends as the attached console does: the summary table, then the closing line, last.
        assert followed.stdout.rstrip().splitlines()[-1] == "launch local: every node finished", followed.stdout[-2000:]
        assert "node0" in followed.stdout.rstrip().splitlines()[-4], followed.stdout[-2000:]
        (run,) = all_runs(runs_dir)
        record = run.folder.record()
        assert (record.state, record.exit_code) == (RunState.FINISHED, 0), record
        assert record.summary is not None and record.summary.closing == "launch local: every node finished"
        console = run.folder.console_file.read_text()
        assert console.rstrip().splitlines()[-1] == "launch local: every node finished", console[-2000:]
        assert [e.kind for e in run.folder.events()] == ["start", "detached", "exit"]
        report = ddpkit(runs_dir, "report", run_id, "-o", str(tmp_path / "page.html"), timeout=180)
        assert report.returncode == 0 and (tmp_path / "page.html").stat().st_size > 0, report.stdout + report.stderr
        assert not alive(supervisor) and left_of(run_id) == []
    finally:
        kill_all(run_id, supervisor)
    print(f"DETACH local: the command returned in {returned:.1f} s; terminal cut; the run finished "
          f"{record.ended - record.started:.1f} s after its start")


class _no_such_group:
    """The group may be gone already: the shell was its last member."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is ProcessLookupError


@pytest.mark.slow
def test_cancel_of_a_detached_run_stops_it_and_leaves_nothing_running(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "local",
                           *job("long", "--synthetic-size", "64", "--epochs", "100000")],
                          env=env_of(runs_dir), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    found = re.search(DETACHED, done.stdout)
    assert done.returncode == 0 and found, done.stdout + done.stderr
    run_id, supervisor = found.group(2), int(found.group(3))
    try:
        (run,) = all_runs(runs_dir)
        deadline = time.monotonic() + 180
        while not any(re.search(r"\[rank0\]:step \d+", Path(log.path).read_text())
                      for log in run.folder.record().logs if Path(log.path).exists()):
            assert alive(supervisor), run.folder.console_file.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step in node 0's log within 180 s"
            time.sleep(0.2)
        running = left_of(run_id)
        cancel = ddpkit(runs_dir, "cancel", run_id, timeout=200)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert cancel.stdout.splitlines()[-1] == f"ddpkit cancel: run {run_id} cancelled (launcher exit code 130)"
        assert len(running) >= 4 and left_of(run_id) == [] and not alive(supervisor), running
        record = run.folder.record()
        assert (record.state, record.exit_code) == (RunState.CANCELLED, ExitCode.INTERRUPTED)
        console = run.folder.console_file.read_text()
        assert "launch local: interrupted; stopped all nodes" in console.rstrip().splitlines()[-1], console[-2000:]
    finally:
        kill_all(run_id, supervisor)


@pytest.mark.slow
def test_a_cancel_right_after_the_detach_returns_cancels_the_run_cleanly(tmp_path: Path) -> None:
    """The detach returns only once the supervisor holds its stop signals: a
    cancel at once is a clean cancel (130, every node stopped), never an
    abandoned run whose supervisor died before it handled SIGTERM."""
    runs_dir = tmp_path / "runs"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "local",
                           *job("early", "--synthetic-size", "64", "--epochs", "100000")],
                          env=env_of(runs_dir), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    returned = time.monotonic() - began
    found = re.search(DETACHED, done.stdout)
    assert done.returncode == 0 and found, done.stdout + done.stderr
    run_id, supervisor = found.group(2), int(found.group(3))
    try:
        cancel = ddpkit(runs_dir, "cancel", run_id, timeout=120)
        assert cancel.stdout.splitlines()[-1] == f"ddpkit cancel: run {run_id} cancelled (launcher exit code 130)", \
            cancel.stdout + cancel.stderr
        assert cancel.returncode == 0
        (run,) = all_runs(runs_dir)
        record = run.folder.record()
        assert (record.state, record.exit_code) == (RunState.CANCELLED, ExitCode.INTERRUPTED), record
        assert record.summary is not None and record.summary.closing.startswith("launch local: interrupted")
        console = run.folder.console_file.read_text()
        assert "launch local: interrupted; stopped all nodes" in console.rstrip().splitlines()[-1], console[-2000:]
        assert not alive(supervisor) and left_of(run_id) == []
    finally:
        kill_all(run_id, supervisor)
    print(f"DETACH local: returned in {returned:.1f} s; cancelled at once: {record.state.value}, "
          f"exit {record.exit_code}")


def test_a_refused_detached_launch_is_refused_on_the_terminal_and_starts_nothing(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "local", "--detach", "--set",
                           "secrets=[DDPKIT_TEST_NEVER_SET]"], env=env_of(runs_dir), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == ExitCode.BAD_INPUT, done.stdout + done.stderr
    assert "DDPKIT_TEST_NEVER_SET" in done.stderr and "detached" not in done.stdout
    assert all_runs(runs_dir) == []
