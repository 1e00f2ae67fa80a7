"""What the user sees: a progress bar (or plain lines) on rank 0, one log file
per rank, metrics as JSON Lines (ddpkit.records), and the closing summary."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import records
from ...shared.agreed import metrics_to_launcher
from ...shared.wording import plural

if TYPE_CHECKING:
    from .tensorboard import TensorBoardScalars


def rank_logger(rank: int, log_dir: Path | None) -> logging.Logger:
    """Every rank logs to <log-dir>/rank<R>.log; rank 0 also to stderr."""
    log = logging.getLogger(f"ddpkit.train.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(log_dir / f"rank{rank}.log")
        handler.setFormatter(fmt)
        log.addHandler(handler)
    if rank == 0:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(fmt)
        log.addHandler(handler)
    return log


class Metrics:
    """Appends one record per line (records.encode, with the time); rank 0
    only (others get a no-op). With `tensorboard`, the same records' scalars
    go there too (--tensorboard). A path that names the launcher
    (agreed.METRICS_TO_LAUNCHER) sends each record on the records channel
    instead (records.emit: framed on stderr for a launcher, or the job's
    records folder)."""

    def __init__(self, path: Path | None, enabled: bool, tensorboard: Path | None = None) -> None:
        self.board: TensorBoardScalars | None = None
        self.framed = enabled and metrics_to_launcher(path)
        # Kept open for the whole run, each record one unbuffered write: a killed run keeps every line it wrote.
        self.path = path if path is not None and enabled and not self.framed else None
        self.file = records.Appender()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        if tensorboard is not None and enabled:
            from .tensorboard import TensorBoardScalars

            self.board = TensorBoardScalars(tensorboard)

    def put(self, record: records.Record) -> None:
        now = time.time()
        if self.framed:
            records.emit(record, time=now)
        if self.path is not None:
            records.append(self.path, record, now, kept=self.file)
        if self.board is not None:
            self.board.record(record, now)

    def write(self, kind: str, **fields: Any) -> None:
        """The record of `kind` with these fields (RecordError when they are not its fields)."""
        self.put(records.from_fields({"kind": kind, **fields}).record)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


class Progress:
    """Rank 0's view of training: a rich bar on a terminal (or with --progress bar),
    otherwise a plain line every `every` steps. Other ranks show nothing."""

    def __init__(self, mode: str, enabled: bool, total: int, start: int, every: int) -> None:
        self.enabled, self.total, self.every = enabled, total, every
        self.bar = None
        if enabled and (mode == "bar" or (mode == "auto" and sys.stdout.isatty())):
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[ips]} img/s"),
                                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=start, loss="-", ips="-")
        self.t0, self.start = time.monotonic(), start

    def update(self, step: int, epoch: int, loss: float | None, images_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            # the loss column keeps the last value read until the next one
            shown: dict[str, Any] = {} if loss is None else {"loss": f"{loss:.4f}"}
            self.bar.update(self.task, completed=step, ips=f"{images_per_s:,.0f}", **shown)
        elif loss is not None:
            done = step - self.start
            eta = (time.monotonic() - self.t0) / done * (self.total - step) if done else 0.0
            print(f"step {step}/{self.total} epoch {epoch} loss {loss:.4f} {images_per_s:,.0f} img/s "
                  f"eta {eta:.0f}s", flush=True)

    def wants_loss(self, step: int) -> bool:
        """Reading the loss synchronises with the device (the host cannot
        queue the next step meanwhile), so only every `every` steps, bar or
        not: a bar that showed every step's loss would cost every step a sync."""
        return self.enabled and (step % self.every == 0 or step == self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class TrainingStatus(str, Enum):
    """How `ddpkit train` ended (the summary's and the metrics file's `status`)."""

    FINISHED = "finished"
    PREEMPTED = "preempted"  # a stop signal: checkpointed, exit ExitCode.PREEMPTED

    def __str__(self) -> str:  # "ddpkit train finished: ..." (str, Enum on 3.10 would print TrainingStatus.FINISHED)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class TrainingSummary:
    """How `ddpkit train` ended: the metrics file's `summary` record, and the lines rank 0 prints."""

    record: records.Summary

    @property
    def status(self) -> TrainingStatus:
        return TrainingStatus(self.record.status)

    def lines(self) -> list[str]:
        r = self.record
        acc = "-" if r.accuracy is None else f"{r.accuracy:.2%}"
        return [
            f"ddpkit train {self.status}: {plural(r.steps, 'step')}, {plural(r.epochs_completed, 'epoch')}, "
            f"world size {r.world_size}, global batch {r.global_batch}",
            f"  time {r.seconds:.1f}s, {r.images_per_second:,.0f} img/s while training",
            f"  final accuracy {acc}",
            f"  checkpoint {r.checkpoint or '-'}",
        ]
