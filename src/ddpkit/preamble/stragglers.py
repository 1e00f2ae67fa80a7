"""Stragglers in a program of the user's own: each rank's own work per
optimizer step, timed as `ddpkit train` times it (a StepClock of
train/watchdog/worktime.py: CUDA events on one CUDA device, read a step or
two later without a sync; the host's clock elsewhere) into the window the
hang watchdog's thread publishes and rank 0 judges (train/watchdog/straggler.py:
the same `watchdog.straggler_factor`, line and `straggler` record).

What counts is the work of the outermost module, a DistributedDataParallel:
- forward: the wrapped model's own forward (hooks on `ddp.module`), with
  gradients on only: DDP's buffer broadcast before it is a wait, and an
  evaluation is no step;
- backward: from the outermost `torch.autograd.backward` (Tensor.backward
  calls it) to the moment DDP hands its last gradient bucket to the
  all-reduce, noted by a comm hook around DDP's own (the program's hook where
  it registers one, else DDP's default all-reduce, the same sum of gradients
  divided by the world size); under `no_sync` the whole backward.
A step ends with the first stepping optimizer's step. Waiting in the
all-reduce, loading data and the optimizer are not counted. A program
without DDP (FSDP, its own all-reduce) times nothing and is never judged;
with a builtin comm hook (`_register_builtin_comm_hook`, in C++) registered
before its first forward only its forward is timed (after it, the builtin
hook runs as its Python twin). Nothing is wrapped where no judge reads the
times (one process, the hang watchdog off, `straggler_factor` 0): the
Python comm hook costs a thread hand-off per bucket (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..shared import envnames
from ..shared.exitcodes import ExitCode, exit_on
from ..train.watchdog.stall_model import Settings
from ..train.watchdog.straggler import WORK as WINDOW
from ..train.watchdog.straggler import WorkWindow, factor_from_env
from ..train.watchdog.worktime import Mark, StepClock

HOOKED = "_ddpkit_own_work"  # in a DDP's __dict__: whether its last bucket's hand-over is noted
MARK = "_ddpkit_bucket_mark"  # in a DDP's __dict__: its BucketMark
BUILTIN = "_ddpkit_builtin_hook"  # in a DDP's __dict__: it has a builtin (C++) comm hook, whose moments are unknown


class BucketMark:
    """A DDP's comm hook that notes the moment each bucket is handed over,
    then runs `hook` (the program's, or DDP's default all-reduce)."""

    def __init__(self, work: OwnWork, state: Any, hook: Callable[..., Any], default: bool) -> None:
        self.work, self.state, self.hook, self.default = work, state, hook, default

    def __call__(self, _state: Any, bucket: Any) -> Any:
        self.work.bucket()
        return self.hook(self.state, bucket)


class OwnWork:
    """This process's timing of its DDP models' forward and backward."""

    def __init__(self, window: WorkWindow = WINDOW) -> None:
        self.window = window  # the one the watchdog's thread publishes
        self.clock: StepClock | None = None  # made at the first training forward, where the model lives
        self.primary: int | None = None  # id() of the first optimizer that stepped: its steps are counted
        self._inner: list[Mark] | None = None  # the wrapped model's forward marks, while a forward runs
        self._bucket: Mark | None = None  # when DDP handed over the last bucket so far
        self._forwarded = False  # a timed forward since the last backward
        self._own_end = False  # that backward's end is known: a bucket mark, or no all-reduce (no_sync)
        self._depth = 0  # nested autograd.backward calls (a reentrant checkpoint's)

    # ---- DDP's forward ---------------------------------------------------------------
    def forward_begins(self, ddp: Any) -> list[Mark] | None:
        """The list the wrapped model's forward marks go to; None: not timed
        (an evaluation, or a DDP inside a timed forward)."""
        if not torch.is_grad_enabled() or self._inner is not None:
            return None
        hooked = vars(ddp).get(HOOKED)
        if hooked is None:
            hooked = vars(ddp)[HOOKED] = self._hook(ddp)
        self._own_end = hooked or not ddp.require_backward_grad_sync
        self._inner = []
        return self._inner

    def forward_ends(self, inner: list[Mark] | None) -> None:
        if inner is None:
            return
        self._inner = None
        if len(inner) >= 2 and self.clock is not None:
            self.clock.span(inner[0], inner[-1])
        self._forwarded = True

    def _inner_mark(self) -> None:
        if self._inner is not None and self.clock is not None:
            self._inner.append(self.clock.mark())

    def _hook(self, ddp: Any) -> bool:
        """At a DDP's first training forward: hooks on the model it wraps, and
        a comm hook where the program registered none. Whether its last
        bucket's hand-over is noted."""
        if self.clock is None:
            devices = {p.device for p in ddp.module.parameters()}
            self.clock = StepClock(len(devices) == 1 and next(iter(devices)).type == "cuda", self.window)
        ddp.module.register_forward_pre_hook(lambda *_: self._inner_mark())
        ddp.module.register_forward_hook(lambda *_: self._inner_mark())
        if vars(ddp).get(BUILTIN):
            return False
        if vars(ddp).get(MARK) is None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            mark = BucketMark(self, ddp.process_group, default_hooks.allreduce_hook, default=True)
            register(ddp, mark, default_hooks.allreduce_hook)
        return True

    # ---- backward, and the step -------------------------------------------------------
    def backward_begins(self) -> Mark | None:
        """The backward's start; None: not timed (nested, or no timed forward before it)."""
        self._depth += 1
        if self._depth > 1 or not self._forwarded or self.clock is None:
            return None
        self._forwarded = False
        self._bucket = None
        return self.clock.mark()

    def backward_ends(self, start: Mark | None) -> None:
        self._depth -= 1
        if start is None or self.clock is None:
            return
        end = self._bucket if self._bucket is not None else self.clock.mark() if self._own_end else None
        if end is not None:
            self.clock.span(start, end)

    def bucket(self) -> None:
        if self.clock is not None:
            self._bucket = self.clock.mark()

    def after_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.primary is None:
            self.primary = id(optimizer)
        if id(optimizer) == self.primary and self.clock is not None:
            self.clock.step_done()


WORK = OwnWork()


def register(ddp: Any, mark: BucketMark, named: Callable[..., Any]) -> None:
    """Register `mark` on DDP's reducer as DDP's register_comm_hook would."""
    import torch.distributed as dist

    hook = lambda state, bucket: mark(state, bucket)  # noqa: E731  no annotations: DDP checks them as objects
    hook.__qualname__ = getattr(named, "__qualname__", "hook")  # DDP's logging names the program's hook
    dist._register_comm_hook(ddp.reducer, mark.state, hook)  # refuses a second hook, as DDP does
    name_hook(ddp, hook.__qualname__)
    if hasattr(ddp, "_comm_hooks"):
        ddp._comm_hooks.append((hook, mark.state))
    vars(ddp)[MARK] = mark


def name_hook(ddp: Any, name: str) -> None:
    """The hook's name in DDP's logging data, as DDP's registration sets it."""
    if ddp.logger is not None:
        ddp.logger._set_comm_hook_name(name)


def python_hook(comm_hook_type: Any) -> Callable[..., Any]:
    """The Python comm hook that does what a builtin one does."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return default_hooks.allreduce_hook


def judged(env: Mapping[str, str]) -> bool:
    """Whether a straggler judge will read the times: more than one process,
    the hang watchdog on (its thread publishes them), a factor above 0. A
    setting that is no number ends the process with one line, exit 2."""
    try:
        factor, settings = factor_from_env(env), Settings.from_env(env)
    except ValueError as err:
        sys.exit(exit_on("ddpkit", err, ExitCode.BAD_INPUT))
    return factor > 0 and settings.enabled and int(env.get(envnames.WORLD_SIZE, "1") or "1") > 1


def install(env: Mapping[str, str]) -> None:
    """Time DDP's forward, the outermost backward, and the program's comm hooks,
    where a judge will read the times (nothing is wrapped otherwise)."""
    if not judged(env):
        return
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook

    forward, backward = DDP.forward, torch.autograd.backward
    register_hook, builtin = DDP.register_comm_hook, DDP._register_builtin_comm_hook

    def timed_forward(self: DDP, *inputs: Any, **kwargs: Any) -> Any:
        inner = WORK.forward_begins(self)
        try:
            return forward(self, *inputs, **kwargs)
        finally:
            WORK.forward_ends(inner)

    def timed_backward(*args: Any, **kwargs: Any) -> None:
        start = WORK.backward_begins()
        try:
            backward(*args, **kwargs)
        finally:
            WORK.backward_ends(start)

    def register_comm_hook(self: DDP, state: object, hook: Callable[..., Any]) -> None:
        self._check_comm_hook(hook)
        ours = vars(self).get(MARK)
        if ours is not None and ours.default:  # registered at the first forward: the program's takes its place
            ours.state, ours.hook, ours.default = state, hook, False
            name_hook(self, hook.__qualname__)
            return
        register(self, BucketMark(WORK, state, hook, default=False), hook)

    def register_builtin_comm_hook(self: DDP, comm_hook_type: Any) -> None:
        ours = vars(self).get(MARK)
        if ours is not None and ours.default:  # after the first forward: the same hook, in Python
            ours.hook, ours.default = python_hook(comm_hook_type), False
            name_hook(self, str(comm_hook_type))
            return
        vars(self)[BUILTIN] = True
        builtin(self, comm_hook_type)

    for new, old in ((timed_forward, forward), (timed_backward, backward), (register_comm_hook, register_hook),
                     (register_builtin_comm_hook, builtin)):
        functools.update_wrapper(new, old)
    DDP.forward = timed_forward  # type: ignore[method-assign]
    DDP.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = register_builtin_comm_hook  # type: ignore[method-assign]
    torch.autograd.backward = timed_backward
    register_optimizer_step_post_hook(WORK.after_step)
