"""A job's metrics records, taken from its output into the run folder.

Where rank 0 runs on another host (launch ssh) or in a container (launch
docker), the run folder is out of the job's reach: the launcher sets
DDPKIT_METRICS to agreed.METRICS_TO_LAUNCHER, the job frames each metrics
record on stderr with its time, and the LinePrinter hands every record it
reads here, which appends the ones a metrics file holds
(records.METRICS_FILE_KINDS) to the run folder's metrics.jsonl, where
`ddpkit report` reads them as it reads `launch local`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ... import records


@dataclass
class MetricsSink:
    """Appends the metrics records the job sends to `path` (kept open: a
    record a second from every node); a file that cannot be written is said
    once through `warn`, and the run goes on without it."""

    path: Path
    warn: Callable[[str], None]
    failed: bool = False
    file: records.Appender = field(default_factory=records.Appender)

    def __call__(self, stamped: records.Stamped) -> None:
        if self.failed or not isinstance(stamped.record, records.METRICS_FILE_KINDS):
            return
        try:
            records.append(self.path, stamped.record, time.time() if stamped.time is None else stamped.time,
                           kept=self.file)
        except OSError as exc:
            self.failed = True
            self.warn(f"the job's metrics records are no longer kept in {self.path}: {exc}")
