"""A stand-in job for start-up tests: join the process group, run the rank
report, leave. Prints one `REPORT-OK` line per rank that passed."""

from __future__ import annotations

import argparse
import sys

from ddpkit.train.startup.distributed import DistContext, add_startup_arguments, init_distributed, run_spawned, shutdown
from ddpkit.train.startup.rank_report import RankReportError, report


def body(ctx: DistContext) -> None:
    try:
        report(ctx)
    except RankReportError as exc:
        print(f"rank {ctx.rank}: {exc}", file=sys.stderr, flush=True)
        shutdown(ctx)
        raise SystemExit(3) from None
    print(f"REPORT-OK rank={ctx.rank} local={ctx.local_rank} node={ctx.node_rank} world={ctx.world_size} "
          f"launcher={ctx.launcher} interface={ctx.interface} backend={ctx.backend}", flush=True)
    shutdown(ctx)


def main() -> int:
    parser = argparse.ArgumentParser()
    add_startup_arguments(parser)
    args = parser.parse_args()
    if args.spawn:
        run_spawned(args, body)
    else:
        body(init_distributed(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
