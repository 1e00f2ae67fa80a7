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
  `kubectl logs`) shows the human line and the record. The frame opens with
  the ASCII record separator, which no line a person prints starts with.

A record written before versions were (no "v") is version 1. An unknown
kind, a newer version or a missing field is a RecordError naming it.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import IO, Any, ClassVar, Union

FRAME = "\x1eddpkit-record "
OMITTED_WHEN_NONE = "omitted when none"


def optional() -> Any:
    """A field that some writers of its kind never fill: left out of the JSON when None."""
    return field(default=None, metadata={OMITTED_WHEN_NONE: True})


class RecordError(ValueError):
    """A record this reader cannot read; the message says which and why."""


@dataclass(frozen=True)
class Record:
    """The base of every record: its kind and the version of its fields."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1


# ---- what the watchdog reports -------------------------------------------------------------


@dataclass(frozen=True)
class StalledRank:
    """One rank a stall report names, with where its main thread was."""

    rank: int
    node: int
    host: str
    pid: int
    step: int
    phase: str
    idle_s: float
    frozen_s: float | None  # seconds without a heartbeat: the process itself was stopped
    frame: str | None = None  # its main thread's frame, when it sent its stacks
    dump: str | None = None  # its stack file

    @property
    def where(self) -> str:
        if self.frozen_s is not None:
            return (f"frozen: no heartbeat for {self.frozen_s:.0f}s (stopped, e.g. SIGSTOP, or blocked in native "
                    "code holding the GIL); its last heartbeat is all there is")
        return f"at {self.frame}" if self.frame is not None else "no stack received"

    @property
    def detail(self) -> str:
        return f"step {self.step}, phase {self.phase}, {self.where}"

    @property
    def line(self) -> str:
        """The launcher's summary line for it."""
        return f"rank {self.rank} ({self.host}): {self.detail}"


@dataclass(frozen=True)
class Stall(Record):
    """The hang watchdog stopped the job: no progress for `idle_s`."""

    kind: ClassVar[str] = "stall"
    idle_s: float
    limit_s: float
    stalled: tuple[StalledRank, ...]
    waiting: tuple[int, ...]  # ranks that waited for them
    no_stack: tuple[int, ...]  # ranks that sent no stacks
    dumps: str  # where every rank's stacks are


@dataclass(frozen=True)
class Straggler(Record):
    """The straggler judge named a rank (`state` slow), or saw it catch up."""

    kind: ClassVar[str] = "straggler"
    state: str  # "slow" or "caught_up"
    rank: int
    node: int
    host: str
    step: int
    own_s: float  # the median of its own work a step
    median_s: float  # the job's
    ratio: float
    factor: float  # the judge's limit
    window_steps: int

    @property
    def slow(self) -> bool:
        return self.state == "slow"

    @property
    def detail(self) -> str:
        return (f"{self.own_s:.3f}s of own work a step against the job's median {self.median_s:.3f}s "
                f"({self.ratio:.1f}x, limit {self.factor:g}x) at step {self.step}")

    @property
    def line(self) -> str:
        """The launcher's summary line for it."""
        return f"rank {self.rank} ({self.host}): {self.detail}"


@dataclass(frozen=True)
class LostRank:
    """One rank of a node the watchdog found silent."""

    rank: int
    node: int
    host: str
    pid: int
    step: int
    phase: str
    silent_s: float

    @property
    def reason(self) -> str:
        return (f"no heartbeat for {self.silent_s:.0f}s, noticed by the job's heartbeats (frozen, or cut off "
                "without a reset)")


@dataclass(frozen=True)
class NodeLost(Record):
    """Every rank of a node was silent for `loss_s`: the job leaves it (`action`)."""

    kind: ClassVar[str] = "lost"
    by: int  # the monitor rank that declared it
    noticed_by: str
    loss_s: float
    action: str  # "re-form" (elastic: the agents go on without it) or "stop"
    lost: tuple[LostRank, ...]


@dataclass(frozen=True)
class Reformed(Record):
    """An elastic job trains again after a new rendezvous (the new rank 0 says so)."""

    kind: ClassVar[str] = "reformed"
    restart: int
    max_restarts: int
    world: int
    saved_world: int | None  # the world size that wrote the checkpoint it resumed from

    @property
    def before(self) -> int:
        return self.world if self.saved_world is None else self.saved_world


@dataclass(frozen=True)
class WorkerExit(Record):
    """A worker ended with a failure (the agent that started it says so)."""

    kind: ClassVar[str] = "worker_exit"
    rank: int | None
    local_rank: int | None
    pid: int
    exitcode: int  # a signal as a negative number, as Popen says it

    @property
    def line(self) -> str:
        who = "worker" if self.rank is None else f"worker rank {self.rank}"
        return f"{who} (pid {self.pid}) failed (exitcode: {self.exitcode})"


@dataclass(frozen=True)
class AgentReport(Record):
    """The agent's own report on a failed worker follows, `lines` lines long
    (torch's ChildFailedError and its box): for the node's log, not a console."""

    kind: ClassVar[str] = "agent_report"
    lines: int


# ---- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Train(Record):
    kind: ClassVar[str] = "train"
    step: int
    loss: float | None
    images_per_s: float
    epoch: int | None = optional()  # the trainer's; a program of the user's own has none
    lr: float | None = optional()
    loss_is: str | None = optional()  # what the loss is, where it is not the trainer's own


@dataclass(frozen=True)
class Eval(Record):
    kind: ClassVar[str] = "eval"
    step: int
    epoch: int
    accuracy: float
    loss: float
    correct: int
    total: int


@dataclass(frozen=True)
class StepTimes(Record):
    """Each rank's mean time a step over the window before `step`."""

    kind: ClassVar[str] = "step_times"
    step: int
    step_s: tuple[float, ...]


@dataclass(frozen=True)
class RankRow(Record):
    """One process's row of the rank report."""

    kind: ClassVar[str] = "rank_report"
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    device: str
    interface: str | None
    address: str | None
    torch: str
    cuda: str | None
    nccl: str | None
    launcher: str
    # The rest has defaults so that rows forged or built in tests stay short.
    world_size: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    backend: str = ""
    nccl_socket_ifname: str | None = None
    gloo_socket_ifname: str | None = None
    # --rank-report-env NAME: the value of each named variable in this process (None: unset)
    env: dict[str, str | None] = field(default_factory=dict)

    @property
    def versions(self) -> tuple[str, str | None, str | None]:
        return (self.torch, self.cuda, self.nccl)


@dataclass(frozen=True)
class Checkpoint(Record):
    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str
    from_memory: str | None = optional()  # why a checkpoint was written from the copy in memory


@dataclass(frozen=True)
class Stop(Record):
    """A stop signal: checkpointed and stopped."""

    kind: ClassVar[str] = "stop"
    signal: str | None
    step: int
    checkpoint: str | None
    slurm_restart_count: int


@dataclass(frozen=True)
class Resume(Record):
    kind: ClassVar[str] = "resume"
    step: int
    epoch: int
    checkpoint: str


@dataclass(frozen=True)
class Startup(Record):
    """How long this process took from its start to its first step, by phase."""

    kind: ClassVar[str] = "startup"
    stamps: dict[str, float]
    phases: dict[str, float]
    total: float
    process_start_from: str
    pid: int


@dataclass(frozen=True)
class Summary(Record):
    """How the run ended."""

    kind: ClassVar[str] = "summary"
    status: str
    steps: int
    epochs_completed: int
    seconds: float
    images_per_second: float
    accuracy: float | None
    eval_loss: float | None
    checkpoint: str | None
    world_size: int
    global_batch: int


KINDS: dict[str, type[Record]] = {cls.kind: cls for cls in (
    Stall, Straggler, NodeLost, Reformed, WorkerExit, AgentReport,
    Train, Eval, StepTimes, RankRow, Checkpoint, Stop, Resume, Startup, Summary)}


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


def encode(record: Record, time: float | None = None) -> str:
    """One line of JSON (no newline): kind, version, time when given, the fields
    (an `optional()` field only when it has a value)."""
    head: dict[str, Any] = {"kind": record.kind, "v": record.version}
    if time is not None:
        head["time"] = round(time, 3)
    return json.dumps({**head, **fields_of(record)})


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


def frame(record: Record) -> str:
    """The record as one framed line for a job's output (no newline)."""
    return FRAME + encode(record)


def unframe(body: str) -> Stamped | None:
    """The record of a framed line (after any rank prefix); None for any other
    line; RecordError for a framed line this reader cannot read."""
    return decode(body[len(FRAME):]) if body.startswith(FRAME) else None


def emit(record: Record, stream: IO[str] | None = None) -> None:
    """Print the framed record on `stream` (stderr), in one write."""
    out = sys.stderr if stream is None else stream
    out.write(frame(record) + "\n")
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

