"""A run ddpkit's own launcher supervises (launch local, docker, ssh): the
launcher's pid (with its start time) says whether it runs, its node logs
are files, and cancel is what Ctrl-C does: SIGTERM to the launcher, which
stops its nodes with the grace chain's time to checkpoint
(launch/supervise/interrupt.py) and records the run as cancelled. A `launch
local` launcher gone without recording its end (SIGKILL, the OOM killer: the
run is abandoned) leaves its nodes running: they are found by the run id in
their environment."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import yaml

from ....runs import RunRecord, RunState, RunTarget, StoredRun, launcher_alive, shown_state
from ....shared import envnames
from ....shared.agreed import TRAIN_MODULE, is_ddpkit_module
from ....shared.exitcodes import ExitCode
from ...supervise import proctree
from ..common import ACTIVE, RunCommandError, already_ended
from ..logs import LogRequest, launch_sources, log_iter, print_files
from .base import Now, log_lines

STOP_MARGIN_S = 60.0  # beyond the nodes' grace: the launcher's own teardown and summary


@dataclass(frozen=True)
class Launched:
    """`target`: local, docker or ssh (or a submit or render whose job is not
    recorded yet: its launcher is the submitting or rendering process). `leftovers`: an
    abandoned run's nodes outlive its launcher (launch local's agents, each in
    a session of its own) and are found by DDPKIT_RUN_ID."""

    target: RunTarget
    leftovers: bool = False
    rendered: bool = False

    @property
    def launcher(self) -> str:
        return f"launch {self.target}"

    def describe(self, run: StoredRun) -> Now:
        rec = run.record
        state = shown_state(rec)
        where = f"pid {rec.launcher.pid} on {rec.launcher.host}"
        if state == RunState.ABANDONED:
            where += ": gone without recording its end (killed?)"
        elif state == RunState.RUNNING and launcher_alive(rec) is None:
            where += " (another host: this one cannot see it)"
        return Now(state, rec.exit_code, f"launcher {where}", rec.ended)

    def status_lines(self, run: StoredRun) -> list[str]:
        return log_lines(run.record)

    def log_iter(self, run: StoredRun, request: LogRequest,
                 active: Callable[[], bool] | None = None) -> Iterator[list[str]]:
        """The node logs' lines a batch at a time, with the console's
        prefixes; with --follow until `active()` (by default: the launcher
        has not recorded the run's end) says the run has ended."""
        found, _ = launch_sources(run.record, request, self.launcher)
        return log_iter(found, request, active or (lambda: _active(run)))

    def logs(self, run: StoredRun, request: LogRequest) -> int:
        found, note = launch_sources(run.record, request, self.launcher)
        code = print_files(found, note, request, lambda: _active(run))
        if request.follow and code == ExitCode.OK:
            _detached_ending(run.folder.record())
        return code

    def cancel(self, run: StoredRun, now: Now) -> int:
        rec = run.folder.record()
        if now.state == RunState.ABANDONED and self.leftovers:
            return _cancel_leftovers(StoredRun(run.folder, rec))
        if now.state not in ACTIVE:
            return already_ended(rec.id, now.state, now.exit_code)
        return _cancel_launcher(StoredRun(run.folder, rec))


def _active(run: StoredRun) -> bool:
    """Asked anew each poll: the launcher records the run's end."""
    return shown_state(run.folder.record()) in ACTIVE


def _detached_ending(rec: RunRecord) -> None:
    """A followed detached run ends as its console did: the summary table,
    any teardown problem, the closing line and the workers' cause (an
    attached run's console shows them after the ranks' last lines; a
    detached one's went to its console.log, not to the node logs followed)."""
    from rich.console import Console
    from rich.text import Text

    from ...supervise.summary import summary_table

    if not rec.detached or rec.summary is None:
        return
    summary, failed = rec.summary, bool(rec.exit_code)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(summary_table(summary))
    for problem in summary.problems:
        console.print(Text(f"teardown problem: {problem}"))
    console.print(Text(summary.closing, style="bold red" if failed else "green"), soft_wrap=True)
    for cause in summary.causes:
        console.print(Text(cause, style="bold red" if failed else ""), soft_wrap=True)


def _to_stop(run: StoredRun) -> str:
    """What the nodes do in their grace: ddpkit train checkpoints; a program of
    the user's own does only if it has a stop handler, which only its workers
    know (each says so when the signal comes)."""
    try:
        command = (yaml.safe_load(run.folder.spec_file.read_text()) or {}).get("command") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        command = {}
    if not command.get("script") and is_ddpkit_module(command.get("module") or TRAIN_MODULE):
        return "to checkpoint and stop"
    return ("to stop: a program with a stop handler (ddpkit.on_stop, or ddpkit's callback for its Trainer) "
            "checkpoints in them; one without stops at once, without a checkpoint")


def _cancel_launcher(run: StoredRun) -> int:
    rec = run.record
    alive = launcher_alive(rec)
    if alive is None:
        raise RunCommandError(f"run {rec.id}'s launcher runs on {rec.launcher.host} (pid {rec.launcher.pid}); "
                              f"run `ddpkit cancel {rec.id}` there")
    run.folder.event("cancel", f"ddpkit cancel: SIGTERM to the launcher (pid {rec.launcher.pid})")
    try:
        # What Ctrl-C does: the supervisor stops every node with the grace chain's launcher grace.
        os.kill(rec.launcher.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    print(f"ddpkit cancel: sent SIGTERM to launcher pid {rec.launcher.pid} of run {rec.id}; its nodes get "
          f"{rec.stop_grace_s:g} s {_to_stop(run)}", flush=True)
    deadline = time.monotonic() + rec.stop_grace_s + STOP_MARGIN_S
    while launcher_alive(rec) and time.monotonic() < deadline:
        time.sleep(0.1)
    if launcher_alive(rec):
        raise RunCommandError(f"run {rec.id}'s launcher (pid {rec.launcher.pid}) is still running "
                              f"{rec.stop_grace_s + STOP_MARGIN_S:g} s after SIGTERM; see `ddpkit status {rec.id}`",
                              ExitCode.FAILED)
    after = run.folder.record()
    state = shown_state(after)
    print(f"ddpkit cancel: run {rec.id} {state.value}"
          + ("" if after.exit_code is None else f" (launcher exit code {after.exit_code})"))
    return ExitCode.OK if state == RunState.CANCELLED else ExitCode.FAILED


def _cancel_leftovers(run: StoredRun) -> int:
    """Stopped as the launcher would have (TERM, the grace, KILL)."""
    rec = run.record
    left = proctree.with_env(envnames.DDPKIT_RUN_ID, rec.id)
    if not left:
        print(f"ddpkit cancel: run {rec.id} has already ended: {RunState.ABANDONED.value} (its launcher is gone and left "
              "nothing running)")
        return ExitCode.FAILED
    run.folder.event("cancel", f"ddpkit cancel: the launcher is gone; SIGTERM to the {len(left)} processes it left")
    print(f"ddpkit cancel: run {rec.id}'s launcher (pid {rec.launcher.pid}) is gone; stopping the {len(left)} "
          f"processes it left running (SIGTERM, SIGKILL after {rec.stop_grace_s:g} s)", flush=True)
    proctree.signal_all(left, signal.SIGTERM)
    # Polled by the environment, not the pids: an ended process awaiting its
    # (new) parent's wait() has none, and must not hold up the stop.
    deadline = time.monotonic() + rec.stop_grace_s
    while proctree.with_env(envnames.DDPKIT_RUN_ID, rec.id) and time.monotonic() < deadline:
        time.sleep(0.1)
    proctree.signal_all(proctree.with_env(envnames.DDPKIT_RUN_ID, rec.id), signal.SIGKILL)
    run.folder.finish(None, state=RunState.CANCELLED)
    print(f"ddpkit cancel: run {rec.id} cancelled (its launcher was gone; no exit code)")
    return ExitCode.OK
