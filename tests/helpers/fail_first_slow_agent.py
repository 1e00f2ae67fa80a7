"""2 nodes x 2 processes: rank 2 (node 1) exits 3 at step 5. Its node's other
worker, rank 3, takes 4 s to end when its agent stops it, so node 0's agent
(whose workers fail at once: their peer is gone) ends first, and the
launcher reads node 0's exit before node 1's."""

import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 3:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(4), os._exit(143)))
for step in range(1000):
    if rank == 2 and step == 5:
        print("rank 2 fails now", flush=True)
        os._exit(3)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    time.sleep(0.05)
