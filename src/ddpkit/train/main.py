"""`ddpkit train`: start-up, rank report, training, summary, shutdown.

The command line is parsed once into a frozen TrainConfig (config.py), which
every later step and every --spawn child receives.

Exit codes (ddpkit.shared.exitcodes.ExitCode): 0 OK; 2 BAD_INPUT bad flags, data,
checkpoint or launch environment (nothing trained); 75 PREEMPTED stopped by
SIGTERM/SIGUSR2 after writing a checkpoint: run again with --resume auto.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .. import records
from ..shared import envnames
from ..shared.agreed import metrics_to_launcher
from ..shared.exitcodes import ExitCode, code_of, exit_on
from .config.options import DefaultsFormatter, add_training_arguments, problems
from .config.values import TrainConfig
from .startup.clock import CLOCK
from .startup.distributed import DistContext, add_startup_arguments

if TYPE_CHECKING:
    from .loop.training import Trainer
    from .stop.signals import StopRequest
    from .watchdog.stall import Watchdog
    from .watchdog.stall_model import Settings

WHO = "ddpkit train"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsFormatter  # --help shows each flag's default
    add_startup_arguments(parser)
    add_training_arguments(parser)


def _bad(error: BaseException | str) -> int:
    """One line for an expected error or a fault, after its `cause` record for
    a launcher; its own exit code when it carries one (a NetCheckError or
    RankReportError: STARTUP; a TrainFault: its own), else BAD_INPUT."""
    code = code_of(error) if isinstance(error, BaseException) else int(ExitCode.BAD_INPUT)
    if _under_a_launcher():
        records.emit(records.Cause(WHO, str(error), code))
    return exit_on(WHO, error, code)


def _under_a_launcher() -> bool:
    """Started by torchrun or as a Slurm task, whose output a launcher reads;
    a person who ran `ddpkit train` at a prompt reads the line alone."""
    return any(name in os.environ for name in (envnames.RANK, envnames.TORCHELASTIC_RUN_ID, envnames.SLURM_PROCID))


def _stop_request() -> StopRequest:
    """SIGTERM/SIGUSR2 handlers, installed before anything slow (start-up,
    rank report, model build): a pre-emption signal that arrives then must
    lead to a checkpoint and exit 75, not kill the process."""
    from .stop.signals import StopRequest

    stop = StopRequest()
    stop.install()
    return stop


def import_trainer(model: str) -> None:
    """Import what training `model` needs (torch, the trainer's modules, and
    torchvision for its ResNets) now, so that the clock's `imports` phase
    holds all of it and the later phases time only their own work."""
    # The optimizer's first call and DDP's constructor import torch._dynamo (torch's lazy
    # _disable_dynamo), so every run pays for it (about half of a worker's imports, and it maps
    # triton's 480 MB library where triton is installed): imported here it is timed as an import, not as
    # the model build, and done before the watchdog's heartbeats start, which a long page-in must not hold up.
    import torch._dynamo  # noqa: F401

    from .model.build import is_torchvision_resnet
    from .startup import rank_report  # noqa: F401

    if is_torchvision_resnet(model):
        import torchvision  # noqa: F401  (about a second: not for models that never use it)
    CLOCK.mark("imports_done")


def train(ctx: DistContext, config: TrainConfig, stop: StopRequest | None = None) -> int:
    """Everything after start-up, on one rank. Returns the exit code."""
    from .loop.elastic import fit_global_batch
    from .loop.training import Trainer, exit_code
    from .outputs.progress import TrainingStatus
    from .startup.rank_report import ReportOutputs, report
    from .stop import slurm_batch

    stop = stop or _stop_request()
    report(ctx, env_names=config.rank_report_env,
           outputs=ReportOutputs(json_path=config.rank_report_json, metrics=config.metrics,
                                 folder=_table_folder(config)))
    CLOCK.mark("rank_report_done")
    fit = fit_global_batch(config, ctx.world_size)
    dog = _watchdog(ctx, fit.config)
    try:
        trainer = Trainer(fit.config, ctx, stop)
        if dog is not None:
            dog.last_words = trainer.last_step.write
            trainer.last_step.claim = dog.claim_last_step
            trainer.last_step.done = dog.last_step_written
        _report_membership(ctx, trainer, fit.note, keeps_batch=config.keep_global_batch_of is not None)
        summary = trainer.run()
    finally:
        if dog is not None:
            dog.stop()
    if ctx.rank == 0:
        print("\n".join(summary.lines()), flush=True)
    # DDP's reducer often sits in a reference cycle; if it outlives the
    # process group, gloo aborts the process at exit ("terminate called
    # without an active exception"). Free it now, then let every rank finish
    # talking before the group is destroyed.
    del trainer
    gc.collect()
    _finish_together()
    if summary.status is TrainingStatus.FINISHED and ctx.local_rank == 0:
        slurm_batch.tell_training_finished()  # every rank is past the last step: a task still running is left behind
    return exit_code(summary.status)


def _report_membership(ctx: DistContext, trainer: Trainer, batch_note: str, *, keeps_batch: bool) -> None:
    """Elastic: after the rank report (and the resume, which knows the world
    size before), rank 0 says what changed since the checkpoint: a line for
    people, and the `reformed` record for the launcher."""
    from .. import records
    from .loop.elastic import changed_line, reformed
    from .startup.launchinfo import AgentRestarts

    restarts, saved_world = AgentRestarts.from_env(), trainer.checkpointer.saved_world
    line = changed_line(restarts, ctx.world_size, saved_world, batch_note, keeps_batch)
    if line and ctx.rank == 0:
        print(line, flush=True)
        record = reformed(restarts, ctx.world_size, saved_world)
        if record is not None:
            records.emit(record)


def _watchdog(ctx: DistContext, config: TrainConfig) -> Watchdog | None:
    """The hang watchdog's thread (train/watchdog/stall.py), after the rank report:
    from here on a rank without progress is found and the job stopped."""
    from .startup.distributed import StartupError
    from .watchdog.node_loss import loss_s_from_env
    from .watchdog.stall import Identity, Outputs, start
    from .watchdog.stall_model import Settings
    from .watchdog.straggler import factor_from_env
    from .watchdog.worktime import SlowHook

    try:
        settings = Settings.from_env()
        factor_from_env()  # refused here, in one line, not on the watchdog's thread
        SlowHook.from_env(ctx.rank)  # the test hook, likewise
        loss_s = loss_s_from_env()
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if not ctx.distributed:
        return None  # one process: no peer waits for it, and no store to report to
    dog = start(Identity(ctx.rank, ctx.world_size, ctx.local_world_size, _launcher_node(ctx.node_rank), ctx.host,
                         os.getpid()),
                ctx.master_addr, ctx.master_port,
                Outputs(config.log_dir, config.metrics, ctx.backend == "nccl"), settings, loss_s)
    if ctx.rank == 0:
        print(f"ddpkit watchdog: {watchdog_line(settings, loss_s)}", file=sys.stderr, flush=True)
    return dog


def _launcher_node(node_rank: int) -> int:
    """The node index the launcher knows this node by (its summary's), where
    ddpkit's own launchers say it: under c10d rendezvous torchrun's node rank
    (GROUP_RANK) is assigned anew at every rendezvous, so the watchdog's
    reports would name another node after an elastic restart."""
    try:
        return int(os.environ.get(envnames.DDPKIT_NODE_RANK, node_rank))
    except ValueError:
        return node_rank


def watchdog_line(settings: Settings, loss_s: float | None = None) -> str:
    if not settings.enabled:
        return "off (watchdog.enabled: false)"
    lost = "" if loss_s is None else f"; a node silent for {loss_s:g}s is lost (exit {int(ExitCode.NODE_LOST)})"
    return (f"on: a rank without progress for {settings.stall_s:g}s "
            f"(first steps {settings.first_step_limit:g}s) stops the job with exit {int(ExitCode.STALLED)}" + lost)


def _finish_together() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class _SpawnEntry:
    """Picklable fn(ctx) for run_spawned: carries the frozen config (never the
    CLI's Namespace, whose handler is a local function that cannot pickle).
    A child that fails with a fault of ddpkit's writes its one line to
    `causes`/rank<R> and exits with the fault's code; the parent prints each
    distinct line once (`spawn_causes`), as a launcher does for its workers."""

    def __init__(self, config: TrainConfig, causes: str) -> None:
        self.config, self.causes = config, causes

    def __call__(self, ctx: DistContext) -> None:
        try:
            code = train(ctx, self.config)
        except _expected_errors() as exc:  # a one-line message and its exit code, not a child's traceback
            code = self._cause(ctx.rank, exc)
        if code:
            sys.exit(code)

    def failed(self, rank: int, exc: BaseException) -> None:
        """Before the group formed (the pre-join checks): exits with the
        error's code when it is one of ddpkit's, else returns (a traceback)."""
        if isinstance(exc, _expected_errors()):
            sys.exit(self._cause(rank, exc))

    def _cause(self, rank: int, exc: BaseException) -> int:
        (Path(self.causes) / f"rank{rank}").write_text(str(exc), encoding="utf-8")
        return code_of(exc)


def _check_spawn_interface(config: TrainConfig) -> None:
    """--spawn: every child is on this machine, so its interface settings are
    checked once, here, before any child starts; children reading the host's
    interfaces moments apart (a bridge came or went) would word one fault twice."""
    from .startup.netlocal import interface_problems
    from .startup.netproblem import NetCheckError

    found = interface_problems(config.interface, os.environ, spans_hosts=False)
    if found:
        raise NetCheckError(found[0])


def spawn_causes(folder: Path) -> list[str]:
    """Each --spawn child's cause line once, in rank order (all ranks on one
    machine usually fail with the same line)."""
    found = sorted(folder.glob("rank*"), key=lambda p: int(p.name[4:]))
    return list(dict.fromkeys(p.read_text(encoding="utf-8") for p in found))


def _table_folder(config: TrainConfig) -> Path | None:
    """Where the rank report's full table goes when the printed one is short:
    the log folder, else the metrics file's (the run folder under a launcher)."""
    if config.log_dir is not None:
        return config.log_dir
    if config.metrics is not None and not metrics_to_launcher(config.metrics):
        return config.metrics.parent
    return None


def _expected_errors() -> tuple[type[BaseException], ...]:
    """ddpkit's errors that end `ddpkit train` with their one line and exit code (no traceback)."""
    from .checkpoint.files import CheckpointError
    from .data.loaders import DataError
    from .loop.training import DataTooSmall
    from .model.build import ModelError
    from .model.strategy import StrategyError
    from .startup.distributed import StartupError
    from .startup.rank_report import RankReportError
    from .stop.faults import TrainFault

    return (CheckpointError, DataError, DataTooSmall, ModelError, RankReportError, StartupError, StrategyError,
            TrainFault)


def run(args: argparse.Namespace) -> int:
    found = problems(args)
    if found:
        # One line: every rank prints it, and a launcher shows a worker's line once, last.
        return _bad("invalid options (nothing was started): " + "; ".join(found))
    return run_config(TrainConfig.from_args(args))


def run_config(config: TrainConfig) -> int:
    from torch.multiprocessing import ProcessExitedException

    from .startup.distributed import init_distributed, run_spawned, shutdown
    from .stop.faults import TrainFault
    from .watchdog.stacks import nccl_recorder_file

    expected = _expected_errors()
    try:
        if config.spawn:
            _check_spawn_interface(config)
            with tempfile.TemporaryDirectory(prefix="ddpkit-spawn-causes-") as causes:
                entry = _SpawnEntry(config, causes)
                try:
                    run_spawned(config, entry, prepare=functools.partial(import_trainer, config.model),
                                failed=entry.failed)
                except ProcessExitedException:
                    for line in spawn_causes(Path(causes)):
                        _bad(line)
                    raise
            return ExitCode.OK
        stop = _stop_request()
        import_trainer(config.model)
        nccl_recorder_file(config.log_dir)  # before the NCCL group exists: it reads the variable then
        ctx = init_distributed(config)
        try:
            try:
                return train(ctx, config, stop)
            except TrainFault as exc:
                # Handled here, not outside `finally`: the traceback (which holds
                # the model and DDP's reducer) must be freed before shutdown().
                return _bad(exc)
        finally:
            shutdown(ctx)
    except ProcessExitedException as exc:
        return exc.exit_code or ExitCode.FAILED
    except expected as exc:  # a TrainFault raised outside the group's life, or an input error
        return _bad(exc)
