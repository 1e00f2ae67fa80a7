"""Per-step cost of the trainer's stop-flag agreement, old against new, side
by side in one run (torchrun, gloo, CPU):

  blocking    what the trainer did until now: a flag tensor on the training
              device, dist.all_reduce(MAX), .item(), after every step
  pipelined   signals.StopAgreement: the flag on the CPU, the all-reduce
              started with async_op=True and read one step later
              (default group, as with gloo or MPI)
  own group   the same over a gloo group of its own, as under NCCL

Each step is a sleep of --step-us standing in for a step whose host is idle
while the device computes (a GPU step): that is when the all-reduce started
after the previous step finishes in the background. Two figures per variant:
`in check`, the host time spent inside the check per step, and `overhead`,
the step time above the same loop without any check; each the median of
three rounds that run every variant in turn.

  .venv/bin/python -m bench.stopflag [--nproc 2] [--steps 2000]

Writes bench/results/stopflag.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported inside the workers only: the parent never needs it

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("none", "blocking", "pipelined", "own group")
ROUNDS = 3  # the figures are medians over rounds


# ---- worker: runs inside each torchrun process --------------------------------------
def blocking_check(device: torch.device) -> Callable[[], bool]:
    """StopRequest.agreed as it was: a device tensor, a blocking all-reduce and .item()."""
    import torch
    import torch.distributed as dist

    def check() -> bool:
        flag = torch.tensor([0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    return check


def make_check(variant: str, device: torch.device) -> tuple[Callable[[], bool], Callable[[], None]]:
    """(check, finish) for one variant."""
    import torch.distributed as dist

    from ddpkit.train.stop.signals import StopAgreement, StopRequest, cpu_group

    if variant == "none":
        return (lambda: False), (lambda: None)
    if variant == "blocking":
        return blocking_check(device), (lambda: None)
    group = cpu_group(dist.get_backend() if variant == "pipelined" else "nccl")  # "nccl": make a group of its own
    agreement = StopAgreement(StopRequest(), True, group)
    return agreement.check, agreement.finish


def time_variant(variant: str, steps: int, warmup: int, step_s: float, device: torch.device) -> dict[str, float]:
    import torch.distributed as dist

    check, finish = make_check(variant, device)
    for _ in range(warmup):
        time.sleep(step_s)
        check()
    dist.barrier()
    inside = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        time.sleep(step_s)
        c0 = time.perf_counter()
        if check():
            raise RuntimeError(f"{variant}: nobody asked to stop, yet the check said stop")
        inside += time.perf_counter() - c0
    total = time.perf_counter() - t0
    finish()
    return {"step_us": total / steps * 1e6, "in_check_us": inside / steps * 1e6}


def worker(out: Path, steps: int, warmup: int, step_us: float) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    # variants in turn, several rounds: a load change on a shared machine hits them all alike
    rounds = [{v: time_variant(v, steps, warmup, step_us / 1e6, device) for v in VARIANTS} for _ in range(ROUNDS)]
    results = {v: {k: statistics.median(r[v][k] for r in rounds) for k in rounds[0][v]} for v in VARIANTS}
    dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


# ---- driver -----------------------------------------------------------------------
def summarise(raw: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    base = raw["none"]["step_us"]
    return {v: {**raw[v], "overhead_us": raw[v]["step_us"] - base} for v in VARIANTS if v != "none"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--step-us", type=float, default=1000.0, help="simulated step length (default 1000 µs)")
    p.add_argument("--out", type=Path)
    p.add_argument("--name", default="stopflag")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common

    a = parse(argv)
    with tempfile.TemporaryDirectory(prefix="ddpkit-stopflag-") as tmp:
        raw_path = Path(tmp) / "raw.json"
        common.torchrun(a.nproc, [str(Path(__file__).resolve()), "--worker", str(raw_path), str(a.steps),
                                  str(a.warmup), str(a.step_us)])
        raw = json.loads(raw_path.read_text())
    rows = summarise(raw)
    ratios = {"blocking/pipelined (in check)": rows["blocking"]["in_check_us"] / rows["pipelined"]["in_check_us"],
              "blocking/own group (in check)": rows["blocking"]["in_check_us"] / rows["own group"]["in_check_us"]}
    print(common.table(["variant", "in check µs/step", "overhead µs/step", "step µs"],
                       [[v, r["in_check_us"], r["overhead_us"], r["step_us"]] for v, r in rows.items()]))
    print(f"no check: {raw['none']['step_us']:.1f} µs/step (sleep {a.step_us:.0f} µs)")
    for name, value in ratios.items():
        print(f"{name}: {value:.1f}x")
    path = common.write_result(a.name, {"command": common.command_line(), "machine": common.machine(),
                                        "nproc": a.nproc, "steps": a.steps, "step_us": a.step_us,
                                        "baseline_step_us": raw["none"]["step_us"], "variants": rows,
                                        "ratios": ratios}, a.out or common.RESULTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        sys.exit(worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
    sys.exit(main())
