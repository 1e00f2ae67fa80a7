"""Signs of life of a rank's main thread where it reports no step: a
daemon thread looks at the main thread once a second; when the functions on
its call stack changed, or it gave up the CPU again and again (it waits on
I/O, sleeps, or waits for its intra-op threads: the voluntary context
switches Linux counts per thread), the rank is alive, and its heartbeat
says so (`stall_model.mark`). A rank blocked in a collective, spinning in a
loop that calls nothing, or frozen, shows neither: that is what a stall
looks like, and it stays one.

A program of the user's own is sampled from its start-up on
(preamble/progress.py); `ddpkit train` during its start-up only
(`watch_start_up`), where a rank that reads its checkpoint or builds its
model slowly moves, and the ranks waiting for it are no stall."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType

from ...host import processes
from . import stall
from . import stall_model as _wd

SAMPLE_S = 1.0
# A thread blocked in a collective gives up the CPU once and stays blocked; one that
# sleeps, reads or waits for its intra-op threads between samples does it again and again.
SWITCHES_ALIVE = 3

Look = Callable[[FrameType | None], bool]  # sees the main thread's frame before a sample; False: stop sampling


class LivenessSampler(threading.Thread):
    """Counts a sign of life whenever the main thread's stack of functions
    changed or it kept giving up the CPU."""

    def __init__(self, watched: threading.Thread, every_s: float = SAMPLE_S, look: Look | None = None) -> None:
        super().__init__(name="ddpkit-liveness", daemon=True)
        self.watched, self.every_s, self.look = watched, every_s, look
        self._stop = threading.Event()

    def run(self) -> None:
        last: tuple[tuple[CodeType, ...], int] | None = None
        while not self._stop.wait(self.every_s):
            frame = sys._current_frames().get(self.watched.ident or -1)
            if self.look is not None and not self.look(frame):
                return
            stack = stack_of(frame)
            del frame  # a frame kept alive keeps its locals alive
            switches = processes.voluntary_switches(os.getpid())  # the main thread's: the watched one
            if last is not None and (stack != last[0] or switches - last[1] >= SWITCHES_ALIVE):
                _wd.mark(_wd.PULSE.phase)
            last = (stack, switches)

    def stop(self) -> None:
        self._stop.set()


def stack_of(frame: FrameType | None) -> tuple[CodeType, ...]:
    """The functions on a thread's stack, innermost first (not where in each
    they are: a loop inside one function is no progress)."""
    codes: list[CodeType] = []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    return tuple(codes)


def in_start_up(_frame: FrameType | None) -> bool:
    return _wd.PULSE.phase in _wd.START_UP


def watch_start_up() -> LivenessSampler | None:
    """`ddpkit train`'s start-up, sampled on this rank until its first step,
    where its watchdog runs (None where none does: nobody to tell)."""
    if stall.running() is None:
        return None
    sampler = LivenessSampler(threading.main_thread(), look=in_start_up)
    sampler.start()
    return sampler
