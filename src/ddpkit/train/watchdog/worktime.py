"""A rank's own work in each training step, for the straggler judge
(train/watchdog/straggler.py). `Stepper` wraps its parts in `data()`, `forward()`
and `backward()`; what they time excludes every wait for other ranks:

- data: `next(batches)` and the copies to the device (a slow loader,
  a slow disk, the test hook below);
- forward: the model's own forward, from a pre-hook to a hook on the
  unwrapped model, so DDP's buffer broadcast and bucket rebuild before it
  (collectives: waits) are left out; the loss is added. Under `--compile`
  (hooks would break the graph) and DataParallel the whole call is timed;
- backward: from its start to the moment DDP hands the LAST gradient
  bucket to the all-reduce (a comm hook, the default all-reduce inside):
  by then this rank computed every gradient, and what follows is waiting
  for the other ranks' buckets. A micro-batch under `no_sync` has no
  all-reduce: its whole backward is own work.

The optimizer step is left out (with `--zero` it holds collectives; it is
small against forward and backward anyway).

On one CUDA device per process the forward and backward marks are CUDA
events on the current stream (the host only queues kernels), read once the
GPU passed them, a step or two later, without synchronising; elsewhere they
are the host's monotonic clock.

The first `WARM_STEPS` steps of a process are not counted: allocations,
caches and DDP's first iteration make them slow on every rank alike.

Test hook (read here only): DDPKIT_TEST_SLOW_RANK=RANK:SECONDS[:FROM_STEP]
sleeps SECONDS in rank RANK's data loading from its FROM_STEP-th step
(default 1) on, like a slow data loader.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ...shared import envnames
from .straggler import WORK, WorkWindow

Mark = float | torch.cuda.Event
WARM_STEPS = 2


@dataclass(frozen=True)
class SlowHook:
    """DDPKIT_TEST_SLOW_RANK, parsed (see the module docstring)."""

    seconds: float = 0.0
    from_step: int = 1

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] = os.environ) -> SlowHook:
        raw = env.get(envnames.DDPKIT_TEST_SLOW_RANK)
        if not raw:
            return cls()
        parts = raw.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            slow_rank, seconds = int(parts[0]), float(parts[1])
            from_step = int(parts[2]) if len(parts) == 3 else 1
        except ValueError:
            raise ValueError(f"{envnames.DDPKIT_TEST_SLOW_RANK}={raw!r}: give RANK:SECONDS[:FROM_STEP], "
                             "e.g. 2:0.3:10") from None
        return cls(seconds, from_step) if slow_rank == rank else cls()

    def __call__(self, step: int) -> None:
        if self.seconds and step >= self.from_step:
            time.sleep(self.seconds)


@dataclass
class _Step:
    """One step's marks, until they can be read."""

    host_s: float = 0.0  # what the host clock timed (data)
    spans: list[tuple[Mark, Mark]] = field(default_factory=list)  # forward and backward, start and end


class StepClock:
    """One process's own work, a step at a time, into `window` once the
    device passed its marks: CUDA events on the current stream where `cuda`
    (read a step or two later, never synchronised), else the host's clock.
    The first WARM_STEPS steps are not counted. The trainer's WorkTimer and
    the preamble's (ddpkit/preamble/stragglers.py) both time with one."""

    def __init__(self, cuda: bool, window: WorkWindow = WORK) -> None:
        self.cuda, self.window = cuda, window
        self.steps = 0
        self._step = _Step()
        self._pending: deque[_Step] = deque()

    def mark(self) -> Mark:
        if not self.cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, start: Mark, end: Mark) -> None:
        self._step.spans.append((start, end))

    def host(self, seconds: float) -> None:
        self._step.host_s += seconds

    def step_done(self) -> None:
        """The step's marks are complete: into the window once readable."""
        self.steps += 1
        step, self._step = self._step, _Step()
        if self.steps <= WARM_STEPS:
            return
        self._pending.append(step)
        while self._pending and _passed(self._pending[0]):
            self.window.add(_seconds(self._pending.popleft()))


class WorkTimer:
    """Times one process's own work per step into `window` (see the module docstring)."""

    def __init__(self, module: nn.Module, raw: nn.Module, device: torch.device, rank: int,
                 window: WorkWindow = WORK, slow: SlowHook | None = None) -> None:
        self.slow = slow if slow is not None else SlowHook.from_env(rank)
        # Events only on one CUDA device: a model split over devices has no single stream to time.
        single = len({p.device for p in raw.parameters()}) <= 1
        self.clock = StepClock(device.type == "cuda" and single, window)
        self._inner: list[Mark] | None = None  # the unwrapped model's forward marks, while a step's forward runs
        self._bucket: Mark | None = None  # when DDP handed over the last bucket so far
        ddp = getattr(module, "_orig_mod", module)  # inside torch.compile's wrapper
        # Not under torch.compile (hooks would break its graph), nor DataParallel
        # (its replicas run the hooks on several devices' threads at once).
        if module is raw or (ddp is module and isinstance(ddp, nn.parallel.DistributedDataParallel)):
            raw.register_forward_pre_hook(lambda *_: self._inner_mark())
            raw.register_forward_hook(lambda *_: self._inner_mark())
        if isinstance(ddp, nn.parallel.DistributedDataParallel):
            # A lambda: DDP checks the hook's annotations as objects, and this module's are strings.
            ddp.register_comm_hook(None, lambda state, bucket: self._comm_hook(state, bucket))

    @property
    def steps(self) -> int:
        return self.clock.steps

    def _inner_mark(self) -> None:
        if self._inner is not None:  # not in an evaluation
            self._inner.append(self.clock.mark())

    def _comm_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's own all-reduce (average), after noting the moment."""
        self._bucket = self.clock.mark()
        return default_hooks.allreduce_hook(state, bucket)

    # ---- the Stepper's blocks ----------------------------------------------------------
    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        start = time.monotonic()
        self.slow(self.steps + 1)
        yield
        self.clock.host(time.monotonic() - start)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        inner: list[Mark] = []
        self._inner = inner
        start = self.clock.mark()
        try:
            yield
        finally:
            self._inner = None
        end = self.clock.mark()
        if len(inner) >= 2:  # the model's own forward, then the loss
            self.clock.span(inner[0], inner[-1])
            start = inner[-1]
        self.clock.span(start, end)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self._bucket = None
        start = self.clock.mark()
        yield
        end = self._bucket if self._bucket is not None else self.clock.mark()
        self.clock.span(start, end)

    def step_done(self) -> None:
        """The step's marks are complete: into the window once readable."""
        self.clock.step_done()


def _passed(step: _Step) -> bool:
    last = step.spans[-1][1] if step.spans else None
    return not isinstance(last, torch.cuda.Event) or last.query()


def _seconds(step: _Step) -> float:
    total = step.host_s
    for start, end in step.spans:
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            total += start.elapsed_time(end) / 1000
        elif isinstance(start, float) and isinstance(end, float):
            total += end - start
    return max(total, 0.0)
