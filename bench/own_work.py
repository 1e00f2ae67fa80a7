"""Per-step cost of the preamble's straggler timing (ddpkit/preamble/stragglers.py)
for a program of the user's own: the same DDP loop in one process (a
one-rank gloo group, CPU) with and without the part installed, so the few
microseconds it adds are not lost in a 2-process job's noise. The part wraps
DDP's forward and torch.autograd.backward, hooks the wrapped model's forward,
routes DDP's all-reduce through a Python comm hook and adds an optimizer-step
hook. A third variant gives DDP its built-in (C++) all-reduce hook before the
first forward, as a program may: the part then times the forward only and
adds no Python comm hook, which splits the cost between the wrappers and the
hook. Each variant runs in a process of its own (the part patches classes),
in turn, ROUNDS times, and the figure is the median of the rounds' mean step
time.

  .venv/bin/python -m bench.own_work [--steps 3000] [--width 64]

Writes bench/results/own_work.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("off", "stragglers", "stragglers, builtin hook")
ROUNDS = 5


def worker(variant: str, steps: int, warmup: int, width: int) -> float:
    """The mean step time in µs over `steps` steps of a DDP MLP, after `warmup`."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    if variant.startswith("stragglers"):
        from ddpkit.preamble import stragglers

        stragglers.install({"WORLD_SIZE": "2"})  # as a rank of a job a judge reads
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    ddp = nn.parallel.DistributedDataParallel(model)
    if variant.endswith("builtin hook"):
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, width)

    def step() -> None:
        ddp(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    mean_us = (time.perf_counter() - start) / steps * 1e6
    dist.destroy_process_group()
    return mean_us


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--width", type=int, default=64, help="the MLP's width (64: a step of about 0.3 ms here)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.steps, a.warmup, a.width)))
        return 0
    sys.path.insert(0, str(ROOT))
    from bench import common

    means: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(a.rounds):
        for variant in VARIANTS:  # in turn, so a change of load hits both alike
            done = subprocess.run([sys.executable, "-m", "bench.own_work", "--worker", variant, "--steps", str(a.steps),
                                   "--warmup", str(a.warmup), "--width", str(a.width)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                                  env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
                                       "PATH": "/usr/bin:/bin"})
            if done.returncode != 0:
                raise RuntimeError(f"{variant} exited {done.returncode}:\n{done.stderr[-3000:]}")
            means[variant].append(float(done.stdout.split()[-1]))
            print(f"  round {i + 1}/{a.rounds} {variant}: {means[variant][-1]:.1f} µs a step", flush=True)
    median = {v: statistics.median(ms) for v, ms in means.items()}
    added = {v: median[v] - median["off"] for v in VARIANTS if v != "off"}
    print(common.table(["", "median µs a step", "added µs", "added %"],
                       [[v, median[v], added.get(v, 0.0), 100 * added.get(v, 0.0) / median["off"]] for v in VARIANTS]))
    path = common.write_result("own_work", {"command": common.command_line(), "machine": common.machine(),
                                            "args": vars(a) | {"out": str(a.out)}, "means_us": means,
                                            "median_us": median, "added_us": added},
                               a.out or common.RESULTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
