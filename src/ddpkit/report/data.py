"""What a report shows, read from a run folder: the run's record and events
(ddpkit.runs) and the job's metrics records (the JSON Lines `ddpkit train
--metrics` appends: `train`, `step_times`, `stall`, `straggler`,
`rank_report`, `eval`, `checkpoint`, `stop`, `resume`, `summary`).

The metrics file is, first found: the one given (`ddpkit report --metrics`),
`metrics.jsonl` in the run folder (where `launch local` has ddpkit train
write them), or the `--metrics` path in the job's command as the run
recorded it (spec.yaml)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..runs import RunEvent, StoredRun
from ..wire import METRICS_FLAG, flag_value


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
    train: list[dict[str, Any]] = field(default_factory=list)  # time (s since start), step, loss, images_per_s
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
    for path in candidates:
        if path.is_file() and path.stat().st_size > 0:
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


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record; a line cut short (a killed job) is skipped."""
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "kind" in rec:
            out.append(rec)
    return out


def load(run: StoredRun, metrics: Path | None = None) -> ReportData:
    path = metrics_file(run, metrics)
    records = read_records(path)
    plotted = [r for r in records if r["kind"] in ("train", "step_times")]
    if not plotted:
        raise NoMetrics(f"run {run.record.id}: {path} has no `train` or `step_times` records to plot "
                        f"({len(records)} other records); did the job train a step?")
    rec = run.record
    # The run's start; a record older than it (a metrics file appended to by
    # an earlier run) would sit left of zero, so the axis starts at the earliest.
    t0 = min([rec.started, *(float(r.get("time", rec.started)) for r in records)])
    data = ReportData(title=f"{rec.name} (run {rec.id}, {rec.target}: {rec.nodes}x{rec.nproc_per_node})",
                      started=t0, metrics_path=path)
    for r in records:
        _add_record(data, r, float(r.get("time", t0)) - t0)
    data.marks += [_event_mark(e, t0) for e in run.folder.events()]
    data.marks.sort(key=lambda m: m.time)
    return data


def _add_record(data: ReportData, r: dict[str, Any], t: float) -> None:
    kind = r["kind"]
    if kind == "train":
        data.train.append({"time": t, "step": r.get("step"), "loss": r.get("loss"),
                           "images_per_s": r.get("images_per_s")})
    elif kind == "step_times":
        data.step_times.append({"time": t, "step": r.get("step"), "step_s": list(r.get("step_s") or [])})
    elif kind == "rank_report":
        data.ranks = [row for row in data.ranks if row.get("rank") != r.get("rank")] + [r]
    elif kind in MARKED:
        data.marks.append(MARKED[kind](r, t))


def _stall(r: dict[str, Any], t: float) -> Mark:
    ranks = tuple(int(s["rank"]) for s in r.get("stalled") or [] if "rank" in s)
    return Mark(t, "stall", f"no progress for {r.get('idle_s', '?')} s (limit {r.get('limit_s', '?')} s)", ranks)


def _straggler(r: dict[str, Any], t: float) -> Mark:
    # Written by the straggler judge: whatever else it carries, the rank it names.
    ranks = tuple(int(x) for x in ([r["rank"]] if "rank" in r else r.get("ranks") or []))
    detail = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("kind", "time", "rank", "ranks"))
    return Mark(t, "straggler", detail, ranks)


def _simple(kind: str, fields: tuple[str, ...]) -> Any:
    def make(r: dict[str, Any], t: float) -> Mark:
        return Mark(t, kind, ", ".join(f"{f} {r[f]}" for f in fields if r.get(f) is not None))
    return make


MARKED = {
    "stall": _stall,
    "straggler": _straggler,
    "stop": _simple("preempted", ("signal", "step", "checkpoint")),
    "resume": _simple("resume", ("step", "checkpoint")),
    "checkpoint": _simple("checkpoint", ("step",)),
    "eval": _simple("eval", ("step", "accuracy")),
}


def _event_mark(e: RunEvent, t0: float) -> Mark:
    detail = e.detail if e.node is None else f"node{e.node}: {e.detail}"
    return Mark(e.time - t0, e.kind, detail)
