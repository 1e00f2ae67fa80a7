"""Every record a job sends back: what its watchdog found, how a worker
ended, and its metrics. One writer (`encode`) and one reader (`decode`).

A record is a frozen dataclass with a `kind` and a `version`; on the wire it
is one JSON object, `{"kind": ..., "v": ..., "time": ..., <fields>}` (time:
when it was written, when known). The same text travels two ways:

- appended to a JSON Lines file (the `--metrics` file), one record a line;
- framed on a job's stderr (`frame`): `FRAME` + the JSON, printed beside the
  line a person reads. A launcher reading the job's output recognises the
  frame with `str.startswith` (after torchrun's rank prefix), decodes it
  and keeps it off the console; a log read by hand (Slurm's output files,
  `kubectl logs`) shows the human line and the record. The frame is plain
  printable ASCII: a control character (the ASCII record separator, say)
  would be a line break to Python's str.splitlines and to tools like it.

A record written before versions were (no "v") is version 1. An unknown
kind, a newer version or a missing field is a RecordError naming it.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import IO, Any, Union

from .base import OMITTED_WHEN_NONE, Record, RecordError
from .job import AgentReport, Cause, LostRank, NodeLost, Reformed, SameError, Stall, StalledRank, Straggler, Traceback, WorkerExit
from .lines import RANK_TAG_CLOSE, RANK_TAG_FLAG, RANK_TAG_OPEN, is_bare_tag, rank_tagged, tag_starts, task_labelled
from .metrics import Checkpoint, Eval, RankRow, Resume, Startup, StepTimes, Stop, Summary, Train

__all__ = ["FRAME", "KINDS", "METRICS_FILE_KINDS", "RANK_TAG_CLOSE", "RANK_TAG_FLAG", "RANK_TAG_OPEN",
           "AgentReport", "Cause", "Checkpoint", "Eval",
           "LostRank", "NodeLost", "RankRow", "Record", "RecordError", "Reformed", "Resume", "SameError", "Stall", "StalledRank",
           "Stamped", "StepTimes", "Startup", "Stop", "Straggler", "Summary", "Traceback", "Train", "WorkerExit", "append",
           "decode", "emit", "encode", "frame", "from_fields", "is_bare_tag", "is_frame", "rank_tagged", "read_file",
           "stamped_frame_pattern", "tag_starts", "task_labelled", "to_json", "unframe"]

FRAME = "@@ddpkit-record "

KINDS: dict[str, type[Record]] = {cls.kind: cls for cls in (
    Stall, Straggler, NodeLost, Reformed, WorkerExit, SameError, AgentReport, Traceback, Cause,
    Train, Eval, StepTimes, RankRow, Checkpoint, Stop, Resume, Startup, Summary)}
# What a metrics file holds (what `ddpkit report` reads): the metrics, and the
# watchdog's reports; a worker's exit and the agent's notes are the launcher's only.
METRICS_FILE_KINDS: tuple[type[Record], ...] = (
    Train, Eval, StepTimes, RankRow, Checkpoint, Stop, Resume, Startup, Summary, Stall, Straggler, NodeLost)


@dataclass(frozen=True)
class Stamped:
    """A record as read, with the time it was written (epoch seconds; None: not said)."""

    record: Record
    time: float | None = None


# ---- the writer and the reader -------------------------------------------------------------


def fields_of(record: Record) -> dict[str, Any]:
    """The record's fields as JSON values (nested records as objects, tuples as lists)."""
    omit = {f.name for f in fields(record) if f.metadata.get(OMITTED_WHEN_NONE)}
    return {k: v for k, v in asdict(record).items() if not (v is None and k in omit)}


def to_json(record: Record, time: float | None = None) -> dict[str, Any]:
    """The record as a JSON object: kind, version, time when given, the fields
    (an `optional()` field only when it has a value)."""
    head: dict[str, Any] = {"kind": record.kind, "v": record.version}
    if time is not None:
        head["time"] = round(time, 3)
    return {**head, **fields_of(record)}


def encode(record: Record, time: float | None = None) -> str:
    """The record as one line of JSON (no newline)."""
    return json.dumps(to_json(record, time))


def decode(text: str) -> Stamped:
    """The record one line of JSON holds; RecordError when it holds none this reader knows."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise RecordError(f"not a record: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise RecordError("not a record: no kind")
    return from_fields(obj)


def from_fields(obj: dict[str, Any]) -> Stamped:
    """The record of a decoded JSON object: `kind`, optional `v` and `time`, the fields."""
    kind = obj.get("kind")
    cls = KINDS.get(str(kind))
    if cls is None:
        raise RecordError(f"unknown record kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    version = obj.get("v", 1)
    if version != cls.version:
        raise RecordError(f"record {kind!r} of version {version!r}: this reader knows version {cls.version}")
    body = {k: v for k, v in obj.items() if k not in ("kind", "v", "time")}
    time = obj.get("time")
    return Stamped(_build(cls, body), None if time is None else float(time))


def frame(record: Record, time: float | None = None) -> str:
    """The record as one framed line for a job's output (no newline); `time`:
    when it was written (a worker's failure, a metrics record the launcher keeps)."""
    return FRAME + encode(record, time)


def stamped_frame_pattern(kind: type[Record]) -> str:
    """A POSIX extended regex (bash's `=~`) that finds the framed line of a
    record of this kind written with a time, and captures the time: for a
    reader with no Python (the rendered bash launcher)."""
    head = FRAME + json.dumps({"kind": kind.kind})[:-1]
    return "".join(f"[{c}]" if c in ".[{}()*+?$|" else f"\\{c}" if c in "\\^]" else c for c in head) \
        + r', "v": [0-9]+, "time": ([0-9.]+)'


def is_frame(body: str) -> bool:
    """Whether a line (after its rank tag or task label) is a framed record, not text for people."""
    return body.startswith(FRAME)


def unframe(body: str) -> Stamped | None:
    """The record of a framed line (after any rank prefix); None for any other
    line; RecordError for a framed line this reader cannot read."""
    return decode(body[len(FRAME):]) if body.startswith(FRAME) else None


def emit(record: Record, stream: IO[str] | None = None, time: float | None = None) -> None:
    """Print the framed record on `stream` (stderr), in one write; `time`: when it happened."""
    out = sys.stderr if stream is None else stream
    out.write(frame(record, time) + "\n")
    out.flush()


# ---- building records from JSON ------------------------------------------------------------


def _build(cls: type[Any], body: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls) if f.init}
    extra = sorted(set(body) - known)
    if extra:
        raise RecordError(f"{_name(cls)}: unknown field(s) {', '.join(extra)}")
    try:
        return cls(**{name: _value(hints[name], value, f"{_name(cls)}.{name}") for name, value in body.items()})
    except TypeError as exc:  # a field without a default missing
        raise RecordError(f"{_name(cls)}: {exc}") from None


def _name(cls: type) -> str:
    kind = getattr(cls, "kind", "")
    return repr(kind) if kind else cls.__name__


def _value(hint: Any, value: Any, where: str) -> Any:
    """`value` as the field's type: nested records built, lists made tuples."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, list):
            raise RecordError(f"{where}: a list expected, got {value!r}")
        return tuple(_value(args[0], v, where) for v in value)
    if isinstance(hint, type) and is_dataclass(hint):
        if not isinstance(value, dict):
            raise RecordError(f"{where}: an object expected, got {value!r}")
        return _build(hint, value)
    return value



def append(path: Path, record: Record, time: float | None = None) -> None:
    """Append the record to a JSON Lines file (made with its folder), in one
    write: O_APPEND keeps lines from several processes whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(encode(record, time) + "\n")


def read_file(path: Path) -> list[Stamped]:
    """Every record of a JSON Lines file that this reader knows, in order. A
    line cut short (a killed job) is skipped, and so is a record of a kind or
    version it does not know (a newer ddpkit's): a reader of a run's file
    takes what it can use."""
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            out.append(decode(line))
        except RecordError:
            continue
    return out
