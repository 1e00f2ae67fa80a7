"""Run folders: one per `ddpkit launch` and `ddpkit submit` (and per job
rendered for kubectl or docker compose), in one place
(`~/.ddpkit/runs/<name>-<id>/`, or `$DDPKIT_RUNS_DIR`), that `ddpkit runs`,
`status`, `logs` and `cancel` read. This package owns the folder's layout,
its records (changed under a lock) and the one log tailer (`Tail`); it
starts, signals and renders nothing (docs/guides/runs.md)."""

from .folder import RunFolder, RunsDirError, runs_root
from .record import (
    NO_EXIT_STATUS_CELL,
    Applied,
    Launcher,
    NodeLog,
    NodeRow,
    RemoteRun,
    RunEvent,
    RunRecord,
    RunState,
    RunSummary,
    RunTarget,
    SlurmJob,
    state_for_code,
)
from .store import StoredRun, UnknownRun, all_runs, launcher_alive, resolve, shown_state
from .tail import LineBuffer, Tail

__all__ = [
    "NO_EXIT_STATUS_CELL", "Applied", "Launcher", "LineBuffer", "NodeLog", "NodeRow", "RemoteRun", "RunEvent",
    "RunFolder", "RunRecord", "RunsDirError", "RunState", "RunSummary", "RunTarget", "SlurmJob", "StoredRun", "Tail",
    "UnknownRun", "all_runs", "launcher_alive", "resolve", "runs_root", "shown_state", "state_for_code",
]
