"""Pre-emption: SIGTERM or SIGUSR2 asks the job to stop after the current step.

The handler only records the request. Each step the ranks all-reduce the flag
(MAX), so a signal that reached only some ranks, or reached them during
different steps, still stops every rank after the same step: then rank 0
checkpoints, everyone exits with EXIT_PREEMPTED, and under Slurm rank 0 asks
for the job to be requeued. SIGUSR1 is left alone: NCCL may use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint; run again with --resume auto
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def agreed(self, distributed: bool, device: torch.device) -> bool:
        """True on every rank once any rank got a stop signal."""
        flag = torch.tensor([1.0 if self.signum is not None else 0.0], device=device)
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def requeue_if_slurm() -> str | None:
    """Under Slurm, put the job back in the queue; returns what was done, for the log."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"ddpkit train: scontrol requeue {job} failed: {done.stderr.strip()}", file=sys.stderr)
        return f"requeue of Slurm job {job} failed"
    return f"requeued Slurm job {job}"
