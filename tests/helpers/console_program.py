"""A program of the user's own with what fills a console: a tqdm bar on
every rank, torch's own warning (DDP's find_unused_parameters with none
unused), and, with `fail`, rank 1 ending mid-training so that rank 0's next
all-reduce fails with gloo's error and its traceback."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(torch.nn.Linear(4, 4), find_unused_parameters=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in tqdm(range(40), desc="train", mininterval=0):
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if "fail" in sys.argv and rank == 1 and step == 20:
        os._exit(3)
    time.sleep(0.02)
print("trained", flush=True)
dist.destroy_process_group()
