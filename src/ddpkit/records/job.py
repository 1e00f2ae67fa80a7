"""The records a running job sends its launcher: what its watchdog found
(a stall, a straggler, a lost node), an elastic job trained again, how
a worker ended and what its traceback said (its agent's records)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import ClassVar

from .base import Record, optional


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
class SameError(Record):
    """A worker failed with the same error as in the start before (its
    exception, its message without numbers, its innermost frame of the
    program's own code), no node lost between: a bug, not a fault. Its
    agent stops restarting and exits ExitCode.SAME_ERROR (agent/sameerror.py)."""

    kind: ClassVar[str] = "same_error"
    rank: int | None
    file: str
    line: int
    exception: str  # its type and normalised message, one line
    restart: int  # torchrun's restart count of the start it failed in again

    @property
    def verdict(self) -> str:
        """The closing words (a launcher's closing line ends with them)."""
        who = "" if self.rank is None else f", rank {self.rank}"
        return f"the same error twice{who}, {self.file}:{self.line}: a bug in the program, not a fault of the machine"


@dataclass(frozen=True)
class Cause(Record):
    """Why a worker of ddpkit's own program ends: the line every rank prints
    (the same agreed text) and its exit code; a launcher shows it once, last."""

    kind: ClassVar[str] = "cause"
    who: str  # the program: "ddpkit train"
    text: str
    exitcode: int

    @property
    def line(self) -> str:
        """The line for people, printed after the record."""
        return f"{self.who}: {self.text}"


def line_key(line: str) -> str:
    """What a record names one of the lines it stands for by (`hides`): a short
    digest of the line's text, so that a reader matches those lines by their
    content on their stream, whatever arrives between or around them."""
    return f"{zlib.crc32(line.encode('utf-8', 'replace')):08x}"


def keys_of(lines: list[str]) -> tuple[str, ...]:
    return tuple(line_key(line) for line in lines)


@dataclass(frozen=True)
class Traceback(Record):
    """A worker's traceback, `lines` lines long, on its rank's output: for
    the node's log; a console shows `line` (its exception) instead."""

    kind: ClassVar[str] = "traceback"
    lines: int
    line: str
    at: str | None = optional()  # where it was raised: the innermost frame of the program's own code
    # Its collective lost a peer (gloo's, NCCL's or the store's connection closed): most
    # often the knock-on of another rank's failure, not a failure of its own.
    knock_on: bool | None = optional()
    # each of its lines' `line_key`: how a reader finds them, not what the record says (a writer before them: none)
    hides: tuple[str, ...] | None = optional(compare=False)


@dataclass(frozen=True)
class AgentReport(Record):
    """The agent's own report follows, `lines` lines long (torch's
    ChildFailedError and its box on a failed worker, its SignalException's
    traceback when a signal stopped it): for the node's log, not a console."""

    kind: ClassVar[str] = "agent_report"
    lines: int
    # each of its lines' `line_key`: how a reader finds them, not what the record says (a writer before them: none)
    hides: tuple[str, ...] | None = optional(compare=False)

    @classmethod
    def of(cls, text: str) -> AgentReport:
        """The record for the report `text` (whole lines, each ending with a newline)."""
        lines = text.split("\n")[:text.count("\n")]
        return cls(lines=len(lines), hides=keys_of(lines))
