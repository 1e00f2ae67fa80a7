"""A program of the user's own for bench/preamble.py: a torchrun-style DDP
loop (env:// rendezvous, gloo, an MLP on random data) that knows nothing of
ddpkit and writes a wall-clock stamp after every optimizer step (rank 0)."""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--stamps", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
width = args.width
model = DDP(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, width), torch.randint(0, 10, (256,))
stamps = []
for _ in range(args.steps):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    stamps.append(time.time())
if dist.get_rank() == 0:
    with open(args.stamps, "w") as out:
        out.write("\n".join(f"{t:.6f}" for t in stamps))
dist.destroy_process_group()
