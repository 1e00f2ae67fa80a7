"""A dataset whose items need a module-level lock: the shape of every library
lock a loader worker may touch (allocators, loggers, I/O buffers). A rank's
other thread may hold such a lock at the instant a worker starts; a worker
forked from the rank then inherits it held, and waits for it forever."""

from __future__ import annotations

import os
import threading

import torch
from torch.utils.data import Dataset

LOCK = threading.Lock()


class HeldLockData(Dataset[tuple[torch.Tensor, int]]):
    """Item i: (whether the worker got LOCK within the deadline, the worker's parent pid)."""

    def __init__(self, size: int, wait_s: float) -> None:
        self.size, self.wait_s = size, wait_s

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        got = LOCK.acquire(timeout=self.wait_s)
        if got:
            LOCK.release()
        return torch.tensor([float(got)]), os.getppid()
