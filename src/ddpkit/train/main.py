"""`ddpkit train`: start-up, rank report, training, summary, shutdown.

Exit codes: 0 done; 2 bad flags, data, checkpoint or launch environment
(nothing trained); 75 (EX_TEMPFAIL) stopped by SIGTERM/SIGUSR2 after writing a
checkpoint: run again with --resume auto.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys

from .options import add_training_arguments, problems
from .startup import add_startup_arguments

EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_startup_arguments(parser)
    add_training_arguments(parser)


def _bad(message: str) -> int:
    print(f"ddpkit train: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _stop_request() -> object:
    """SIGTERM/SIGUSR2 handlers, installed before anything slow (start-up,
    rank report, model build): a pre-emption signal that arrives then must
    lead to a checkpoint and exit 75, not kill the process."""
    from .signals import StopRequest

    stop = StopRequest()
    stop.install()
    return stop


def train(ctx: object, args: argparse.Namespace, stop: object = None) -> int:
    """Everything after start-up, on one rank. Returns the exit code."""
    from .loop import Trainer
    from .rank_report import report
    from .startup import CLOCK

    stop = stop or _stop_request()
    report(ctx)
    CLOCK.mark("rank_report_done")
    trainer = Trainer(args, ctx, stop)
    summary, code = trainer.run()
    if ctx.rank == 0:
        print("\n".join(summary.lines()), flush=True)
    # DDP's reducer often sits in a reference cycle; if it outlives the
    # process group, gloo aborts the process at exit ("terminate called
    # without an active exception"). Free it now, then let every rank finish
    # talking before the group is destroyed.
    del trainer
    gc.collect()
    _finish_together(ctx)
    return code


def _finish_together(ctx: object) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _spawned(ctx: object, args: argparse.Namespace) -> None:
    code = train(ctx, args)
    if code:
        sys.exit(code)


class _SpawnEntry:
    """Picklable fn(ctx) for run_spawned that carries the parsed flags."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __call__(self, ctx: object) -> None:
        _spawned(ctx, self.args)


def _expected_errors() -> tuple[type[BaseException], ...]:
    from .checkpoint import CheckpointError
    from .data import DataError
    from .loop import DataTooSmall
    from .models import ModelError
    from .rank_report import RankReportError
    from .startup import StartupError
    from .strategy import StrategyError

    return (CheckpointError, DataError, DataTooSmall, ModelError, RankReportError, StartupError, StrategyError)


def run(args: argparse.Namespace) -> int:
    found = problems(args)
    if found:
        return _bad("invalid options (nothing was started):\n  - " + "\n  - ".join(found))
    from torch.multiprocessing import ProcessExitedException

    from .startup import import_trainer, init_distributed, run_spawned, shutdown

    expected = _expected_errors()
    try:
        if args.spawn:
            run_spawned(args, _SpawnEntry(args), prepare=functools.partial(import_trainer, args.model))
            return 0
        stop = _stop_request()
        import_trainer(args.model)
        ctx = init_distributed(args)
        try:
            return train(ctx, args, stop)
        finally:
            shutdown(ctx)
    except ProcessExitedException as exc:
        return exc.exit_code or 1
    except expected as exc:
        _bad(str(exc))  # a NetCheckError carries its own code (STARTUP)
        return int(getattr(exc, "exit_code", EXIT_BAD_INPUT))
