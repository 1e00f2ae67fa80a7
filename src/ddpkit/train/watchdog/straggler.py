"""Stragglers: a rank whose own work per step is well above the job's.

Under DDP every rank's whole step lasts as long as the slowest rank's (the
others wait for it inside backward's all-reduce), so step times name nobody.
Each rank's training loop times its OWN work instead (train/watchdog/worktime.py:
data loading, forward, backward compute up to the moment its last gradient
bucket goes to the all-reduce) into `WORK`, a window of its last
`WINDOW_STEPS` steps. The hang watchdog's thread publishes the window's
median with its heartbeat (`work/<rank>` in the store) and rank 0's thread
applies `StragglerJudge`: a rank whose median is more than `factor` x the
job's median (the lower middle of every rank's, so two ranks work too) and
at least `MIN_GAP_S` above it is slow; a rank that stayed slow at every check
for `SUSTAIN_STEPS` of its steps and `SUSTAIN_S` seconds, and for WINDOW_STEPS
steps after a burst of its slowness ended, is a straggler (a busy machine's
hiccup is not one). The report is one line
for people (`STRAGGLER_LINE`), the `straggler` record (on stderr, where the
launcher reads it for its summary, and in the metrics file).

An evaluation or a checkpoint is no step: it never enters the window, so
an uneven one names nobody; neither does waiting (it is not timed).

Everything but `Stragglers` (the store and the report) is pure, and this
module has no torch import: tests/test_straggler.py drives the judge directly.
docs/guides/hangs.md ("Stragglers") is the user's page.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ... import records
from ...shared import envnames
from ...shared.agreed import STRAGGLER_FACTOR
from .stall_model import PULSE

if TYPE_CHECKING:
    import torch.distributed as dist

# A rank's time is the (lower) median of its last steps: a few slow steps (a GC
# pause, a new epoch's loader) make no straggler; 6 slow steps of 10 do.
WINDOW_STEPS = 10
MIN_STEPS = 5  # a rank with fewer timed steps is not judged yet
# A straggler is also at least this much slower a step: below it, one CPU
# scheduling slice on a busy host makes the difference, and it costs little.
MIN_GAP_S = 0.02
# A straggler stays slow: its median above the limit at every check over this many
# more of its steps (three windows) and this long. A verdict so costs 6 slow steps
# (the median turns), then the longer of the two, then up to a check (1 s).
SUSTAIN_STEPS = 3 * WINDOW_STEPS
SUSTAIN_S = 20.0
MULTI_GET_KEYS = 256  # as the stall judge reads heartbeats (train/watchdog/stall.py)
# The report's line, for people; launchers read the `straggler` record instead.
STRAGGLER_LINE = ("ddpkit watchdog: STRAGGLER rank {rank} node {node} host {host}: {detail}; "
                  "its own work (data loading, forward, backward compute; not waiting) over its last {window} steps")


def factor_from_env(env: Mapping[str, str] = os.environ) -> float:
    """The judge's factor (0: off); a value that is no number above 1 is refused at start-up."""
    raw = env.get(envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR)
    if not raw:
        return STRAGGLER_FACTOR
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value != 0 and not 1 < value <= 100:
        raise ValueError(f"{envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR}={raw!r}: give a factor above 1 "
                         "(e.g. 1.33), or 0 to turn straggler detection off")
    return value


class WorkWindow:
    """This rank's own work per step, the last `size` steps. Written by the
    training loop's thread (one list item and one int per step, no lock),
    read by the watchdog's thread (a list copy is whole under the GIL)."""

    __slots__ = ("_ring", "count")

    def __init__(self, size: int = WINDOW_STEPS) -> None:
        self._ring = [0.0] * size
        self.count = 0  # steps timed in this process

    def add(self, seconds: float) -> None:
        self._ring[self.count % len(self._ring)] = seconds
        self.count += 1

    def median(self) -> tuple[int, float]:
        """(steps in the window, their lower median in seconds: a value one of them took)."""
        count, ring = self.count, self._ring[:]
        values = ring[:count] if count < len(ring) else ring
        return len(values), statistics.median_low(values) if values else 0.0


WORK = WorkWindow()


@dataclass(frozen=True)
class Work:
    """One rank's published window."""

    rank: int
    step: int  # its training step when it published
    steps: int  # steps in the window
    own_s: float  # their median
    node: int
    host: str

    def encode(self) -> str:
        return f"{self.step} {self.steps} {self.own_s:.6f} {self.node} {self.host}"

    @classmethod
    def decode(cls, rank: int, raw: bytes | str) -> Work:
        text = raw.decode() if isinstance(raw, bytes) else raw
        step, steps, own_s, node, host = text.split(" ", 4)
        return cls(rank, int(step), int(steps), float(own_s), int(node), host)


@dataclass(frozen=True)
class Change:
    """A rank became a straggler (`slow`), or caught up again."""

    work: Work
    median_s: float  # the job's
    factor: float
    slow: bool

    @property
    def ratio(self) -> float:
        return self.work.own_s / self.median_s if self.median_s > 0 else float("inf")

    def line(self) -> str:
        w, detail = self.work, self.record().detail
        if self.slow:
            return STRAGGLER_LINE.format(rank=w.rank, node=w.node, host=w.host, detail=detail, window=w.steps)
        return f"ddpkit watchdog: rank {w.rank} (host {w.host}) is no straggler any more: {detail}"

    def record(self) -> records.Straggler:
        w = self.work
        return records.Straggler(state="slow" if self.slow else "caught_up", rank=w.rank, node=w.node, host=w.host,
                                 step=w.step, own_s=round(w.own_s, 6), median_s=round(self.median_s, 6),
                                 ratio=round(self.ratio, 3), factor=self.factor, window_steps=w.steps)


@dataclass
class StragglerJudge:
    """Names ranks whose own work stays above `factor` x the job's median.

    The rule: a rank is slow at a check when the lower median of its last
    WINDOW_STEPS steps is above `factor` x the job's median (the lower median
    of every rank's) and at least MIN_GAP_S above it. It is named a straggler
    once it was slow at every check for `sustain_steps` of its own steps and
    `sustain_s` seconds on `clock` (SUSTAIN_STEPS, SUSTAIN_S); a check where it
    is not slow starts that over. So a few slow steps never turn the median (6
    of 10 do), and a burst of slow steps (another tenant, a page-cache flush,
    a compile: a busy machine's hiccup) that ends within 20 s or 30 steps of
    turning it names nobody, however slow. Nor does what a burst leaves
    behind: when its median fell to half the episode's highest ratio or less
    and under twice the factor, it must stay slow for WINDOW_STEPS more steps
    before it is named (the burst's last steps linger in the window, and a
    busy machine's noise keeps a rank just above the limit for a few checks).
    The cost, in detection time: a rank that turns steadily slow is named 6
    of its steps, then the longer of `sustain_steps` steps and `sustain_s`
    seconds, then up to a check (1 s) later; one whose slowness halved to a
    marginal level up to WINDOW_STEPS steps later than that. A named rank is named again only after it caught up (below half
    the margin, so one that hovers at the limit is not reported every
    second)."""

    factor: float
    slow: set[int] = field(default_factory=set)
    sustain_s: float = SUSTAIN_S
    sustain_steps: int = SUSTAIN_STEPS
    clock: Callable[[], float] = time.monotonic
    # rank -> (time, its step) slow since, its highest ratio since, the step it can be named at the earliest
    since: dict[int, tuple[float, int, float, int]] = field(default_factory=dict)

    def observe(self, works: Sequence[Work | None]) -> list[Change]:
        ready = [w for w in works if w is not None and w.steps >= MIN_STEPS]
        # Half the job at least: a median of a few early ranks says little.
        if len(ready) < 2 or 2 * len(ready) < len(works):
            return []
        median = statistics.median_low(w.own_s for w in ready)
        back, now = 1 + (self.factor - 1) / 2, self.clock()
        changes = []
        for w in ready:
            if w.rank not in self.slow:
                if w.own_s <= self.factor * median or w.own_s - median < MIN_GAP_S:
                    self.since.pop(w.rank, None)  # not slow at this check: a verdict starts over
                    continue
                at, step = self._slow_since(w, w.own_s / median if median > 0 else float("inf"), now)
                if now - at >= self.sustain_s and w.step - step >= self.sustain_steps:
                    del self.since[w.rank]
                    self.slow.add(w.rank)
                    changes.append(Change(w, median, self.factor, slow=True))
            elif w.rank in self.slow and (w.own_s <= back * median or w.own_s - median < MIN_GAP_S / 2):
                self.slow.discard(w.rank)
                changes.append(Change(w, median, self.factor, slow=False))
        return changes

    def _slow_since(self, work: Work, ratio: float, now: float) -> tuple[float, int]:
        """When and at which of its steps this rank's slow episode can be
        named at the earliest. A burst that ended (its median fell to half
        the episode's highest ratio or less, and under twice the factor: what
        is left is marginal) is no evidence of what follows: its steps linger
        in the window, and on a busy machine the noise keeps a rank just
        above the limit for a few more checks. So after such a fall the rank
        must stay slow for WINDOW_STEPS more steps, the burst out of its
        window, before it is named."""
        at, step, peak, settled = self.since.get(work.rank, (now, work.step, ratio, work.step))
        if ratio <= peak / 2 and ratio < 2 * self.factor:
            peak, settled = ratio, work.step + WINDOW_STEPS
        self.since[work.rank] = (at, step, max(peak, ratio), settled)
        return (at, step) if work.step >= settled else (now, work.step)


def _key(rank: int) -> str:
    return f"work/{rank}"


class Stragglers:
    """The watchdog thread's part (train/watchdog/stall.py calls `publish` on every
    rank and `check` on its checks): every rank publishes its window when it
    timed a step since; rank 0 reads every rank's and reports."""

    def __init__(self, store: dist.Store, rank: int, world: int, node: int, host: str,
                 metrics: Path | None, factor: float | None = None) -> None:
        self.store, self.rank, self.node, self.host, self.metrics = store, rank, node, host, metrics
        factor = factor_from_env() if factor is None else factor
        self.judge = StragglerJudge(factor) if rank == 0 and factor > 0 and world > 1 else None
        self._keys = [_key(r) for r in range(world)]
        self._published = -1
        self._all_published = False

    def publish(self) -> None:
        if WORK.count == self._published:
            return  # no step since: nothing new (and no store write)
        self._published = WORK.count
        steps, own_s = WORK.median()
        self.store.set(_key(self.rank), Work(self.rank, PULSE.step, steps, own_s, self.node, self.host).encode())

    def check(self) -> None:
        if self.judge is None or WORK.count == 0:  # a user's script times no steps: nothing to read, ever
            return
        if not self._all_published:
            self._all_published = self.store.check(self._keys)
            if not self._all_published:
                return
        raws = [raw for at in range(0, len(self._keys), MULTI_GET_KEYS)
                for raw in self.store.multi_get(self._keys[at:at + MULTI_GET_KEYS])]
        for change in self.judge.observe([Work.decode(r, raw) for r, raw in enumerate(raws)]):
            self._report(change)

    def _report(self, change: Change) -> None:
        print(change.line(), file=sys.stderr, flush=True)
        record = change.record()
        records.emit(record)
        if self.metrics is not None:
            records.append(self.metrics, record, time.time())
