"""The compute ceiling: the model ddpkit trains (same builder), forward +
backward + SGD step on one batch that already lives on the device. No data
loading, no logging inside the timed span, no all-reduce.

Run it under torchrun with the same process count as the runs it bounds: the
processes run concurrently (a gloo barrier lines up the timed span) and each
reports its own rate; the ceiling is rank 0's rate times the process count.

  torchrun --standalone --nproc-per-node 2 bench/ceiling.py --model resnet18 --image-size 32 \
      --variant channels_last --timing /tmp/ceiling.jsonl

Variants: eager (fp32, NCHW), channels_last, compile, compile_channels_last.
On CUDA every variant runs in bf16 autocast (the best the hardware allows);
bench/train_throughput.py runs the variants side by side and keeps the best,
so channels_last and compile count only where they measure faster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddpkit.train.model.build import build_model

VARIANTS = ("eager", "channels_last", "compile", "compile_channels_last")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--measure", type=int, default=10)
    p.add_argument("--variant", choices=VARIANTS, default="eager")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timing", type=Path, required=True, help="rank 0 appends {step, time} JSON lines here")
    return p.parse_args(argv)


def step_fn(model: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
            device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    criterion = nn.CrossEntropyLoss()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")  # only for the barrier: the ceiling has no gradient traffic
    device = torch.device("cuda", local_rank) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(rank)
    channels_last = a.variant.endswith("channels_last")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(a.model, a.num_classes, a.image_size).to(device, memory_format=fmt)  # type: ignore[call-overload]  # torch's stubs lack this accepted combination
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, a.num_classes, (a.batch_size,), device=device)
    run = model if not a.variant.startswith("compile") else torch.compile(model)
    step = step_fn(run, optimizer, device)
    for _ in range(a.warmup):  # includes compilation and allocator/cudnn warm-up
        step(x, y)
    sync(device)
    if distributed:
        dist.barrier()
    t0 = time.time()
    for _ in range(a.measure):
        step(x, y)
    sync(device)
    t1 = time.time()
    if rank == 0:
        with open(a.timing, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": a.warmup, "time": t0, "variant": a.variant}) + "\n")
            f.write(json.dumps({"step": a.warmup + a.measure, "time": t1, "variant": a.variant}) + "\n")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
