"""Test-only model for the straggler judge (`--model tests.helpers.straggler_models:slow_eval`).

A linear classifier of 8x8 images (`--image-size 8`, tests.helpers.stall_models'
`_Linear`) whose evaluation is slow on one rank only: on rank
STRAGGLER_TEST_EVAL_RANK every evaluation batch sleeps STRAGGLER_TEST_EVAL_SLEEP_S
(the other ranks wait for it in the evaluation's all-reduce). An uneven
evaluation is no straggler. Training steps are slowed by ddpkit's own test hook,
DDPKIT_TEST_SLOW_RANK (train/watchdog/worktime.py).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from tests.helpers.stall_models import _Linear


class _SlowEval(_Linear):
    def misbehave(self) -> None:
        if not self.training and self.rank == int(os.environ["STRAGGLER_TEST_EVAL_RANK"]):
            time.sleep(float(os.environ["STRAGGLER_TEST_EVAL_SLEEP_S"]))


def slow_eval(num_classes: int = 10) -> nn.Module:
    return _SlowEval(num_classes)


class Sleepy(nn.Module):
    """A linear model whose forward sleeps `forward_s`: own work a rank's timer must count."""

    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.fc, self.forward_s = nn.Linear(4, 2), forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return self.fc(x)
