"""A job rendered for docker compose (`ddpkit render compose`, started by
`docker compose up`): `docker compose ps` knows its containers' states and
`docker compose logs` their output (services are `node<I>`,
templates/compose), which `log_iter` gives with the console's prefixes. ddpkit did not start it and does not stop it: cancel
names the `docker compose down` that does. Its records (a program's
metrics, a stop's checkpoint) are in each container's records folder
(records.COMPOSE_FOLDER), with each node's log, not in the output people read: `copy_records`
brings them into the run folder for `ddpkit report`, from the containers,
running or exited, that `down` has not removed yet."""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .... import records
from ....runs import Applied, RunState, RunTarget, StoredRun
from ....shared.exitcodes import ExitCode
from ....targets.compose import RDZV_SERVICE
from ..applied import compose_cli, last_error, run_tool
from ..common import ACTIVE, RunCommandError, ToolMissing
from ..logs import LogRequest, print_lines, say_node_of_rank
from .base import Now, log_lines
from .compose_logs import ComposeLogs
from .launched import Launched

ACTIVE_CONTAINER = ("running", "restarting", "paused", "created")
RENDERING = Launched(RunTarget.COMPOSE)  # a run folder whose files are not recorded yet: the render's own process


class Compose:
    launcher = "compose"
    rendered = True

    def describe(self, run: StoredRun) -> Now:
        a = run.record.applied
        if a is None:
            return RENDERING.describe(run)
        cli = compose_cli()
        words = _base(a, cli or ["docker", "compose"]) + ["ps", "--all", "--format", "json"]
        if not cli:
            return Now(RunState.RENDERED, None, f"compose is not installed here; where it is: {shlex.join(words)}",
                       None)
        done = run_tool(words)
        if done.returncode != 0:
            return Now(RunState.RENDERED, None, f"docker compose could not say: {last_error(done)}", None)
        rows = _json_rows(done.stdout)
        if not rows:
            return Now(RunState.RENDERED, None, f"no containers: start them with `{shlex.join(_base(a, cli))} up`",
                       None)
        now = _from_containers(a, cli, rows)
        stop = _stopped(run) if now.state is RunState.FAILED else None
        # a stop (`docker compose stop`, a host's shutdown) ends each agent with 75 (its workers checkpointed)
        # or 1, which a failure may end with too: the records say which it was
        return now if stop is None else Now(RunState.CANCELLED, now.exit_code, f"{stop}; {now.detail}", None)

    def status_lines(self, run: StoredRun) -> list[str]:
        a = run.record.applied
        return log_lines(run.record) + [f"file      {f}" for f in (a.files if a else [])]

    def log_iter(self, run: StoredRun, request: LogRequest,
                 active: Callable[[], bool] | None = None) -> Iterator[list[str]]:
        """The containers' lines a batch at a time, prefixed as the console
        prefixes a launch run's (compose_logs.py); with --follow until
        `active()` (by default: `docker compose ps`) says the job has ended."""
        rec = run.record
        if rec.applied is None:
            return RENDERING.log_iter(run, request, active)
        cli = compose_cli()
        node = request.node_of_rank(rec)
        words = [*_base(rec.applied, cli or ["docker", "compose"]), "logs", "--no-color",
                 *([] if node is None else [f"node{node}"])]  # services are node<I> (templates/compose)
        if not cli:
            raise ToolMissing("docker compose", shlex.join([*words, *(["--follow"] if request.follow else [])]))
        return iter(ComposeLogs(words, request, active or (lambda: self.describe(run).state in ACTIVE), _order))

    def logs(self, run: StoredRun, request: LogRequest) -> int:
        rec = run.record
        if rec.applied is None:
            return RENDERING.logs(run, request)
        say_node_of_rank(rec, request, "a container")
        for lines in self.log_iter(run, request):
            print_lines(lines)
        return ExitCode.OK

    def cancel(self, run: StoredRun, now: Now) -> int:
        a = run.record.applied
        if a is None:
            return RENDERING.cancel(run, now)
        stop = shlex.join([*_base(a, compose_cli() or ["docker", "compose"]), "down", "--timeout", "90"])
        raise RunCommandError(f"run {run.record.id} was rendered for {self.launcher}, which started it, not ddpkit; "
                              f"stop it with: {stop}")


class NoRecords(LookupError):
    """The run's records could not be brought here; the message is one line."""


def copy_records(run: StoredRun) -> Path:
    """Copy each node container's records into the run folder's records folder
    (`<service>.jsonl`: a container's hostname is its id, which `down` and
    `up` change), replacing an earlier copy of the same node; that folder."""
    a = run.record.applied
    cli = compose_cli()
    if a is None or not cli:
        raise NoRecords("docker compose is not installed here" if a is not None else "the run was never rendered")
    done = run_tool(_base(a, cli) + ["ps", "--all", "--format", "json"])
    services = sorted({str(r.get("Service")) for r in _json_rows(done.stdout) if done.returncode == 0}
                      - {RDZV_SERVICE}, key=_order)
    if not services:
        why = last_error(done) if done.returncode != 0 else "its containers are gone (`docker compose down`)"
        raise NoRecords(f"no containers of run {run.record.id} to copy its records from: {why}")
    folder = run.folder.records_folder
    folder.mkdir(parents=True, exist_ok=True)
    for service in services:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            # `cp` reads an exited container too; a node that kept no record has no folder: nothing to copy
            got = run_tool(_base(a, cli) + ["cp", f"{service}:{records.COMPOSE_FOLDER}/.", tmp])
            if got.returncode == 0:
                _gather(Path(tmp), folder / f"{service}.jsonl")
    return folder


def _stopped(run: StoredRun) -> str | None:
    """What the job's records say of its last stop (`stopped by SIGTERM at
    step 40, checkpoint at step 40`), copied from its containers; None for none."""
    try:
        folder = copy_records(run)
    except NoRecords:
        return None
    stops = [s.record for s in records.read_folder(folder) if isinstance(s.record, records.Stop)]
    if not stops:
        return None
    last = stops[-1]
    saved = f"checkpoint at step {last.step}" if last.checkpoint else "no checkpoint"
    return f"stopped by {last.signal or 'a stop signal'} at step {last.step}, {saved}"


def _gather(copied: Path, into: Path) -> None:
    """A node's records files (one, unless its hostname changed in a restart) as one file."""
    parts = sorted(copied.glob("*.jsonl"))
    if not parts:
        return
    with into.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out)


def _base(a: Applied, cli: list[str]) -> list[str]:
    return [*cli, "-f", a.files[0], "-p", a.project]


State = tuple[str, int]  # a container's state and exit code


def _from_containers(a: Applied, cli: list[str], rows: list[dict[str, Any]]) -> Now:
    """Who decides the job's end (_decided); the containers still there once it has ended are named."""
    states = {str(r.get("Service")): (str(r.get("State")), int(r.get("ExitCode") or 0)) for r in rows}
    summary = ", ".join(f"{svc} {st}" + (f" ({code})" if st == "exited" else "")
                        for svc, (st, code) in sorted(states.items(), key=lambda item: _order(item[0])))
    code = _decided(states)
    if code is None:
        return Now(RunState.RUNNING, None, f"{summary} (docker compose)", None)
    left = sorted((svc for svc, (st, _) in states.items() if st in ACTIVE_CONTAINER), key=_order)
    tail = f"; {', '.join(left)} left: `{shlex.join(_base(a, cli))} down` removes them" if left else ""
    return Now(RunState.FINISHED if code == 0 else RunState.FAILED, code, f"{summary} (docker compose){tail}", None)


def _decided(states: dict[str, State]) -> int | None:
    """The job's exit code once it has ended, else None.

    A static job: node0 decides once it has exited, as `up --exit-code-from
    node0` does. An elastic one (its store in the rdzv service): any node may
    be lost, node0 too, so the job has ended well once a node exited 0 (an
    agent exits 0 only when its group finished), and failed once every node
    exited without one; a lost node's container may still be paused or
    running then."""
    nodes = {svc: state for svc, state in states.items() if svc != RDZV_SERVICE}
    if RDZV_SERVICE not in states:
        node0, code = nodes.get("node0", ("exited", 1))
        return code if node0 == "exited" or not any(st in ACTIVE_CONTAINER for st, _ in nodes.values()) else None
    if any(st == "exited" and code == 0 for st, code in nodes.values()):
        return 0
    if any(st in ACTIVE_CONTAINER for st, _ in nodes.values()):
        return None
    return next((code for _, (_, code) in sorted(nodes.items(), key=lambda item: _order(item[0])) if code), 1)


def _order(service: str) -> tuple[int, str]:
    """The store first, then the nodes by rank (node10 after node9)."""
    number = service.removeprefix("node")
    return (int(number) if number.isdigit() else -1, service)


def _json_rows(text: str) -> list[dict[str, Any]]:
    """`ps --format json`: one object per line (compose v2.21+) or one array."""
    text = text.strip()
    if text.startswith("["):
        return [r for r in json.loads(text) if isinstance(r, dict)]
    return [json.loads(line) for line in text.splitlines() if line.strip()]
