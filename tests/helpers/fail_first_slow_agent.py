"""2 nodes x 2 processes: rank 2 (node 1) exits 3 at step 5. Its node's other
worker, rank 3, takes 6 s to end however it is ended (its collective's error,
its agent's SIGTERM), so node 0's agent, whose workers fail at once (their
peer is gone), ends first, and the launcher reads node 0's exit before node 1's."""

import os
import signal
import time

import torch
import torch.distributed as dist


def slowly(code: int) -> None:
    time.sleep(6)
    os._exit(code)


dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 3:
    signal.signal(signal.SIGTERM, lambda *_: slowly(143))
for step in range(1000):
    if rank == 2 and step == 5:
        print("rank 2 fails now", flush=True)
        os._exit(3)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        if rank == 3:
            slowly(1)
        raise
    time.sleep(0.05)
