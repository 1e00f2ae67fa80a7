"""`ddpkit train --tensorboard DIR`: rank 0 writes the scalars that `ddpkit
report` plots as TensorBoard events, for those who watch runs there: the
loss, throughput and learning rate (`train/...`), every rank's step time
(`step_time_ms/rank<R>`) and evaluations (`eval/...`), each at its step and
with the metrics record's wall time. Metrics hands it every record it
writes, so both say the same. Needs the `tensorboard` package (the extra
`ddpkit[tensorboard]`); options refuses the flag in one line without it."""

from __future__ import annotations

from pathlib import Path

from ...records import Eval, Record, StepTimes, Train

PACKAGE = "tensorboard"


def scalars(record: Record) -> list[tuple[str, float]]:
    """The (tag, value) pairs of one metrics record (none for most kinds)."""
    pairs: list[tuple[str, float | None]]
    if isinstance(record, Train):
        pairs = [("train/loss", record.loss), ("train/images_per_s", record.images_per_s), ("train/lr", record.lr)]
    elif isinstance(record, StepTimes):
        pairs = [(f"step_time_ms/rank{r}", s * 1000) for r, s in enumerate(record.step_s)]
    elif isinstance(record, Eval):
        pairs = [("eval/accuracy", record.accuracy), ("eval/loss", record.loss)]
    else:
        return []
    return [(tag, float(value)) for tag, value in pairs if value is not None]


class TensorBoardScalars:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def record(self, record: Record, walltime: float) -> None:
        step = getattr(record, "step", None)
        if step is None:
            return
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, int(step), walltime=walltime)
        if isinstance(record, Train):
            self.writer.flush()  # a killed run keeps what it showed, as the metrics file does

    def close(self) -> None:
        self.writer.close()
