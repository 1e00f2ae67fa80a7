"""The hang watchdog's model: what the training loop reports, what a rank
publishes, and the rule that decides a job has stalled.

The loop's cost per step is a few attribute writes on `PULSE` (no lock, no
I/O, no collective); a daemon thread (`train/watchdog/stall.py`) publishes the pulse
to the rendezvous store once per `Settings.interval_s`, and one or two
monitor ranks read every rank's heartbeat with one `multi_get` and apply
`Judge`. Every time in the judgement is the monitor's own monotonic clock
(when it saw a value change), so clocks of different hosts never meet.

docs/guides/hangs.md is the user's page; this module has no torch import, so the
judge can be benchmarked and tested without a process group.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

from ...shared import envnames


class Phase(str, Enum):
    """Where a rank is, in the order a step goes through them: among ranks at
    the same step, the one furthest behind is the one the others wait for."""

    SETUP = "setup"  # before the first step: not judged alone; named when the others wait in their first step
    DONE = "done"  # training ended; the rank is leaving (not judged either)
    # Start-up's collectives (DDP's broadcast of the parameters): a rank here waits for every other
    # rank's start-up, so it is judged (with first_step_s) and a rank still in setup is named.
    SYNC = "sync"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"  # DDP's all-reduce runs here: a healthy rank waits here for a stalled one
    OPTIMIZER = "optimizer"
    TRAIN = "train"  # a user script's step (no finer phases)
    EVAL = "eval"
    CHECKPOINT = "checkpoint"

    @property
    def order(self) -> int:
        return _ORDER[self]


_ORDER = {p: i for i, p in enumerate(Phase)}
UNJUDGED = frozenset({Phase.SETUP, Phase.DONE})
START_UP = frozenset({Phase.SETUP, Phase.SYNC})  # before the first step
FACTOR = 5  # the limit is never below FACTOR x the slowest observed step time
FIRST_STEP_FACTOR = 5  # default first_step_s = FIRST_STEP_FACTOR x stall_s (compilation, autotuning, caches)
# A heartbeat unchanged this long (or stall_s / 2, when that is shorter,
# but at least 3 intervals): the process itself is not running.
FROZEN_S = 5.0


class Pulse:
    """What the training loop updates: the cheapest possible shared state.
    Written by the loop's thread only; the publisher reads it (an int or a str
    attribute is read whole under the GIL, so no lock is needed)."""

    __slots__ = ("beats", "phase", "step")

    def __init__(self) -> None:
        self.step = 0
        self.beats = 0  # every report counts, not only steps: eval batches, checkpoint stages
        self.phase = Phase.SETUP


PULSE = Pulse()


def progress(step: int, phase: Phase | None = None) -> None:
    """Step `step` finished (the hot path: a few attribute writes). Without a
    phase, the rank keeps its current one, or TRAIN after start-up (SETUP,
    SYNC: a first step ends it)."""
    PULSE.step = step
    if phase is not None:
        PULSE.phase = phase
    elif PULSE.phase in START_UP:
        PULSE.phase = Phase.TRAIN
    PULSE.beats += 1


def mark(phase: Phase) -> None:
    """The rank moved on to `phase` (a sign of life without a new step)."""
    PULSE.phase = phase
    PULSE.beats += 1


@contextmanager
def in_phase(phase: Phase) -> Iterator[None]:
    """`with in_phase(Phase.EVAL): ...`: the phase while the block runs, the
    previous one after it."""
    before = PULSE.phase
    mark(phase)
    try:
        yield
    finally:
        mark(before)


@dataclass(frozen=True)
class Settings:
    """The spec's `watchdog:` section, as the job environment carries it."""

    stall_s: float = 60.0  # 0: off
    first_step_s: float | None = None  # None: FIRST_STEP_FACTOR x stall_s
    interval_s: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.stall_s > 0

    @property
    def first_step_limit(self) -> float:
        return self.first_step_s if self.first_step_s is not None else FIRST_STEP_FACTOR * self.stall_s

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """Absent variables give the defaults (a job started by hand is watched
        too); a value that is no number is refused at start-up (exit 2)."""
        stall = env.get(envnames.DDPKIT_WATCHDOG_STALL_S)
        first = env.get(envnames.DDPKIT_WATCHDOG_FIRST_STEP_S)
        try:
            return cls(stall_s=float(stall) if stall else cls.stall_s,
                       first_step_s=float(first) if first else None)
        except ValueError:
            raise ValueError(f"{envnames.DDPKIT_WATCHDOG_STALL_S}={stall!r} / {envnames.DDPKIT_WATCHDOG_FIRST_STEP_S}="
                             f"{first!r}: give seconds as numbers (0 turns the watchdog off)") from None


@dataclass(frozen=True)
class Beat:
    """One rank's published heartbeat. `seq` grows with every publish (the
    process runs), `beats` with every report of the loop (it makes progress)."""

    rank: int
    seq: int
    beats: int
    step: int
    phase: Phase
    step_s: float  # the slowest recent step time this rank saw (0: none yet)
    warm: bool  # this process finished a step since its watchdog started
    node: int
    pid: int
    host: str

    def encode(self) -> bytes:
        # A space-separated line, not JSON: the monitor parses N of these per check.
        return (f"{self.seq} {self.beats} {self.step} {self.phase.value} {self.step_s:.4f} {int(self.warm)} "
                f"{self.node} {self.pid} {self.host}").encode()

    @classmethod
    def decode(cls, rank: int, raw: bytes) -> Beat:
        seq, beats, step, phase, step_s, warm, node, pid, host = raw.decode().split(" ", 8)
        return cls(rank, int(seq), int(beats), int(step), Phase(phase), float(step_s), warm == "1", int(node),
                   int(pid), host)


@dataclass
class _Seen:
    beat: Beat
    alive_at: float  # monitor time when `seq` last changed
    progress_at: float  # monitor time when `beats` last changed


@dataclass(frozen=True)
class Suspect:
    """A rank the report names, with what the monitor knew of it."""

    beat: Beat
    idle_s: float  # seconds without progress
    frozen_s: float | None  # seconds without any heartbeat, when it looks frozen (SIGSTOP, no GIL)


@dataclass(frozen=True)
class Verdict:
    idle_s: float
    limit_s: float
    suspects: tuple[Suspect, ...]
    waiting: tuple[int, ...] = ()  # ranks that only wait for the suspects


@dataclass
class Judge:
    """Decides, from successive snapshots of every rank's heartbeat, whether
    the job has stalled (no rank made progress for the limit), and which
    ranks the others wait for."""

    world: int
    settings: Settings
    seen: dict[int, _Seen] = field(default_factory=dict)
    said_slow: set[int] = field(default_factory=set)  # ranks already named slow to start

    def observe(self, beats: Sequence[Beat | None], now: float) -> Verdict | None:
        """One check. `beats[r]` is None while rank r has not published yet."""
        for beat in beats:
            if beat is not None:
                self._update(beat, now)
        # The job stalls when NO rank made progress for the limit: ranks that
        # wait while another works (a rank-0-only log, an uneven evaluation)
        # are no stall, and a real hang stops every rank within one step.
        judged = [s for s in self.seen.values() if s.beat.phase not in UNJUDGED]
        if not judged:
            return None
        limit = self._limit(judged)
        # A rank in start-up is not judged, but its signs of life count: one that
        # reads a checkpoint slowly is moving, and the ranks waiting for it are no stall.
        moving = [s for s in self.seen.values() if s.beat.phase is not Phase.DONE]
        idle = now - max(s.progress_at for s in moving)
        return self._verdict(now, idle, limit) if idle > limit else None

    def _update(self, beat: Beat, now: float) -> None:
        old = self.seen.get(beat.rank)
        if old is None:
            self.seen[beat.rank] = _Seen(beat, now, now)
            return
        if beat.seq != old.beat.seq:
            old.alive_at = now
        if beat.beats != old.beat.beats:
            old.progress_at = now
        old.beat = beat

    def slow_starters(self, now: float) -> tuple[float, list[Beat]]:
        """Ranks still in start-up, and moving, while the ranks ready for their
        first step have waited longer than the limit: slow, not stuck (a stuck
        one ends in a verdict). Each is named once; with how long the others
        have waited."""
        waiting = [s for s in self.seen.values() if s.beat.phase is Phase.SYNC]
        if not waiting:
            return 0.0, []
        waited = now - max(s.progress_at for s in waiting)
        if waited <= self._limit(waiting):
            return waited, []
        slow = [s.beat for s in self.seen.values() if s.beat.phase is Phase.SETUP and s.beat.rank not in self.said_slow]
        self.said_slow.update(b.rank for b in slow)
        return waited, sorted(slow, key=lambda b: b.rank)

    def limit_s(self) -> float:
        """stall_s, but never below FACTOR x the slowest step any rank reported."""
        slowest = max((s.beat.step_s for s in self.seen.values()), default=0.0)
        return max(self.settings.stall_s, FACTOR * slowest)

    def _limit(self, judged: list[_Seen]) -> float:
        """The first step (compilation, autotuning, cold caches) and a
        checkpoint write get first_step_s. The first step is the job's: once
        any rank finished one, every rank did (its all-reduce needed them
        all), whatever a stale heartbeat of a frozen rank still says."""
        cold = not any(s.beat.warm for s in judged)
        writing = any(s.beat.phase is Phase.CHECKPOINT for s in judged)
        base = self.limit_s()
        return max(base, self.settings.first_step_limit) if cold or writing else base

    def _frozen_s(self, seen: _Seen, now: float) -> float | None:
        silent = now - seen.alive_at
        after = max(3 * self.settings.interval_s, min(FROZEN_S, self.settings.stall_s / 2))
        return silent if silent > after else None

    def _verdict(self, now: float, idle: float, limit: float) -> Verdict:
        """Frozen ranks when there are any (their own heartbeat stopped);
        otherwise ranks still in start-up (a checkpoint read, a model build,
        a lock that never returns) while the others wait in the first step
        for them; otherwise the ranks furthest behind (lowest step, then
        earliest phase: a rank in forward is what ranks in backward's
        all-reduce wait for)."""
        states = sorted(self.seen.values(), key=lambda s: s.beat.rank)
        frozen = [s for s in states if self._frozen_s(s, now) is not None]
        starting = [s for s in states if s.beat.phase is Phase.SETUP]
        if frozen:
            named = frozen
        elif starting:
            named = starting
        else:
            judged = [s for s in states if s.beat.phase not in UNJUDGED]
            behind = min((s.beat.step, s.beat.phase.order) for s in judged)
            named = [s for s in judged if (s.beat.step, s.beat.phase.order) == behind]
        suspects = tuple(Suspect(s.beat, now - s.progress_at, self._frozen_s(s, now)) for s in named)
        named_ranks = {s.beat.rank for s in named}
        waiting = tuple(s.beat.rank for s in states if s.beat.rank not in named_ranks)
        missing = [r for r in range(self.world) if r not in self.seen]
        return Verdict(idle, limit, suspects, tuple(sorted(waiting + tuple(missing))))


def monitors(world: int, local_world: int) -> tuple[int, ...]:
    """Ranks that judge: rank 0, and a backup on another node (or rank 1 on
    one node) so that a frozen rank 0 is found too. Only two, so the store
    serves 2 x world heartbeat reads per check however large the job."""
    if world <= 1:
        return (0,)
    backup = local_world if world > local_world else 1
    return (0, backup)
