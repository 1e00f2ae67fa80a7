"""Test-only model factories for the hang watchdog (`--model tests.helpers.stall_models:NAME`).

Each is a linear classifier of 8x8 images (`--image-size 8`), and misbehaves on purpose at a
step chosen by environment variables (read at construction; set by the test):

- `stuck_forward`: on rank STALL_TEST_RANK, forward at call STALL_TEST_CALL
  spins in a Python loop forever (the watchdog's stack dump must show
  `spin_in_forward`).
- `slow_first_step`: every rank's first forward sleeps STALL_TEST_SLEEP_S
  (a long first step: compilation, autotuning), and every evaluation batch
  STALL_TEST_EVAL_SLEEP_S (a long evaluation); neither may count as a stall.
- `stuck_in_start_up`: on rank STALL_TEST_RANK, building the model opens the
  named pipe STALL_TEST_FIFO for reading, which no one ever writes: a read
  on a hung filesystem, before the rank's first step (the stack dump must
  show `read_from_a_hung_filesystem`).
- `slow_in_start_up`: on rank STALL_TEST_RANK, building the model takes
  STALL_TEST_SLEEP_S of short sleeps: a read from a slow filesystem that
  moves (slow, not stuck).
- `paced`: every rank's every training forward sleeps STALL_TEST_STEP_S: a
  job that trains at a known, even pace, where a test needs it still
  training seconds later (no rank slower than another).
No BatchNorm: the ranks waiting for a stuck one wait in backward's all-reduce.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class _Linear(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.flat = nn.Flatten(1)
        self.fc = nn.Linear(3 * 8 * 8, num_classes)  # --image-size 8
        self.calls = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.misbehave()
        return self.fc(self.flat(x))

    def misbehave(self) -> None:
        pass


class _StuckForward(_Linear):
    def misbehave(self) -> None:
        if self.training and self.rank == int(os.environ["STALL_TEST_RANK"]) \
                and self.calls == int(os.environ["STALL_TEST_CALL"]):
            spin_in_forward()


class _SlowFirstStep(_Linear):
    def misbehave(self) -> None:
        if self.training and self.calls == 1:
            time.sleep(float(os.environ["STALL_TEST_SLEEP_S"]))
        elif not self.training:
            time.sleep(float(os.environ["STALL_TEST_EVAL_SLEEP_S"]))


class _Paced(_Linear):
    def misbehave(self) -> None:
        if self.training:
            time.sleep(float(os.environ["STALL_TEST_STEP_S"]))


def spin_in_forward() -> None:
    """A Python loop that never ends: the GIL is released between bytecodes,
    so this rank's watchdog thread still runs and can dump this frame."""
    n = 0
    while True:
        n += 1


def stuck_forward(num_classes: int = 10) -> nn.Module:
    return _StuckForward(num_classes)


def slow_first_step(num_classes: int = 10) -> nn.Module:
    return _SlowFirstStep(num_classes)


def paced(num_classes: int = 10) -> nn.Module:
    return _Paced(num_classes)


def read_from_a_hung_filesystem(path: str) -> bytes:
    """Blocks in open() until a writer opens the pipe: none ever does."""
    with open(path, "rb") as fh:
        return fh.read()


def stuck_in_start_up(num_classes: int = 10) -> nn.Module:
    if int(os.environ.get("RANK", "0")) == int(os.environ["STALL_TEST_RANK"]):
        read_from_a_hung_filesystem(os.environ["STALL_TEST_FIFO"])
    return _Linear(num_classes)


def read_slowly(seconds: float) -> None:
    """A little at a time until `seconds` passed: the thread keeps giving up the CPU."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def slow_in_start_up(num_classes: int = 10) -> nn.Module:
    if int(os.environ.get("RANK", "0")) == int(os.environ["STALL_TEST_RANK"]):
        read_slowly(float(os.environ["STALL_TEST_SLEEP_S"]))
    return _Linear(num_classes)
