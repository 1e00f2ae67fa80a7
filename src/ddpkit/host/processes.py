"""Facts about this host's processes that more than one layer asks for,
read through psutil: whether a process's environment holds a variable, when
a process started, whether it is stopped, and how often its main thread gave
up the CPU; and the one rule that ties a child's life to its parent's
(die_with).

A leaf: it imports nothing of the package, so the launcher and the trainer
(which must start without the job spec) may both use it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def environ_has(pid: int, name: str, value: str) -> bool:
    """True when process `pid` runs with name=value in its environment; False
    when it does not, has ended, or is not ours to read."""
    try:
        return bool(psutil.Process(pid).environ().get(name) == value)
    except psutil.Error:
        return False


def start_ticks(pid: int) -> int | None:
    """The process's start in clock ticks after boot (field 22 of
    /proc/PID/stat): with the pid it names one process even after the pid is
    reused. None when no such process runs (a zombie has ended: None too).

    psutil adds /proc/stat's boot time (whole seconds) to the ticks; taking
    the same boot time off again gives the kernel's count back exactly."""
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        since_boot = float(proc.create_time() - psutil.boot_time())
    except psutil.Error:
        return None
    return round(since_boot * os.sysconf("SC_CLK_TCK"))


def is_stopped(pid: int) -> bool:
    """True when process `pid` is stopped (SIGSTOP, a terminal's Ctrl-Z, a
    debugger's stop): it acts on no signal but SIGKILL and SIGCONT until it is
    continued. False when it runs, sleeps, has ended or is not ours to read."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def voluntary_switches(pid: int) -> int:
    """How often process `pid`'s main thread gave up the CPU of its own accord
    (0 where psutil cannot tell). Linux counts the switches per thread, and
    psutil reads them from /proc/PID/status, which holds the main thread's
    own (the task whose id is the pid), not the sum over the process's threads."""
    try:
        return int(psutil.Process(pid).num_ctx_switches().voluntary)
    except (psutil.Error, NotImplementedError):
        return 0


def die_with(parent: int) -> None:
    """SIGKILL this process as soon as process `parent` ends (Linux; elsewhere
    nothing). If this process's parent is another one by now, `parent` already
    ended (the orphan was handed on at once, even while the old parent waits
    as a zombie), so this process ends now."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(0)
