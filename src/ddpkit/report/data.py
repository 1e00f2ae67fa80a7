"""What a report shows, read from a run folder: the run's record and events
(ddpkit.runs) and the job's metrics records (the JSON Lines `ddpkit train
--metrics` appends, read as ddpkit.records: `train`, `step_times`, `stall`,
`straggler`, `rank_report`, `eval`, `checkpoint`, `stop`, `resume`, ...;
a line cut short, or a record this reader does not know, is left out).

The metrics file is, first found: the one given (`ddpkit report --metrics`),
`metrics.jsonl` in the run folder (where `launch local` has ddpkit train
write them, and a program of the user's own has them under launch local,
ssh and docker), the `--metrics` path in the job's command as the run
recorded it (spec.yaml), a Slurm job's records folder (one file per
node: ddpkit.records' channel), or the records a rendered compose job's
containers or a Kubernetes job's shared volume kept, copied into the run
folder (RunFolder.records_folder)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import records
from ..runs import RunEvent, RunTarget, StoredRun
from ..shared.agreed import METRICS_FLAG, flag_value

IMAGES = "images"  # the unit of a `train` record that names none: ddpkit train's


class NoMetrics(LookupError):
    """The run has no metrics records to plot; the message is one line."""


@dataclass(frozen=True)
class Mark:
    """Something that happened at one time, for the time line: a run event
    or a metrics record that is one (stall, straggler, stop, checkpoint ...)."""

    time: float  # seconds since the run started
    kind: str
    detail: str = ""
    ranks: tuple[int, ...] = ()


@dataclass
class ReportData:
    title: str
    started: float  # epoch seconds: the time axis's zero
    train: list[dict[str, Any]] = field(default_factory=list)  # time (s since start), step, loss, per_s, unit
    step_times: list[dict[str, Any]] = field(default_factory=list)  # time, step, step_s (one per rank)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # the rank_report rows, newest report
    marks: list[Mark] = field(default_factory=list)
    metrics_path: Path | None = None

    def world(self) -> int:
        sizes = [len(r["step_s"]) for r in self.step_times] + [len(self.ranks)]
        return max(sizes, default=0)

    def end(self) -> float:
        """The time axis's right end: the last thing that happened."""
        times = [p["time"] for p in self.train + self.step_times] + [m.time for m in self.marks]
        return max(times, default=1.0)

    def units(self) -> list[str]:
        """The throughput's units, in the order the records carry them."""
        return list(dict.fromkeys(p["unit"] for p in self.train))

    def rank_marks(self, kind: str) -> list[Mark]:
        return [m for m in self.marks if m.kind == kind]


def metrics_file(run: StoredRun, given: Path | None = None) -> Path:
    """Where this run's metrics records are (see the module docstring)."""
    if given is not None:
        if not given.is_file():
            raise NoMetrics(f"--metrics {given}: no such file")
        return given
    candidates = [run.folder.metrics_file]
    named = _metrics_arg(run.folder.spec_file)
    if named is not None:
        candidates.append(named)
    job = run.record.slurm
    if job is not None:
        candidates.append(job.records_folder)
    if run.record.target in (RunTarget.COMPOSE, RunTarget.K8S):
        candidates.append(run.folder.records_folder)
    for path in candidates:
        if path.is_file() and path.stat().st_size > 0 or path.is_dir() and any(path.glob("*.jsonl")):
            return path
    looked = " or ".join(str(p) for p in candidates)
    raise NoMetrics(f"run {run.record.id} has no metrics records (looked in {looked}); run the job with "
                    f"`-- --metrics {run.folder.metrics_file}`, or name the file with --metrics FILE")


def _metrics_arg(spec_file: Path) -> Path | None:
    """The `--metrics PATH` of the job's command, as recorded (None: none)."""
    try:
        spec = yaml.safe_load(spec_file.read_text())
    except (OSError, yaml.YAMLError):
        return None
    args = ((spec or {}).get("command") or {}).get("args") or []
    value = flag_value([str(a) for a in args], METRICS_FLAG) if isinstance(args, list) else None
    return None if value is None else Path(value).expanduser()


def load(run: StoredRun, metrics: Path | None = None) -> ReportData:
    path = metrics_file(run, metrics)
    stamped = [s for s in records.read_folder(path) if isinstance(s.record, records.METRICS_FILE_KINDS)] \
        if path.is_dir() else records.read_file(path)
    if not any(isinstance(s.record, (records.Train, records.StepTimes)) for s in stamped):
        raise NoMetrics(f"run {run.record.id}: {path} has no `train` or `step_times` records to plot "
                        f"({len(stamped)} other records); did the job train a step?")
    rec = run.record
    # The run's start; a record older than it (a metrics file appended to by
    # an earlier run) would sit left of zero, so the axis starts at the earliest.
    t0 = min([rec.started, *(s.time for s in stamped if s.time is not None)])
    data = ReportData(title=f"{rec.name} (run {rec.id}, {rec.target}: {rec.nodes}x{rec.nproc_per_node})",
                      started=t0, metrics_path=path)
    for s in stamped:
        _add_record(data, s.record, (t0 if s.time is None else s.time) - t0)
    data.marks += [_event_mark(e, t0) for e in run.folder.events()]
    data.marks.sort(key=lambda m: m.time)
    return data


def _add_record(data: ReportData, r: records.Record, t: float) -> None:
    if isinstance(r, records.Train):
        data.train.append({"time": t, "step": r.step, "loss": r.loss, "per_s": r.images_per_s,
                           "unit": r.unit or IMAGES})
    elif isinstance(r, records.StepTimes):
        data.step_times.append({"time": t, "step": r.step, "step_s": list(r.step_s)})
    elif isinstance(r, records.RankRow):
        data.ranks = [row for row in data.ranks if row.get("rank") != r.rank] + [{**asdict(r), "time": t}]
    else:
        mark = _mark(r, t)
        if mark is not None:
            data.marks.append(mark)


def _mark(r: records.Record, t: float) -> Mark | None:
    """The time line's mark of a record that is an event (None: not one)."""
    if isinstance(r, records.Stall):
        return Mark(t, "stall", f"no progress for {r.idle_s} s (limit {r.limit_s} s)",
                    tuple(s.rank for s in r.stalled))
    if isinstance(r, records.Straggler):
        detail = (f"state {r.state}, node {r.node}, host {r.host}, step {r.step}, own_s {r.own_s}, "
                  f"median_s {r.median_s}, ratio {r.ratio}, factor {r.factor}, window_steps {r.window_steps}")
        return Mark(t, "straggler", detail, (r.rank,))
    if isinstance(r, records.Stop):
        return Mark(t, "preempted", _said(("signal", r.signal), ("step", r.step), ("checkpoint", r.checkpoint)))
    if isinstance(r, records.Resume):
        return Mark(t, "resume", _said(("step", r.step), ("checkpoint", r.checkpoint)))
    if isinstance(r, records.Checkpoint):
        return Mark(t, "checkpoint", _said(("step", r.step)))
    if isinstance(r, records.Eval):
        return Mark(t, "eval", _said(("step", r.step), ("accuracy", r.accuracy)))
    return None


def _said(*pairs: tuple[str, object]) -> str:
    return ", ".join(f"{name} {value}" for name, value in pairs if value is not None)


def _event_mark(e: RunEvent, t0: float) -> Mark:
    detail = e.detail if e.node is None else f"node{e.node}: {e.detail}"
    return Mark(e.time - t0, e.kind, detail)
