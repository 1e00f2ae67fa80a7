"""Where a training step's time goes, on the host and on the device, for any
program that steps a torch optimizer (ddpkit train, bench/ceiling.py, a
script of your own), with no change to it: torch.profiler runs around the
whole program and torch's global optimizer-step hook advances its schedule,
so the profile holds the optimizer steps WAIT+WARMUP+1 .. WAIT+WARMUP+ACTIVE
(compilation and the first steps stay out).

Run it as the program under the launcher the program needs:

  python -m ddpkit.agent --standalone --nproc-per-node=1 bench/step_profile.py --out DIR --name NAME \\
      -- -m ddpkit.train --device cuda ...
  python -m ddpkit.agent --standalone --nproc-per-node=1 bench/step_profile.py --out DIR --name NAME \\
      -- bench/ceiling.py --variant compile_channels_last ...

Rank 0 writes DIR/NAME.json (per step: wall time, device busy time, kernel
launches, host syncs; the top operators) and DIR/NAME-ops.txt (torch's
operator tables by host and by device time).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

# Host calls that wait for the device: each one drains the queue the host built ahead.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("step_profile: give the program after --")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--wait", type=int, default=30, help="optimizer steps before the profile (compilation, warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--active", type=int, default=20)
    return p.parse_args(argv[:cut]), argv[cut + 1:]


def device_time(avg: Any) -> float:
    return float(getattr(avg, "self_device_time_total", getattr(avg, "self_cuda_time_total", 0.0)))


def summary(prof: profile, active: int) -> dict[str, Any]:
    averages = prof.key_averages()
    counts = {a.key: a.count for a in averages}
    steps = [e.cpu_time_total / 1e3 for e in prof.events() if e.name.startswith("ProfilerStep")]
    top_host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:15]
    top_device = sorted(averages, key=device_time, reverse=True)[:15]
    return {
        "steps": len(steps),
        "step_ms": steps,
        "step_ms_median": sorted(steps)[len(steps) // 2] if steps else None,
        "device_busy_ms_per_step": sum(device_time(a) for a in averages) / 1e3 / active,
        "kernel_launches_per_step": sum(counts.get(name, 0) for name in LAUNCHES) / active,
        "host_syncs_per_step": {name: counts[name] / active for name in SYNCS if name in counts},
        "top_host_ms_per_step": {a.key: round(a.self_cpu_time_total / 1e3 / active, 3) for a in top_host},
        "top_device_ms_per_step": {a.key: round(device_time(a) / 1e3 / active, 3) for a in top_device},
    }


def main(argv: list[str] | None = None) -> None:
    a, program = parse(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def ready(prof: profile) -> None:
        if rank != 0:
            return
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{a.name}.json").write_text(json.dumps({"program": program, **summary(prof, a.active)}, indent=1))
        by_device = "self_device_time_total"
        (a.out / f"{a.name}-ops.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
            + prof.key_averages().table(sort_by=by_device, row_limit=40))

    prof = profile(activities=activities, on_trace_ready=ready,
                   schedule=schedule(wait=a.wait, warmup=a.warmup, active=a.active, repeat=1))
    register_optimizer_step_post_hook(lambda *_: prof.step())
    with prof:
        if program[0] == "-m":
            sys.argv = program[1:]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = program
            runpy.run_path(program[0], run_name="__main__")


if __name__ == "__main__":
    main()
