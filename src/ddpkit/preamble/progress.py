"""Progress without code, for the hang watchdog (docs/guides/hangs.md).

- A training step is an optimizer step: torch's global optimizer-step hook
  counts the steps of the first optimizer that steps (a program with a
  generator's and a critic's optimizer makes one step per iteration, not
  two); a step of any other optimizer is a sign of life. Gradient
  accumulation steps the optimizer once per step, and a step GradScaler
  skips is not counted (the main thread's calls keep the rank alive). The
  watchdog starts once the program's process group exists, in start-up
  (startup.py: a rank still starting while the others wait for it is named
  after first_step_s); the first counted step says it is on. A program
  whose ranks never wait for one another in start-up and never step an
  optimizer is never judged.
- `torch.save` runs in the checkpoint phase (the longer first-step limit).
- Between steps (an evaluation, a long checkpoint of another library), a
  daemon thread looks at the main thread once a second: when the functions
  on its call stack changed, or it gave up the CPU again and again (it
  waits on I/O, sleeps, or waits for its intra-op threads: the voluntary
  context switches Linux counts per thread), the rank is alive. A rank
  blocked in a collective, spinning in a loop that calls nothing, or
  frozen, shows neither: that is what a stall looks like, and it stays one.
- At exit the rank says it is done (a finished rank is not a stalled one).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any

from .. import processes, watchdog
from ..train.watchdog import stall_model as _wd
from . import metrics, startup

SAMPLE_S = 1.0
# A thread blocked in a collective gives up the CPU once and stays blocked; one that
# sleeps, reads or waits for its intra-op threads between samples does it again and again.
SWITCHES_ALIVE = 3


class StepCounter:
    """Counts the steps of the first optimizer that steps."""

    def __init__(self) -> None:
        self.primary: int | None = None
        self.steps = 0
        self.sampler: LivenessSampler | None = None

    def after_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.primary is None:
            self.primary = id(optimizer)
        if id(optimizer) != self.primary:
            _wd.mark(_wd.PULSE.phase)
            return
        self.steps += 1
        watchdog.auto_progress(self.steps)
        metrics.RECORDER.on_step(self.steps)
        self._sample()

    def watch_start_up(self) -> None:
        """The program's process group exists: watch its start-up from now on."""
        watchdog.watch_start_up()
        self._sample()

    def _sample(self) -> None:
        if self.sampler is None and watchdog.watching():  # no watchdog (one process, stall_s 0): no one to tell
            self.sampler = LivenessSampler(threading.main_thread())
            self.sampler.start()


class LivenessSampler(threading.Thread):
    """Counts a sign of life whenever the main thread's stack of functions
    changed or it kept giving up the CPU."""

    def __init__(self, watched: threading.Thread, every_s: float = SAMPLE_S) -> None:
        super().__init__(name="ddpkit-liveness", daemon=True)
        self.watched, self.every_s = watched, every_s
        self._stop = threading.Event()

    def run(self) -> None:
        last: tuple[tuple[CodeType, ...], int] | None = None
        while not self._stop.wait(self.every_s):
            if not watchdog.watching():  # ddpkit train's watchdog took over: its loop reports for itself
                return
            frame = sys._current_frames().get(self.watched.ident or -1)
            if _wd.PULSE.phase in _wd.START_UP:
                startup.follow(frame)
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


def install(env: Mapping[str, str]) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    counter = StepCounter()
    register_optimizer_step_post_hook(counter.after_step)
    startup.install(counter.watch_start_up)
    save = torch.save

    def checkpointing_save(*args: Any, **kwargs: Any) -> Any:
        with _wd.in_phase(_wd.Phase.CHECKPOINT):
            return save(*args, **kwargs)

    checkpointing_save.__wrapped__ = save  # type: ignore[attr-defined]
    checkpointing_save.__doc__ = save.__doc__
    torch.save = checkpointing_save
    atexit.register(_done, counter)


def _done(counter: StepCounter) -> None:
    if counter.sampler is not None:
        counter.sampler.stop()
    watchdog.stop()
