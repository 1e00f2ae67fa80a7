"""Finding runs: every run folder under the runs root, newest first; one run
from what a user types (a run id, a job name: its latest run, or a Slurm job
id); and whether a launcher that the record says is running still is."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ..host.processes import start_ticks
from .folder import RUN_JSON, RunFolder, runs_root
from .record import RunRecord, RunState


class UnknownRun(LookupError):
    """No run answers to what the user typed; the message is one line."""


@dataclass(frozen=True)
class StoredRun:
    folder: RunFolder
    record: RunRecord


def all_runs(root: Path | None = None) -> list[StoredRun]:
    """Every readable run, newest first. A folder without a readable run.json
    (being created, or not ours) is skipped, not an error."""
    root = root or runs_root()
    found = []
    for path in root.glob(f"*/{RUN_JSON}"):
        folder = RunFolder(path.parent)
        try:
            found.append(StoredRun(folder, folder.record()))
        except (OSError, ValueError, ValidationError):
            continue
    return sorted(found, key=lambda r: r.record.started, reverse=True)


def resolve(text: str, root: Path | None = None) -> StoredRun:
    """A run id or folder name; a Slurm job id (digits); else a job name,
    whose latest run it is."""
    root = root or runs_root()
    runs = all_runs(root)
    for run in runs:
        if text in (run.record.id, run.record.folder_name):
            return run
    if text.isdigit():
        for run in runs:
            if run.record.slurm is not None and run.record.slurm.job_id == int(text):
                return run
    for run in runs:  # newest first: the first match is the latest
        if run.record.name == text:
            return run
    where = f"{root} ({'no runs yet' if not runs else f'{len(runs)} runs; `ddpkit runs` lists them'})"
    raise UnknownRun(f"no run {text!r} in {where}; give a run id, a job name or a Slurm job id")


def launcher_alive(record: RunRecord) -> bool | None:
    """Whether the launcher still runs: None when it ran on another host
    (this one cannot tell)."""
    if record.launcher.host != socket.gethostname():
        return None
    ticks = start_ticks(record.launcher.pid)
    if ticks is None:
        return False
    return record.launcher.start_ticks is None or ticks == record.launcher.start_ticks


def shown_state(record: RunRecord) -> RunState:
    """The stored state of a run whose launcher is ddpkit's own process,
    except that a launcher gone without writing its end shows the run abandoned
    (killed with SIGKILL, its machine rebooted). Not for a run that another
    scheduler holds (Slurm): its process may end long before the job."""
    if record.state == RunState.RUNNING and launcher_alive(record) is False:
        return RunState.ABANDONED
    return record.state
