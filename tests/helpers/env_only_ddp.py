"""A program written for torchrun and nothing else: it reads only torchrun's
variables (env:// rendezvous), all-reduces its rank and prints one ENVPROBE
line with what it saw beside Slurm's own variables, so a test can check that
`ddpkit.run` gave an srun task the same values torchrun would have."""

import json
import os
import socket

import torch
import torch.distributed as dist

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

seen = {name: os.environ[name] for name in NAMES}
dist.init_process_group("gloo")
total = torch.tensor([float(seen["RANK"])])
dist.all_reduce(total)
slurm = {name: os.environ.get(name) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")}
line = json.dumps({**seen, "sum": total.item(), "host": socket.gethostname(), **slurm})
print(f"ENVPROBE {line}", flush=True)
dist.destroy_process_group()
