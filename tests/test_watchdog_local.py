"""The hang watchdog on real processes: `ddpkit launch local`, 2 nodes x 2
processes of `ddpkit train` (torchrun agents, gloo). A worker is frozen with
SIGSTOP or spins in a Python loop inside forward; the job must stop within
stall_s + 30 s with every process gone, exit 13, and name the rank. A long
first step and a long evaluation must not be taken for a stall."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ddpkit.launch.supervise import proctree
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.rank_table import pid_of
from tests.test_launch_local import _gone, clean_env, launch_argv
from tests.test_startup import ROOT

STALL_S = 6
# Enough data that the job is still training when the fault comes (the fault ends it).
TRAIN = ["--image-size", "8", "--workers", "0", "--progress", "plain", "--log-every", "1", "--data", "synthetic",
         "--batch-size", "4", "--eval-size", "64"]
pytestmark = pytest.mark.slow


class Launch:
    """`ddpkit launch local` in the background, its output collected line by line."""

    def __init__(self, tmp: Path, model: str, *train: str, **env: str) -> None:
        self.tmp = tmp
        argv = launch_argv("--nodes", "2", "--nproc-per-node", "2", "--grace", "5",
                           "--set", f"watchdog.stall_s={STALL_S}", "--", "--model", model, *TRAIN, *train,
                           "--log-dir", str(tmp / "logs"), "--metrics", str(tmp / "metrics.jsonl"))
        self.proc = subprocess.Popen(argv, env=clean_env(**env), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self.pids: set[int] = set()
        self.left: list[int] | None = None  # what of the job still ran when the launcher exited (finish)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, pattern: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        with self._seen:
            while not any(re.search(pattern, line) for line in self.lines):
                if self.proc.poll() is not None or not self._seen.wait(max(deadline - time.monotonic(), 0)):
                    raise AssertionError(f"never saw {pattern!r}:\n{self.text}")

    def remember_pids(self) -> None:
        self.pids |= set(proctree.descendants(self.proc.pid))

    def worker_pid(self, rank: int) -> int:
        pid = pid_of(self.lines, rank)
        assert pid is not None and pid in self.pids, f"no row for rank {rank} in the rank table:\n{self.text}"
        return pid

    def finish(self, timeout: float) -> int:
        """The launcher's exit code; `left` is taken before the clean-up kills what it left."""
        try:
            code = self.proc.wait(timeout)
            self.left = [pid for pid in sorted(self.pids) if not _gone(pid)]
            return code
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Whatever happens, leave nothing running (a stopped process first gets SIGCONT)."""
        self.remember_pids()
        left = proctree.alive(sorted(self.pids))
        proctree.signal_all(left, signal.SIGCONT)
        proctree.signal_all(left, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def text(self) -> str:
        with self._seen:
            return "".join(self.lines)

    def stall_records(self) -> list[dict]:
        path = self.tmp / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in records if r["kind"] == "stall"]


def test_sigstop_of_one_worker_stops_the_job_and_names_the_rank(tmp_path: Path) -> None:
    job = Launch(tmp_path, "tiny", "--synthetic-size", "200000", "--epochs", "1")
    try:
        job.wait_for(r"\[node0 rank0\].*step 3\b")  # training, past the first steps
        job.remember_pids()
        frozen = job.worker_pid(3)
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        code = job.finish(timeout=STALL_S + 150)  # the bound is asserted below; this only ends a broken run
        took = time.monotonic() - t0
    finally:
        job.cleanup()
    text = job.text
    assert code == ExitCode.STALLED, text
    assert took < STALL_S + 60, f"{took:.0f}s from SIGSTOP to the end of the job\n{text}"
    assert job.left == [], text
    assert "the hang watchdog found stalled rank(s): rank 3 (node 1" in text
    assert re.search(r"node1\s*│\s*\S+\s*│\s*stalled", text), text
    assert re.search(rf"STALL rank 3 node 1 host \S+ pid {frozen}: step \d+, phase \w+, frozen", text), text
    [record] = job.stall_records()
    assert [(s["rank"], s["pid"]) for s in record["stalled"]] == [(3, frozen)]
    assert record["stalled"][0]["frozen_s"] >= 5 and record["no_stack"] == [3]
    for rank in (0, 1, 2):  # every rank that could dump itself did
        assert "Thread 0x" in (tmp_path / "logs" / f"stall-rank{rank}.txt").read_text()


def test_a_rank_stuck_before_its_first_step_is_named_with_its_stack(tmp_path: Path) -> None:
    """Rank 3's model build reads a named pipe nobody writes (a hung filesystem) while ranks 0-2
    wait in their first step's all-reduce. Before, the verdict named the waiting ranks; without the
    watchdog the job would wait out the collective timeout (--dist-timeout, 1800 s by default)."""
    fifo = tmp_path / "hung-checkpoint"
    os.mkfifo(fifo)
    job = Launch(tmp_path, "tests.helpers.stall_models:stuck_in_start_up", "--synthetic-size", "64", "--epochs", "1",
                 STALL_TEST_RANK="3", STALL_TEST_FIFO=str(fifo))
    try:
        job.wait_for(r"ddpkit watchdog: on")
        job.remember_pids()
        t0 = time.monotonic()
        code = job.finish(timeout=STALL_S * 5 + 240)  # the bound is asserted below; this only ends a broken run
        took = time.monotonic() - t0
    finally:
        job.cleanup()
    text = job.text
    assert code == ExitCode.STALLED, text
    assert job.left == [], text
    assert took < 300, f"{took:.0f}s from the watchdog's start to the end of the job\n{text}"  # vs 1800 s
    assert "the hang watchdog found stalled rank(s): rank 3 (node 1" in text, text
    assert re.search(r"STALL rank 3 node 1 host \S+ pid \d+: step 0, phase setup, at \S+stall_models\.py:\d+ "
                     r"in read_from_a_hung_filesystem", text), text
    [record] = job.stall_records()
    assert [s["rank"] for s in record["stalled"]] == [3] and record["waiting"] == [0, 1, 2], record
    lines = text.rstrip("\n").splitlines()
    assert "stalled" in lines[-1] and "rank 3" in " ".join(lines[-3:]), lines[-3:]


@pytest.mark.full  # test_watchdog_local.py::test_long_first_step_and_long_evaluation_are_no_stall
def test_a_rank_slow_in_its_start_up_but_moving_is_named_slow_not_stopped(tmp_path: Path) -> None:
    """The control of the test above: rank 3's model build reads slowly (short sleeps) for longer
    than first_step_s while ranks 0-2 wait for it; the job goes on and trains to the end."""
    first_step_s = 5 * STALL_S
    job = Launch(tmp_path, "tests.helpers.stall_models:slow_in_start_up", "--synthetic-size", "64", "--epochs", "1",
                 STALL_TEST_RANK="3", STALL_TEST_SLEEP_S=str(first_step_s + 15))
    try:
        code = job.finish(timeout=first_step_s + 240)
    finally:
        job.cleanup()
    text = job.text
    assert code == 0, text
    assert "the job stalled" not in text and "ddpkit watchdog: STALL" not in text, text
    assert re.search(r"ddpkit watchdog: rank 3 \(node 1, \S+\) is still starting up \d+s after the others began to "
                     r"wait for it; it moves, so it is slow, not stuck", text), text
    assert job.stall_records() == []


def test_python_loop_in_forward_is_shown_in_the_stack_dump(tmp_path: Path) -> None:
    job = Launch(tmp_path, "tests.helpers.stall_models:stuck_forward", "--synthetic-size", "200000",
                 "--epochs", "1", STALL_TEST_RANK="1", STALL_TEST_CALL="6")
    try:
        job.wait_for(r"\[node0 rank0\].*step 3\b")
        job.remember_pids()
        code = job.finish(timeout=STALL_S + 150)
    finally:
        job.cleanup()
    text = job.text
    assert code == ExitCode.STALLED, text
    assert job.left == [], text
    assert re.search(r"STALL rank 1 node 0 host \S+ pid \d+: step 5, phase forward, at \S+stall_models\.py:\d+ "
                     r"in spin_in_forward", text), text
    assert re.search(r"node0\s*│\s*\S+\s*│\s*stalled", text), text
    dump = (tmp_path / "logs" / "stall-rank1.txt").read_text()
    assert re.search(r'File "\S+stall_models\.py", line \d+ in spin_in_forward', dump), dump
    [record] = job.stall_records()
    assert [s["rank"] for s in record["stalled"]] == [1] and "spin_in_forward" in record["stalled"][0]["frame"]
    assert record["waiting"] == [0, 2, 3] and record["no_stack"] == []


def test_long_first_step_and_long_evaluation_are_no_stall(tmp_path: Path) -> None:
    # first step 2 x stall_s (under first_step_s = 5 x stall_s); eval 16 batches x 1 s on each rank > stall_s
    job = Launch(tmp_path, "tests.helpers.stall_models:slow_first_step", "--synthetic-size", "240", "--epochs", "1",
                 "--eval-size", "256",
                 STALL_TEST_SLEEP_S=str(2 * STALL_S), STALL_TEST_EVAL_SLEEP_S="1")
    try:
        code = job.finish(timeout=300)
    finally:
        job.cleanup()
    text = job.text
    assert code == 0, text
    assert f"ddpkit watchdog: on: a rank without progress for {STALL_S}s" in text  # it was watching
    assert "eval at step" in text and "the job stalled" not in text and "ddpkit watchdog: STALL" not in text
    assert job.stall_records() == []


@pytest.mark.full  # a frozen rank of a program of the user's own: test_preamble.py
def test_a_users_own_script_reports_progress_and_the_stuck_rank_is_found(tmp_path: Path) -> None:
    script = ROOT / "tests" / "helpers" / "user_loop.py"
    argv = launch_argv("--nodes", "2", "--nproc-per-node", "2", "--grace", "5", "--set", f"command.script={script}",
                       "--set", f"watchdog.stall_s={STALL_S}")
    res = subprocess.run(argv, env=clean_env(STALL_RANK="2", STALL_STEP="30", PYTHONPATH=str(ROOT / "src")), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode == ExitCode.STALLED, text
    assert "stall detection is off" not in text  # the script reports its own steps; the preamble stands aside
    assert "ddpkit watchdog: on for this script" in text
    assert re.search(r"STALL rank 2 node 1 host \S+ pid \d+: step 29, phase train, at \S+user_loop\.py:\d+ "
                     r"in stuck_in_user_code", text), text
