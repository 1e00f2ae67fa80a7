"""A user's own training script (spec `command.script`) that reports its
steps with the public API, `ddpkit.watchdog.progress(step)`. On the rank
named by STALL_RANK, step STALL_STEP never ends: a Python loop, the kind of
bug the stack dump must point at (`stuck_in_user_code`)."""

import os
import time

import torch
import torch.distributed as dist

from ddpkit import watchdog


def stuck_in_user_code() -> None:
    n = 0
    while True:
        n += 1


def main() -> None:
    dist.init_process_group("gloo")
    rank, grad = dist.get_rank(), torch.ones(1)
    for step in range(1, 100_000):
        if rank == int(os.environ.get("STALL_RANK", "-1")) and step == int(os.environ.get("STALL_STEP", "0")):
            stuck_in_user_code()
        dist.all_reduce(grad)  # the collective the other ranks wait in
        time.sleep(0.02)
        watchdog.progress(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
