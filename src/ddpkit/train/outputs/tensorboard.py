"""`ddpkit train --tensorboard DIR`: rank 0 writes the scalars that `ddpkit
report` plots as TensorBoard events, for those who watch runs there: the
loss, throughput and learning rate (`train/...`), every rank's step time
(`step_time_ms/rank<R>`) and evaluations (`eval/...`), each at its step and
with the metrics record's wall time. Metrics hands it every record it
writes, so both say the same. Needs the `tensorboard` package (the extra
`ddpkit[tensorboard]`); options refuses the flag in one line without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PACKAGE = "tensorboard"


def scalars(kind: str, record: dict[str, Any]) -> list[tuple[str, float]]:
    """The (tag, value) pairs of one metrics record (none for most kinds)."""
    if kind == "train":
        pairs = [("train/loss", record.get("loss")), ("train/images_per_s", record.get("images_per_s")),
                 ("train/lr", record.get("lr"))]
    elif kind == "step_times":
        pairs = [(f"step_time_ms/rank{r}", s * 1000) for r, s in enumerate(record.get("step_s") or [])]
    elif kind == "eval":
        pairs = [("eval/accuracy", record.get("accuracy")), ("eval/loss", record.get("loss"))]
    else:
        return []
    return [(tag, float(value)) for tag, value in pairs if value is not None]


class TensorBoardScalars:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def record(self, kind: str, record: dict[str, Any]) -> None:
        step = record.get("step")
        if step is None:
            return
        for tag, value in scalars(kind, record):
            self.writer.add_scalar(tag, value, int(step), walltime=record.get("time"))
        if kind == "train":
            self.writer.flush()  # a killed run keeps what it showed, as the metrics file does

    def close(self) -> None:
        self.writer.close()
