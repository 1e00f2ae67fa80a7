"""Every rank's own step time, for the report's per-rank heat map
(`ddpkit report`, docs/guides/runs.md): each rank sums the time its steps took
(the host's time in Stepper.compute and update: data, forward, backward, optimizer),
and at each progress interval the ranks gather their means over the window
to rank 0, which writes one `step_times` metrics record.

One small all-gather per interval, at the steps where rank 0 already waits
for the loss; every rank runs the same steps (the stop agreement ends them
together), so every rank takes part in each gather. Without --metrics (the same
command line on every rank) nothing is measured or gathered."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ...records import StepTimes

if TYPE_CHECKING:
    from .progress import Metrics

class RankStepTimes:
    def __init__(self, metrics: Metrics, device: torch.device, world: int, distributed: bool, every: int,
                 total: int, *, enabled: bool) -> None:
        self.metrics, self.device, self.world, self.distributed = metrics, device, world, distributed
        self.every, self.total, self.enabled = every, total, enabled
        self._spent, self._steps, self._started = 0.0, 0, 0.0

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self, step: int) -> None:
        """After the step numbered `step` (counted from 1): at the interval,
        gather and (rank 0) write the window's means."""
        if not self.enabled:
            return
        self._spent += time.monotonic() - self._started
        self._steps += 1
        if step % self.every == 0 or step == self.total:
            self._flush(step)

    def _flush(self, step: int) -> None:
        mine = torch.tensor([self._spent / max(self._steps, 1)], dtype=torch.float32, device=self.device)
        self._spent, self._steps = 0.0, 0
        if self.distributed:
            import torch.distributed as dist

            parts = [torch.zeros_like(mine) for _ in range(self.world)]
            dist.all_gather(parts, mine)
            means = [float(p.item()) for p in parts]
        else:
            means = [float(mine.item())]
        self.metrics.put(StepTimes(step=step, step_s=tuple(round(m, 5) for m in means)))
