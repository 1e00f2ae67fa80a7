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
- Between steps (an evaluation, a long checkpoint of another library) and
  in start-up, the main thread's calls and waits are signs of life
  (train/watchdog/liveness.py).
- At exit the rank says it is done (a finished rank is not a stalled one).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any

from .. import watchdog
from ..train.watchdog import stall_model as _wd
from ..train.watchdog.liveness import LivenessSampler
from . import metrics, startup


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
            self.sampler = LivenessSampler(threading.main_thread(), look=look)
            self.sampler.start()


def look(frame: FrameType | None) -> bool:
    """Before each sample: follow start-up's phase; stop once ddpkit train's
    watchdog took over (its loop reports for itself)."""
    if not watchdog.watching():
        return False
    if _wd.PULSE.phase in _wd.START_UP:
        startup.follow(frame)
    return True


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
