"""A launcher's `--detach`: the run's supervision in a process of its own
that outlives the terminal which started it (docs/guides/detach.md).

The launching command does its first checks (the prelude: arguments,
refusals, secrets) and makes the run folder as an attached launch does, so
a refused job is refused on the terminal, with its exit code. Then it
starts the same launcher again as the run's supervisor, in a session of its
own (setsid: no controlling terminal, so closing the terminal sends it no
SIGHUP, and Ctrl-C in that terminal does not reach it), stdin from
/dev/null, stdout and stderr into the run folder's `console.log`. The
supervisor starts with SIGINT and SIGTERM blocked, records itself as the
run's launcher, holds a stop signal until its nodes start
(prelude.hold_stop_signals) and says it is ready on a pipe; only then does
this command return, with the run's name and how to follow it: a `ddpkit
cancel` right after the return is a clean cancel, not an abandoned run. A
supervisor that ends before it is ready (its own checks refused the job)
has its console shown here, and its exit code returned. `ddpkit status`,
`logs --follow`, `cancel` and `report` find the run by its name and reach
its supervisor by the recorded pid, as they reach an attached launcher. The
supervisor writes the run's end (state, exit code, summary) into run.json
as an attached launcher does, and its console (the summary and closing
line) into `console.log`.

`launch ssh --detach` starts its supervisor on the job's first host instead
(launch/ssh/detached.py), with the same handshake.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..runs import RunFolder
from ..shared.exitcodes import ExitCode

READY_WAIT_S = 300.0  # a supervisor that has not said it is ready by then is left to go on without this command
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _blocked_stop_signals() -> None:
    """In the supervisor's process before it runs Python: a `ddpkit cancel`
    before its handlers are installed waits for them (the mask outlives exec)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def detach(who: str, run: RunFolder, argv: Callable[[int], list[str]]) -> int:
    """Start `argv(fd)` (the launcher again, with the run folder and the
    descriptor it says it is ready on) as the run's supervisor in a session
    of its own, wait until it is ready, and say how to follow it. `who`: the
    launcher's name, which the lines start with."""
    console = run.console_file
    ours, theirs = os.pipe()  # we read, the supervisor writes
    try:
        with console.open("ab") as out:
            proc = subprocess.Popen(argv(theirs), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, pass_fds=(theirs,), preexec_fn=_blocked_stop_signals)
    finally:
        os.close(theirs)
    said = _read_ready(ours, READY_WAIT_S)
    if said is None:  # it ended before it was ready: its own checks refused the job
        code = proc.wait()
        sys.stderr.write(_text(console))
        print(f"{who}: the run's supervisor ended before it started the job (exit code {code}); its console: "
              f"{console}", file=sys.stderr, flush=True)
        return code or ExitCode.FAILED
    rec = run.record()
    run.event("detached", f"supervised by pid {proc.pid} in a session of its own; its console: {console}")
    print(f"{who}: run {run.path.name} detached: supervised by pid {proc.pid} on {rec.launcher.host}, "
          f"which outlives this terminal; its console: {console}", flush=True)
    print(follow_line(who, rec.id), flush=True)
    return ExitCode.OK


def follow_line(who: str, run_id: str) -> str:
    return (f"{who}: follow it with `ddpkit logs {run_id} --follow`; `ddpkit status {run_id}`, "
            f"`ddpkit cancel {run_id}`, `ddpkit report {run_id}`")


def _read_ready(fd: int, wait_s: float) -> str | None:
    """What the supervisor wrote before it closed its end (its ready line), or
    None when it closed it without a word (it ended). Given up after
    `wait_s`: the supervisor goes on, this command returns."""
    got = b""
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            got += chunk
    finally:
        os.close(fd)
    text = got.decode("utf-8", "replace").strip()
    return text or (None if time.monotonic() < deadline else "")


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def absolute(path: Path | None) -> str | None:
    """A path the supervisor, which may start elsewhere, reads the same."""
    return None if path is None else os.path.abspath(path)
