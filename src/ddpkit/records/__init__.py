"""Every record a job sends back: what its watchdog found, how a worker
ended, and its metrics. One writer (`encode`) and one reader (`decode`).

A record is a frozen dataclass with a `kind` and a `version`; on the wire it
is one JSON object, `{"kind": ..., "v": ..., "time": ..., <fields>}` (time:
when it was written, when known). The same text travels on one of two
channels, chosen by who reads it (`send`, `emit`):

- framed on a job's stderr (`frame`: `FRAME` + the JSON) where a ddpkit
  launcher reads that stream (`launch local`, `launch ssh`, `launch docker`,
  the rendered `launch.sh`): it recognises the frame with `str.startswith`
  (after torchrun's rank prefix), decodes it, acts on it at once (a stall,
  a lost node, a worker's own exit code) and keeps it off the console. The
  frame is plain printable ASCII: a control character (the ASCII record
  separator, say) would be a line break to Python's str.splitlines and to
  tools like it.
- appended to a JSON Lines file, one record a line, always with its time,
  where people read the raw stream and no launcher folds it: the job's
  environment names a folder (`DDPKIT_RECORDS`, `CHANNEL_VAR`), and each
  node writes `<folder>/<host>.jsonl` (`node_file`). The rendered Slurm job
  sets it to a folder beside its output file on the shared file system
  (`slurm_folder`), where `ddpkit status` and `ddpkit report` read it back
  (`read_folder`); the compose and Kubernetes jobs to a folder
  of each container's. A file per node, not one for the job: O_APPEND keeps
  lines whole between the processes of one host, but not between hosts on
  NFS. Not the rendezvous store: a record must outlive the store (a lost
  node 0, a job that ended), and a file is what a person or `report` can
  read after the job. Not a descriptor of its own either: torchrun hands a
  worker stdout and stderr only, and a Slurm task's other descriptors reach
  no one.

The `--metrics` file is the same JSON Lines, one record a line.

A record written before versions were (no "v") is version 1. An unknown
kind, a newer version or a missing field is a RecordError naming it.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time as clock
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import IO, Any, Union

from .appending import Appender
from .base import OMITTED_WHEN_NONE, Record, RecordError
from .job import (
    AgentReport,
    Cause,
    LostRank,
    NodeLost,
    Reformed,
    SameError,
    Stall,
    StalledRank,
    Straggler,
    Traceback,
    WorkerExit,
    keys_of,
    line_key,
)
from .lines import RANK_TAG_CLOSE, RANK_TAG_FLAG, RANK_TAG_OPEN, is_bare_tag, rank_tagged, tag_starts, task_labelled
from .metrics import Checkpoint, Eval, RankRow, Resume, Startup, StepTimes, Stop, Summary, Train

__all__ = ["FRAME", "Appender", "KINDS", "METRICS_FILE_KINDS", "RANK_TAG_CLOSE", "RANK_TAG_FLAG", "RANK_TAG_OPEN",
           "AgentReport", "Cause", "Checkpoint", "Eval",
           "LostRank", "NodeLost", "RankRow", "Record", "RecordError", "Reformed", "Resume", "SameError", "Stall", "StalledRank",
           "Stamped", "StepTimes", "Startup", "Stop", "Straggler", "Summary", "Traceback", "Train", "WorkerExit", "append",
           "CHANNEL_VAR", "COMPOSE_FOLDER", "CONTAINER_FOLDER", "channel", "decode", "emit", "encode", "frame", "from_fields",
           "is_bare_tag", "is_frame",
           "keys_of", "line_key", "node_file", "rank_tagged", "read_file", "read_folder", "send", "slurm_folder",
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
    names, omit = _shape(type(record))
    out = {}
    for name in names:
        value = getattr(record, name)
        if not (value is None and name in omit):
            out[name] = _plain(value)
    return out


_SHAPES: dict[type, tuple[tuple[str, ...], frozenset[str]]] = {}


def _shape(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """A record class's field names, and those left out when None: read once per class
    (dataclasses.fields and asdict's deep copy cost more than the encoding itself)."""
    shape = _SHAPES.get(cls)
    if shape is None:
        shape = _SHAPES[cls] = (tuple(f.name for f in fields(cls)),
                                frozenset(f.name for f in fields(cls) if f.metadata.get(OMITTED_WHEN_NONE)))
    return shape


def _plain(value: Any) -> Any:
    """`value` as asdict() gives it (nested dataclasses as dicts, containers copied), for JSON."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return {name: _plain(getattr(value, name)) for name in _shape(type(value))[0]}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)  # anything else, as asdict() copies it


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


# ---- the channel -----------------------------------------------------------------------------

CHANNEL_VAR = "DDPKIT_RECORDS"  # envnames.DDPKIT_RECORDS (this package imports nothing of ddpkit's)
SLURM_FOLDER = "{name}-{job}.records"  # beside the job's output file, `%x-%j.out` by default
# A rendered Kubernetes job's folder where it has no shared volume, in each pod's container:
# gone with the pod (an ended pod's files cannot be copied), while `kubectl logs` still shows its
# output; `kubectl cp POD:/tmp/ddpkit-records .` while the container runs.
CONTAINER_FOLDER = "/tmp/ddpkit-records"
# A rendered compose job's folder, in each container: kept, as its output is, until `docker compose
# down` removes the container (`docker compose cp node0:/var/tmp/ddpkit-records .` reads an exited
# one too), so that a node's log there outlives the node as a Slurm node's does.
COMPOSE_FOLDER = "/var/tmp/ddpkit-records"


def channel(env: dict[str, str] | None = None) -> Path | None:
    """The folder this process's records go to; None: framed on stderr."""
    value = (os.environ if env is None else env).get(CHANNEL_VAR, "")
    return Path(value) if value else None


def node_file(folder: Path, host: str | None = None) -> Path:
    """This node's records file in the channel's folder: named after the node
    as Slurm knows it (its slurmd's name: several may share a host name), else the host."""
    return folder / f"{host or os.environ.get('SLURMD_NODENAME') or socket.gethostname()}.jsonl"


def slurm_folder(submit_dir: Path, name: str, job_id: int) -> Path:
    """The records folder of Slurm job `job_id` of job spec `name` submitted from
    `submit_dir` (the rendered script sets the same: `${SLURM_SUBMIT_DIR}/NAME-${SLURM_JOB_ID}.records`)."""
    return submit_dir / SLURM_FOLDER.format(name=name, job=job_id)


def send(record: Record, time: float | None = None) -> str | None:
    """Keep the record on this process's channel: appended to its node's file
    (None is returned), or its frame returned for the caller to write into the
    stream beside its lines (where the order of the two matters to the launcher).
    A folder that cannot be written falls back to the frame: a record in the
    output is better than none."""
    folder = channel()
    if folder is not None:
        try:
            append(node_file(folder), record, clock.time() if time is None else time, kept=_SENT)
            return None
        except OSError:
            pass
    return frame(record, time)


_SENT = Appender()  # this process's node file, kept open (records/appending.py says what that must not lose)


def emit(record: Record, stream: IO[str] | None = None, time: float | None = None) -> None:
    """Send the record on its channel (`send`): its node's file, or framed on
    `stream` (stderr) in one write; `time`: when it happened."""
    framed = send(record, time)
    if framed is None:
        return
    out = sys.stderr if stream is None else stream
    out.write(framed + "\n")
    out.flush()


# ---- building records from JSON ------------------------------------------------------------


_HINTS: dict[type, tuple[dict[str, Any], frozenset[str]]] = {}


def _hints(cls: type[Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """A record class's field types and the fields its constructor takes, read once per
    class: get_type_hints evaluates every annotation's text anew on each call, which
    was most of the launcher's cost of reading a record."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = (typing.get_type_hints(cls), frozenset(f.name for f in fields(cls) if f.init))
    return hints


def _build(cls: type[Any], body: dict[str, Any]) -> Any:
    hints, known = _hints(cls)
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



def append(path: Path, record: Record, time: float | None = None, kept: Appender | None = None) -> None:
    """Append the record to a JSON Lines file (made with its folder), in one
    write: O_APPEND keeps lines from several processes whole. `kept`: the
    Appender that keeps the file open for a writer of many records; without
    it the file is opened for this record alone. OSError when it cannot be written."""
    line = encode(record, time) + "\n"
    if kept is not None:
        kept.write(path, line)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(line)


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


def read_folder(folder: Path) -> list[Stamped]:
    """Every record of a channel's folder (each node's file, `read_file`),
    ordered by the time each was written (a file's own order where times tie)."""
    found = [s for path in sorted(folder.glob("*.jsonl")) for s in read_file(path)] if folder.is_dir() else []
    return sorted(found, key=lambda s: -1.0 if s.time is None else s.time)
