"""What a stall's declaring monitor says: which ranks it names (`refine`),
the `stall` record (`stall_record`: on stderr for the launcher, and in the
metrics file) and the lines a person reads (`report_lines`).

The verdict itself, as the monitors pass it through the store, stays a
plain JSON object (`verdict_record`): it is the ranks' own exchange."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import records
from ...shared.exitcodes import ExitCode
from .stall_model import Beat, Suspect, Verdict

# The report's per-rank line, for people; launchers read the `stall` record instead.
# A stall's stack files in the job's working folder, where no launcher keeps a folder on the rank's host
# (stacks.stack_folder): named with "each on its node's host", since the launcher's host may not see them.
STACKS_FOLDER = "ddpkit-stacks"
STALL_LINE = "ddpkit watchdog: STALL rank {rank} node {node} host {host} pid {pid}: step {step}, phase {phase}, {where}"


@dataclass(frozen=True)
class Ack:
    """What a rank that could dump itself tells the declaring monitor."""

    frame: str  # innermost frame of its main thread
    in_torch: bool  # that frame is inside torch (waiting in a collective, most likely)
    dump: str | None  # its stack file


def verdict_record(verdict: Verdict, by: int) -> dict[str, Any]:
    """The verdict as the declaring monitor writes it to the store."""
    return {"by": by, "idle_s": round(verdict.idle_s, 1), "limit_s": round(verdict.limit_s, 1),
            "suspects": [_suspect_record(s) for s in verdict.suspects],
            "frozen": [s.beat.rank for s in verdict.suspects if s.frozen_s is not None],
            "waiting": list(verdict.waiting)}


def _suspect_record(s: Suspect) -> dict[str, Any]:
    b = s.beat
    return {"rank": b.rank, "node": b.node, "host": b.host, "pid": b.pid, "step": b.step, "phase": b.phase.value,
            "idle_s": round(s.idle_s, 1), "frozen_s": None if s.frozen_s is None else round(s.frozen_s, 1)}


def refine(record: dict[str, Any], acks: dict[int, Ack]) -> list[dict[str, Any]]:
    """The suspects the report names. Ranks at the same step and phase tie
    (with BatchNorm, DDP's forward broadcasts buffers: the ranks waiting for a
    stuck forward are in forward too); a suspect whose main thread runs code
    outside torch is stuck there, one inside torch waits for it."""
    suspects: list[dict[str, Any]] = record["suspects"]
    busy = [s for s in suspects if s["rank"] in acks and not acks[s["rank"]].in_torch]
    return busy if busy and len(busy) < len(suspects) else suspects


def stall_record(record: dict[str, Any], acks: dict[int, Ack], world: int, dumps: str) -> records.Stall:
    """The report of the verdict `record`, with the stacks the ranks sent
    (`dumps`: where every rank's stacks are, as `dump_place` says it)."""
    stalled = tuple(_stalled_rank(s, acks.get(s["rank"])) for s in refine(record, acks))
    return records.Stall(idle_s=record["idle_s"], limit_s=record["limit_s"], stalled=stalled,
                         waiting=tuple(record["waiting"]), no_stack=tuple(sorted(set(range(world)) - set(acks))),
                         dumps=dumps)


def _stalled_rank(s: dict[str, Any], ack: Ack | None) -> records.StalledRank:
    return records.StalledRank(**s, frame=ack.frame if ack else None, dump=ack.dump if ack else None)


def report_lines(report: records.Stall, suspects: Sequence[int]) -> list[str]:
    """The lines a person reads: the verdict, one line per stalled rank, the
    ranks that waited for them (the verdict's `suspects` not named), where the stacks are."""
    ranks = ", ".join(str(s.rank) for s in report.stalled)
    lines = [f"ddpkit watchdog: the job stalled: no progress for {report.idle_s:.0f}s "
             f"(limit {report.limit_s:.0f}s); stalled rank(s): {ranks}; stopping every rank "
             f"(exit {int(ExitCode.STALLED)})"]
    lines += [STALL_LINE.format(rank=s.rank, node=s.node, host=s.host, pid=s.pid, step=s.step, phase=s.phase,
                                where=s.where) for s in report.stalled]
    named = {s.rank for s in report.stalled}
    waiting = sorted(set(report.waiting) | set(suspects) - named)
    if waiting:
        lines.append(f"ddpkit watchdog: {len(waiting)} rank(s) waited for them: {ranges(waiting)}")
    lines.append(f"ddpkit watchdog: stacks of every rank: {report.dumps}")
    return lines


def slow_start_line(beat: Beat, waited: float) -> str:
    """A rank slow to start, but moving: said once, the job goes on."""
    return (f"ddpkit watchdog: rank {beat.rank} (node {beat.node}, {beat.host}) is still starting up {waited:.0f}s "
            "after the others began to wait for it; it moves, so it is slow, not stuck: the job goes on")


def dump_place(acks: Mapping[int, Ack], nccl: bool) -> str:
    """Where the ranks' stacks are, in one line: their files as one pattern
    (`.../logs/node<N>/stall-rank<R>.txt`), and the ranks that had no folder
    for them (their stacks went to their stderr)."""
    files = sorted({_pattern(a.dump) for a in acks.values() if a.dump})
    on_stderr = sorted(r for r, a in acks.items() if not a.dump)
    if not files:
        return "each rank's stderr (no log folder to keep them in)"
    place = ", ".join(files)
    if any(f"{os.sep}{STACKS_FOLDER}{os.sep}" in f for f in files):
        place += " (each on its node's host)"
    if nccl:
        place += "; NCCL flight recorder: " + ", ".join(f.replace("stall-rank<R>.txt", "nccl-trace-rank<R>.pkl")
                                                        for f in files)
    if on_stderr:
        place += f"; rank(s) {ranges(on_stderr)}: on their stderr"
    return place


def _pattern(path: str) -> str:
    """A rank's stack file as the pattern every rank's follows."""
    name = re.sub(r"^stall-rank\d+\.txt$", "stall-rank<R>.txt", os.path.basename(path))
    folder = os.path.dirname(path)
    node = re.sub(r"^node\d+$", "node<N>", os.path.basename(folder))  # launch local's folder per node
    return os.path.join(os.path.dirname(folder), node, name)


def ranges(ranks: list[int]) -> str:
    """0-3, 5: short even for 8,192 ranks."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
