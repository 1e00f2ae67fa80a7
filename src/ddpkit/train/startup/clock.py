"""This process's start-up clock: wall-clock stamps from the process's own
start to the end of the first training step, which the trainer writes as one
`startup` metrics record.

Its own module (no torch, no other train module) so that start-up, the rank
report and the loop can all stamp it without importing one another.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ...host import processes

_IMPORTED_AT = time.time()  # fallback process start where /proc cannot tell


# ---- the start-up clock ----------------------------------------------------------
# Stamps in the order they happen, each the end of the phase named beside it.
STAMPS = (("process_start", ""), ("imports_done", "imports"), ("rendezvous_done", "rendezvous"),
          ("rank_report_done", "rank report"), ("model_built", "model"), ("data_built", "data"),
          ("setup_done", "optimizer + resume"), ("first_step_done", "first step"))


def process_start() -> tuple[float, str]:
    """(wall-clock time this process started, where that came from).

    Linux: /proc/self/stat field 22 is the start in clock ticks after boot
    (CLOCK_BOOTTIME, 10 ms resolution with the usual 100 Hz ticks). Its age
    is subtracted from the current wall clock, rather than adding /proc/stat's
    btime, which is whole seconds and drifts from the wall clock as NTP
    adjusts it. Elsewhere: when this module was imported, which misses the
    interpreter's own start-up and the imports before it.
    """
    ticks = processes.start_ticks(os.getpid())
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if ticks is None or boottime is None:
        return _IMPORTED_AT, "ddpkit.train.startup.clock import"
    age = time.clock_gettime(boottime) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age, "/proc/self/stat"


@dataclass
class StartupClock:
    """Wall-clock stamps of one process's start-up. A later mark of the same
    name is ignored: a phase ends once, the first time."""

    stamps: dict[str, float] = field(default_factory=dict)
    process_start_from: str = ""

    def __post_init__(self) -> None:
        if "process_start" not in self.stamps:
            self.stamps["process_start"], self.process_start_from = process_start()

    def mark(self, name: str) -> None:
        if name not in dict(STAMPS):
            raise ValueError(f"unknown start-up stamp {name!r}")
        self.stamps.setdefault(name, time.time())

    def phases(self) -> dict[str, float]:
        """Seconds per phase, each from the previous stamp taken to its own,
        so the phases add up to the total; a stamp never taken is left out."""
        taken = [(stamp, phase) for stamp, phase in STAMPS if stamp in self.stamps]
        return {phase: self.stamps[stamp] - self.stamps[prev]
                for (prev, _), (stamp, phase) in zip(taken, taken[1:])}

    def record(self) -> dict[str, object]:
        """The fields of the `startup` metrics record."""
        ordered = {stamp: self.stamps[stamp] for stamp, _ in STAMPS if stamp in self.stamps}
        last = next(reversed(ordered))
        return {"stamps": ordered, "phases": self.phases(), "total": ordered[last] - ordered["process_start"],
                "process_start_from": self.process_start_from, "pid": os.getpid()}

    def line(self) -> str:
        """One line for the log: 'start-up 4.51 s: imports 2.16, rendezvous 0.01, ...'."""
        phases = self.phases()
        total = self.record()["total"]
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())
        return f"start-up {total:.2f} s: {parts}"


# One start-up per process: the stamps belong to the process, like its pid,
# and are taken where each phase ends (main, _init, the trainer).
CLOCK = StartupClock()


def _start_again() -> None:
    """A forked process (a worker of ddpkit.agent's zygote, which imported this
    module long before) starts its own clock: its start is its fork."""
    CLOCK.stamps.clear()
    CLOCK.__post_init__()


os.register_at_fork(after_in_child=_start_again)
