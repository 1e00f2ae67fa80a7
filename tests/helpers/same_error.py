"""A torchrun-style program (no call into ddpkit) that fails at step 3 on
rank 1 at every start: `SAME_ERROR_MODE=raise` raises the same ValueError
(its message holds numbers that change: the step, the pid); `kill` SIGKILLs
itself at the first two starts (TORCHELASTIC_RESTART_COUNT 0 and 1) and
finishes at the third. Each start prints `start restart=N rank=R`."""

import os
import signal
import time

import torch
import torch.distributed as dist

STEPS, BAD_STEP, BAD_RANK = 12, 3, 1


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"start restart={restart} rank={rank} world={dist.get_world_size()}", flush=True)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == BAD_STEP and rank == BAD_RANK:
            if os.environ.get("SAME_ERROR_MODE") == "kill":
                if restart < 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            else:
                raise ValueError(f"bad batch at step {step}: index 0x{os.getpid():x} out of range")
        time.sleep(0.02)
    print(f"done restart={restart} rank={rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
