"""The one place that knows a run folder's layout:

    <runs root>/<name>-<id>/
        run.json        RunRecord: target, nodes, launcher pid and host, state, exit code, summary
        events.jsonl    one RunEvent per line: start, failed, restart, stall, preempted, exit, ...
        spec.yaml       the job as it ran (defaults, --set and flags applied)
        rendered/       the files the target rendered (Slurm: the sbatch script)
        logs/           the nodes' logs, unless the launcher was given --log-dir
        console.log     a detached run's console: what its supervisor printed (the summary, the closing line)
        metrics.jsonl   the job's metrics records: launch local's ddpkit train (unless the job names its own
                        file), a program of the user's own under launch local, ssh and docker
        records/        a rendered compose job's records, one file per node, copied from its containers

The runs root is $DDPKIT_RUNS_DIR, else ~/.ddpkit/runs, so `ddpkit runs`
finds every run from any directory."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..host.processes import start_ticks
from ..shared.envnames import DDPKIT_RUNS_DIR
from ..shared.wording import plural
from .record import Launcher, NodeLog, RunEvent, RunRecord, RunState, RunSummary, RunTarget, SlurmJob, state_for_code

RUN_JSON = "run.json"
LOCK = ".run.json.lock"
LOCK_S = 30.0  # a writer holds it for one read and one write; longer means a stuck process, reported as OSError
EVENTS = "events.jsonl"
SPEC = "spec.yaml"
RENDERED = "rendered"
LOGS = "logs"
METRICS = "metrics.jsonl"
RECORDS = "records"
CONSOLE = "console.log"


def runs_root() -> Path:
    given = os.environ.get(DDPKIT_RUNS_DIR)
    return Path(given).expanduser() if given else Path.home() / ".ddpkit" / "runs"


class RunsDirError(Exception):
    """The runs root cannot take a new run folder: one line, nothing started."""


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @classmethod
    def create(cls, *, name: str, target: RunTarget, nodes: int, nproc_per_node: int, spec_yaml: str,
               stop_grace_s: float = 0.0, root: Path | None = None, first: str = "start",
               run_id: str | None = None) -> RunFolder:
        """A new run of this process (its pid is the launcher's), state running.
        RunsDirError when the runs root cannot hold it: a launch that could not
        be listed, followed or cancelled is refused before anything starts.
        `first`: the first event ("rendered": files for kubectl or compose).
        `run_id`: the id another host's run folder already has (launch ssh
        --detach: the first host's folder takes the launching machine's id)."""
        root = root or runs_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
            while run_id is None:  # short enough to type; ids are unique in the root, whatever the job's name
                drawn = uuid.uuid4().hex[:6]
                if not any(root.glob(f"*-{drawn}")):
                    run_id = drawn
            folder = cls(root / f"{name}-{run_id}")
            folder.path.mkdir()
            (folder.path / SPEC).write_text(spec_yaml)
            pid = os.getpid()
            folder.write(RunRecord(id=run_id, name=name, target=target, nodes=nodes, nproc_per_node=nproc_per_node,
                                   started=time.time(), stop_grace_s=stop_grace_s,
                                   launcher=Launcher(pid=pid, host=socket.gethostname(),
                                                     start_ticks=start_ticks(pid))))
            folder.event(first, f"{target}: {plural(nodes, 'node')} x {plural(nproc_per_node, 'process')}")
        except OSError as exc:
            raise RunsDirError(f"cannot create a run folder in {root} ({exc.strerror or exc}); set "
                               f"{DDPKIT_RUNS_DIR} to a folder you can write (nothing was started)") from None
        return folder

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS

    @property
    def rendered_dir(self) -> Path:
        return self.path / RENDERED

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    @property
    def records_folder(self) -> Path:
        """A rendered job's records, copied here from where its nodes kept them (compose's containers)."""
        return self.path / RECORDS

    @property
    def spec_file(self) -> Path:
        return self.path / SPEC

    @property
    def console_file(self) -> Path:
        return self.path / CONSOLE

    def hand_over(self, pid: int, detached: bool = False) -> RunRecord:
        """The run's launcher is now process `pid` on this host (`detached`:
        a detached run's supervisor, which calls this itself): `status` and
        `cancel` reach it, not the command that made the folder."""
        launcher = Launcher(pid=pid, host=socket.gethostname(), start_ticks=start_ticks(pid))
        return self.update(launcher=launcher, detached=True) if detached else self.update(launcher=launcher)

    def record(self) -> RunRecord:
        return RunRecord.model_validate_json((self.path / RUN_JSON).read_text())

    def write(self, record: RunRecord) -> None:
        """The whole record as given. A change to the stored record goes
        through `update`, which holds the folder's lock around its read."""
        # Readers (`ddpkit runs` in another shell) must never see half a file.
        tmp = self.path / f".{RUN_JSON}.{os.getpid()}"
        tmp.write_text(record.model_dump_json(indent=2) + "\n")
        os.replace(tmp, self.path / RUN_JSON)

    def update(self, **changes: Any) -> RunRecord:
        """Read, change and write run.json under the folder's lock: the
        launcher recording its end and `ddpkit cancel` or `ddpkit status`
        recording Slurm's never write over each other's change."""
        try:
            with FileLock(self.path / LOCK, timeout=LOCK_S):
                record = self.record().model_copy(update=changes)
                self.write(record)
        except TimeoutError as exc:  # filelock.Timeout: one line, not a traceback
            raise OSError(f"{self.path / LOCK} held for over {LOCK_S:g} s") from exc
        return record

    def event(self, kind: str, detail: str = "", node: int | None = None) -> None:
        line = RunEvent(time=time.time(), kind=kind, detail=detail, node=node).model_dump_json(exclude_none=True)
        with (self.path / EVENTS).open("a", encoding="utf-8") as out:
            out.write(line + "\n")

    def events(self) -> list[RunEvent]:
        try:
            lines = (self.path / EVENTS).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(RunEvent.model_validate(json.loads(line)))
            except ValueError:  # a line cut short by a killed launcher
                continue
        return out

    def set_logs(self, logs: list[NodeLog]) -> None:
        self.update(logs=logs)

    def set_slurm(self, job: SlurmJob) -> None:
        self.update(slurm=job)

    def finish(self, code: int | None, summary: RunSummary | None = None,
               state: RunState | None = None) -> RunRecord:
        """The end: exit code (None: the launcher never gave one), state (from
        the code unless given) and the summary. The record as written."""
        if state is None:
            assert code is not None, "an end without an exit code needs its state"
            state = state_for_code(code)
        record = self.update(state=state, exit_code=code, ended=time.time(), summary=summary)
        self.event("exit", f"{state.value}" + ("" if code is None else f", exit code {code}"))
        return record
