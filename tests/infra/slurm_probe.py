"""The job the Slurm tests run: real ddpkit start-up and rank report, then one
JSON line per rank saying what it saw, so a test can check the rank contract
from the job's own output. Optional: fail on one rank, or run steps that stop
on SIGUSR2/SIGTERM with a checkpoint (the trainer's signal module) and resume."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ddpkit.train.startup.distributed import DistContext, add_startup_arguments, init_distributed, shutdown
from ddpkit.train.startup.rank_report import report
from ddpkit.train.stop.signals import EXIT_PREEMPTED, StopAgreement, StopRequest, requeue_if_slurm


def say(line: str) -> None:
    """One write per line: ranks share the job's output file, and print()
    writes the text and its newline separately when stdout is unbuffered
    (PYTHONUNBUFFERED), so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

def steps(ctx: DistContext, total: int, ckpt: Path) -> int:
    stop = StopRequest()
    stop.install()
    agreement = StopAgreement.for_run(stop, ctx.distributed)
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    if ctx.rank == 0:
        say(f"PROBE-START step={start} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")
    for step in range(start, total):
        time.sleep(0.5)
        if ctx.rank == 0:
            say(f"PROBE-STEP {step}")
        if agreement.check():
            if ctx.rank == 0:
                part = ckpt.with_name(ckpt.name + ".part")  # whole or absent for the requeued run
                part.write_text(str(step))
                part.replace(ckpt)
                say(f"PROBE-CHECKPOINT step={step}")
                requeue_if_slurm(lambda line: say(f"PROBE-{line}"))
            return EXIT_PREEMPTED
    agreement.finish()
    if ctx.rank == 0:
        say(f"PROBE-DONE step={total}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    add_startup_arguments(parser)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--ckpt", type=Path)
    args = parser.parse_args()
    ctx = init_distributed(args)
    rows = report(ctx).rows
    seen = {"rank": ctx.rank, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank, "world": ctx.world_size,
            "host": ctx.host, "launcher": ctx.launcher, "master": f"{ctx.master_addr}:{ctx.master_port}",
            "slurm_nodeid": os.environ.get("SLURM_NODEID"), "slurmd_nodename": os.environ.get("SLURMD_NODENAME")}
    say("PROBE " + json.dumps(seen))
    if ctx.rank == 0:
        say("PROBE-ROWS " + json.dumps([asdict(r) for r in rows]))
    if ctx.rank == args.fail_rank:
        say(f"PROBE-FAIL rank={ctx.rank}")
        os._exit(1)
    if args.fail_rank >= 0:
        time.sleep(300)  # the others would hang here without --kill-on-bad-exit
    code = steps(ctx, args.steps, args.ckpt) if args.steps else 0
    shutdown(ctx)
    return code


if __name__ == "__main__":
    sys.exit(main())
