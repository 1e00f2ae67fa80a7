"""ddpkit/host/processes.py on real processes: the start ticks are the kernel's
own count (field 22 of /proc/PID/stat, what a run's launcher record keeps),
and an environment variable is found only where it is set."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ddpkit.host import processes

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def kernel_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_start_ticks_are_the_kernels_count_and_none_once_ended() -> None:
    assert processes.start_ticks(os.getpid()) == kernel_ticks(os.getpid())
    child = subprocess.Popen(SLEEP)
    try:
        assert processes.start_ticks(child.pid) == kernel_ticks(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        assert processes.start_ticks(child.pid) is None  # a zombie has ended
    finally:
        child.kill()
        child.wait()
    assert processes.start_ticks(child.pid) is None


def wait_exec(pid: int) -> None:
    """Until the child runs SLEEP: before its exec it still has the parent's environment."""
    deadline = time.monotonic() + 30
    while b"time.sleep(60)" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the child never ran its program"
        time.sleep(0.01)


def test_environ_has_reads_the_process_environment() -> None:
    child = subprocess.Popen(SLEEP, env={**os.environ, "DDPKIT_TEST_MARK": "a=b"})
    try:
        wait_exec(child.pid)
        assert processes.environ_has(child.pid, "DDPKIT_TEST_MARK", "a=b")
        assert not processes.environ_has(child.pid, "DDPKIT_TEST_MARK", "a")
        assert not processes.environ_has(child.pid, "DDPKIT_TEST_ABSENT", "")
    finally:
        child.kill()
        child.wait()
    assert not processes.environ_has(child.pid, "DDPKIT_TEST_MARK", "a=b")


def test_voluntary_switches_are_the_main_threads_own() -> None:
    # The liveness sampler asks about the main thread: another thread's sleeps are not counted.
    def sleeper() -> None:
        for _ in range(100):
            time.sleep(0.001)

    before = processes.voluntary_switches(os.getpid())
    thread = threading.Thread(target=sleeper)
    thread.start()
    thread.join()
    assert processes.voluntary_switches(os.getpid()) - before < 50
    for _ in range(5):
        time.sleep(0.001)
    assert processes.voluntary_switches(os.getpid()) - before >= 5
    assert processes.voluntary_switches(2**22 + 1) == 0  # beyond pid_max: no such process
