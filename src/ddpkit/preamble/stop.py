"""Pre-emption for a program of the user's own: a stop signal (SIGTERM,
SIGUSR2: the ones torchrun's agent forwards, agreed.TRAINER_STOP_SIGNALS)
reaches the program's stop handlers at the same optimizer step on every
rank, instead of killing the program mid-step.

- `ddpkit.on_stop(fn)`: once every rank agreed to stop after optimizer step
  n, `fn` runs on every rank when the program next steps its optimizer, before
  that step changes anything: the program's own counters have moved on past
  step n and the weights are step n's, so what `fn` saves is one consistent
  state. Then rank 0 asks Slurm to requeue the job where the signal asks for
  it, and the process exits 75 (EXIT_PREEMPTED) through SystemExit, so the
  program's `finally` blocks run.
- a framework's callback (ddpkit.frameworks.hf, ddpkit.frameworks.lightning)
  reads `agreed()` after each step, saves and stops through the framework,
  and ends the process with `finish()` once the framework's training ended.
- with neither, the signal does what it did without ddpkit: it ends the
  process, after one line that says no checkpoint was written.

The agreement is `ddpkit train`'s (train/stop/signals.StopAgreement): each
rank's signal all-reduced (MAX), pipelined one step behind, over the
default group when it reduces CPU tensors, else over a gloo group made at
the first optimizer step after the process group exists (a collective: every
rank makes it at the same step). A program that installs its own handler for
a signal replaces this one for that signal.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NoReturn

from ..train.stop.signals import EXIT_PREEMPTED, STOP_SIGNALS, StopAgreement, StopRequest, requeue_if_slurm

Handler = Callable[[], None]


@dataclass
class StopState:
    """This process's stop handling: what the program registered, and what the ranks agreed."""

    request: StopRequest = field(default_factory=StopRequest)
    handlers: list[Handler] = field(default_factory=list)
    framework: bool = False  # a framework's callback saves and stops
    agreement: StopAgreement | None = None
    primary: int | None = None  # id() of the first optimizer that stepped: its steps are counted
    steps: int = 0
    agreed: int | None = None  # the agreed signal, once every rank decided to stop
    installed: bool = False

    @property
    def handled(self) -> bool:
        return bool(self.handlers) or self.framework


STATE = StopState()


def install(env: Mapping[str, str] = os.environ) -> None:
    """The preamble's part: the stop handlers and the check after each optimizer
    step; on a restarted job, the line that says whether the program resumed."""
    from . import resumed

    install_once()
    resumed.install(env)


def install_once() -> None:
    """Install the handlers and the step check, once; a program run without the
    preamble gets them at its first `on_stop` or callback (before its first step,
    on every rank, so that every rank makes the agreement's group at the same step)."""
    if STATE.installed:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    take_signals()
    register_optimizer_step_post_hook(_after_step)
    register_optimizer_step_pre_hook(_before_step)
    STATE.installed = True


def take_signals() -> None:
    """Handle the stop signals here, after a framework installed handlers of its own."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def on_stop(fn: Handler) -> None:
    """Run `fn` on every rank once every rank agreed to stop (a stop signal
    reached any of them), when the program next steps its optimizer and before
    that step changes anything; the process then exits 75."""
    install_once()
    STATE.handlers.append(fn)


def attach_framework() -> None:
    """A framework's callback saves and stops the training itself."""
    STATE.framework = True


def agreed() -> bool:
    """Whether every rank agreed to stop, as of the last optimizer step."""
    return STATE.agreed is not None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    STATE.request.signum = signum
    if STATE.handled:
        return
    name = signal.Signals(signum).name
    print(f"ddpkit: {name}: the program has no stop handler (ddpkit.on_stop, or ddpkit's callback for its "
          f"Trainer), so it stops now, without a checkpoint", file=sys.stderr, flush=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _before_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if STATE.agreed is not None and id(optimizer) == STATE.primary and not STATE.framework:
        for fn in STATE.handlers:
            fn()
        finish()


def _after_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if STATE.primary is None:
        STATE.primary = id(optimizer)
    if id(optimizer) != STATE.primary or STATE.agreed is not None:
        return
    STATE.steps += 1
    signum = _agreed_signal()
    if signum is not None:
        STATE.agreed = signum
        _announce()


def _agreed_signal() -> int | None:
    """The stop signal every rank agreed on after this step, or None. The agreement
    is made at the first step once the process group exists; without one this
    process's own signal is the decision."""
    if STATE.agreement is None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return STATE.request.signum
        STATE.agreement = StopAgreement.for_run(STATE.request, distributed=dist.get_world_size() > 1)
    return STATE.agreement.signum if STATE.agreement.check() else None


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _say(line: str) -> None:
    print(f"ddpkit: {line}", file=sys.stderr, flush=True)


def _announce() -> None:
    if rank() != 0:
        return
    name = signal.Signals(STATE.agreed).name if STATE.agreed else "?"
    how = ("the program's callback saves and stops" if STATE.framework
           else "the program's stop handlers run before the next one")
    _say(f"{name}: every rank stops after optimizer step {STATE.steps}; {how}")


def finish(step: int | None = None) -> NoReturn:
    """End the process as pre-empted: rank 0 first sends the `stop` record and
    asks Slurm to requeue the job where the signal asks for it. `step`: the
    step the framework saved at (its global step, which a resumed start goes
    on counting), else the optimizer steps of this process."""
    if rank() == 0:
        record_stop(step=step)
        requeue_if_slurm(STATE.agreed, _say)
    raise SystemExit(EXIT_PREEMPTED)


def record_stop(env: Mapping[str, str] = os.environ, step: int | None = None) -> None:
    """The `stop` record, as ddpkit train's: its step is the agreed one, and its
    checkpoint what saved there (the program's stop handlers, or its Trainer).
    Sent on the records channel (records.emit: framed for the launcher, whose
    summary says `stopped, checkpoint at step N`; or the job's records folder,
    where `ddpkit status` reads it), and appended to the metrics file where
    there is one (`ddpkit report`)."""
    import time
    from pathlib import Path

    from .. import records
    from ..shared import envnames
    from ..shared.agreed import metrics_to_launcher

    saved_by = "saved by the program's Trainer" if STATE.framework else "saved by the program's stop handlers"
    name = signal.Signals(STATE.agreed).name if STATE.agreed else None
    restarts = int(env.get(envnames.SLURM_RESTART_COUNT, "0") or 0)
    record = records.Stop(name, STATE.steps if step is None else step, saved_by, restarts)
    now = time.time()
    records.emit(record, time=now)
    path = env.get(envnames.DDPKIT_METRICS)
    if path and not metrics_to_launcher(path):
        try:
            records.append(Path(path), record, now)
        except OSError:
            pass  # the metrics are the report's; the stop itself goes on
