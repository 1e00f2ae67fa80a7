"""torchrun's worker start, through the zygote.

torchrun's SubprocessContext starts each worker with
`get_subprocess_handler(...)`, a SubprocessHandler whose `_popen` runs
Popen([python, -u, -m, module, ...]). `install` puts a handler in its place
whose `_popen` asks the zygote for the same worker and returns a ForkedProc,
the part of Popen that torchrun uses (pid, poll, wait, send_signal). A line
that is not `sys.executable -u ...` (PYTHON_EXEC, numactl for --numa-binding)
goes to Popen as before; so does every line when no zygote forks
(DDPKIT_AGENT_FORK=0, or a zygote that cannot), where a program of the
user's own runs under `-m ddpkit.run` to get the preamble all the same. The hook is torch's
module attribute, so `unsupported()` checks it is there first; the agent
says why and starts workers as torchrun does when a torch release moves it
(tests/test_agent.py pins it).

Every worker, forked or not, is watched (`Watched`): a worker that torchrun
finds ended with a failure is said on the agent's stderr as a `worker_exit`
record (ddpkit.records), which launchers read for the worker's own exit code
(the agent itself exits 1). A worker that ends after torchrun began to stop
it ended by torchrun's doing, which is no news. A worker that failed by
itself is told to `MEMORY` with what it noted (sameerror.py): the same
error after a restart is a bug, and torchrun's restart then raises
SameErrorTwice instead (`stop_restarts_after_the_same_error`).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from .. import records
from ..host import processes
from ..shared import envnames
from ..shared.agreed import RUN_MODULE, is_ddpkit_module
from . import sameerror
from .worker import WorkerRequest
from .zygote import Zygote


class ForkedProc:
    """A worker forked by the zygote, seen as torchrun sees a Popen."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._zygote = zygote
        self._pidfd = _pidfd(pid)  # tells an ended worker from a running one if the zygote is gone

    def poll(self) -> int | None:
        return self._returncode(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._returncode(float("inf") if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it ended since: the zygote reaps at once, where Popen's child waits as a zombie

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def ended(self) -> bool:
        """Whether it ended, known or not: no lock and no read of the zygote (safe in a signal handler)."""
        return self.returncode is not None or self._pidfd < 0 or _ended(self._pidfd, 0.0)

    def _returncode(self, timeout: float) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, timeout)
        if self.returncode is None and not self._zygote.alive and _ended(self._pidfd, timeout):
            # The zygote is gone (killed, or given up) and with it the news of how this worker
            # ended: say it was killed, the likeliest end of a worker whose zygote was killed.
            self.returncode = -signal.SIGKILL
        if self.returncode is not None and self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return self.returncode


class Watched:
    """A worker's process (a Popen, or a ForkedProc) as torchrun uses it, that
    says how it ended when that was a failure torchrun found (see the module's doc)."""

    def __init__(self, proc: Any, env: dict[str, str]) -> None:
        self.proc = proc
        self.stopping = False  # torchrun began to stop it: how it ends is no news
        self._rank, self._local_rank = _int(env.get(envnames.RANK)), _int(env.get(envnames.LOCAL_RANK))
        self._restart = _int(env.get(envnames.TORCHELASTIC_RESTART_COUNT)) or 0
        self._failure_file = env.get(envnames.DDPKIT_FAILURE_FILE)
        self._said = False

    @property
    def rank(self) -> int | None:
        return self._rank

    def poll(self) -> int | None:
        return self._noted(self.proc.poll())

    def wait(self, timeout: float | None = None) -> int:
        code = int(self.proc.wait(timeout))
        self._noted(code)
        return code

    def __getattr__(self, name: str) -> Any:  # pid, args, returncode, send_signal ...: the process's own
        return getattr(self.proc, name)

    def ended_unstopped(self) -> bool:
        """Whether it ended with nobody stopping it, seen or not yet by torchrun:
        no lock, no read (safe in a signal handler)."""
        if self.stopping:
            return False
        if isinstance(self.proc, ForkedProc):
            return self.proc.ended()
        return self.proc.returncode is not None or _exited_unreaped(int(self.proc.pid))

    def _noted(self, code: int | None) -> int | None:
        if code and not self._said and not self.stopping:
            self._said = True
            # When, on this node's clock: a launcher orders the nodes' failures by it.
            at = time.time()
            FIRST_FAILURE.append(at)
            records.emit(records.WorkerExit(rank=self._rank, local_rank=self._local_rank, pid=int(self.proc.pid),
                                            exitcode=code), time=at)
            if code > 0:  # it ended by itself: an exception it noted, or an exit of its own
                repeated = MEMORY.failed(sameerror.read(self._failure_file), self._rank, self._restart)
                if repeated is not None:
                    sameerror.announce(repeated)
        return code


def _exited_unreaped(pid: int) -> bool:
    """Whether this process's child `pid` exited, without reaping it (Popen's wait still learns its code)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped already


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _pidfd(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1  # it ended already; the zygote's news says how


def _ended(pidfd: int, timeout: float) -> bool:
    if pidfd < 0:
        return True
    ready, _, _ = select.select([pidfd], [], [], None if timeout == float("inf") else timeout)
    return bool(ready)


def request_for(args: Sequence[str], env: dict[str, str], stdout: str | None, stderr: str | None) -> WorkerRequest | None:
    """The zygote's request for torchrun's worker line, or None when the line
    is not this interpreter's `python -u ...` (the zygote holds only that)."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return None
    return WorkerRequest(argv=tuple(args[2:]), env=dict(env), cwd=os.getcwd(), stdout=stdout, stderr=stderr)


def unsupported() -> str | None:
    """Why this torch's worker start cannot be routed through a zygote, or None."""
    try:
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    except ImportError as exc:
        return f"torch's worker start is not where ddpkit expects it ({exc})"
    if not callable(getattr(api, "get_subprocess_handler", None)) or not hasattr(SubprocessHandler, "_popen"):
        return "torch's worker start is not where ddpkit expects it (api.get_subprocess_handler)"
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    if not callable(getattr(SimpleElasticAgent, "_restart_workers", None)):
        return "torch's worker restart is not where ddpkit expects it (SimpleElasticAgent._restart_workers)"
    return None


def with_runner(args: Sequence[str]) -> list[str]:
    """A worker line started as a new interpreter: a program of the user's
    own runs under `ddpkit.run`, so it gets the preamble a forked worker gets."""
    line = list(args)
    if len(line) < 3 or line[0] != sys.executable or line[1] != "-u" or \
            (line[2] == "-m" and (len(line) < 4 or is_ddpkit_module(line[3]))):
        return line
    return [*line[:2], "-m", RUN_MODULE, *line[2:]]


STOPPED_GRACE_S = 10.0  # a worker stopped when asked to stop is killed when still stopped this long after
_STARTED: list[int] = []  # one entry per worker started
_WATCHED: list[Watched] = []  # the workers of this agent not yet stopped by torchrun
FIRST_FAILURE: list[float] = []  # when (time.time()) each failure of a worker was seen, the first first
MEMORY = sameerror.Memory()  # what this agent's workers failed with, per start: the same error twice is a bug


def repeated() -> sameerror.Repeated | None:
    """The same error twice in this agent's workers (a bug), if it was seen."""
    return MEMORY.repeated


def with_failure_file(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment with DDPKIT_FAILURE_FILE (sameerror.file_for),
    any file left there by an earlier start removed; a new start of the
    worker group is told to MEMORY, with its world."""
    if env.get(envnames.LOCAL_RANK) == "0":
        MEMORY.started(f"{env.get(envnames.WORLD_SIZE)}/{env.get(envnames.GROUP_WORLD_SIZE)}")
    path = sameerror.file_for(env)
    if path is None:
        return env
    try:
        os.unlink(path)
    except OSError:
        pass
    return {**env, envnames.DDPKIT_FAILURE_FILE: path}


def a_worker_ended() -> bool:
    """Whether a worker of this agent ended before torchrun stopped it (it
    failed, or finished), which torchrun's monitor may not have seen yet: asked
    by agent/stopping.py's handler of a stop signal, so no lock and no read."""
    return any(watched.ended_unstopped() for watched in list(_WATCHED))


def watch(watched: Watched) -> Watched:
    """`watched`, kept among this agent's workers (those torchrun stopped let go)."""
    _WATCHED[:] = [w for w in _WATCHED if not w.stopping]
    _WATCHED.append(watched)
    return watched


def workers_started() -> int:
    """How many workers this agent started: none until a rendezvous formed."""
    return len(_STARTED)


def install(zygote: Zygote | None) -> None:
    """Route torchrun's worker starts through `zygote` (after `unsupported()`
    said None); without one, or where it forks nothing, each worker starts as
    a new interpreter (under `ddpkit.run` when it is a program of the user's own)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class ZygoteHandler(SubprocessHandler):
        def _popen(self, args: tuple[str, ...], env: dict[str, str]) -> Any:
            _STARTED.append(1)
            env = with_failure_file(env)
            if zygote is not None and zygote.takes_requests:
                request = request_for(args, env, _name(getattr(self, "_stdout", None)),
                                      _name(getattr(self, "_stderr", None)))
                pid = zygote.spawn(request) if request is not None else None
                if pid is not None:
                    return watch(Watched(ForkedProc(zygote, pid, args), env))
            return watch(Watched(super()._popen(tuple(with_runner(args)), env), env))

        def close(self, death_sig: signal.Signals | None = None) -> None:
            """torch's close (killpg of the worker's session, then its files), for
            a worker that may have ended and been reaped since torchrun polled it;
            a stopped worker is then killed at once (`kill_if_stopped`)."""
            watched = cast(Watched, self.proc)
            watched.stopping = True
            self._close(watched, death_sig)
            kill_if_stopped(watched, death_sig)

        def _close(self, watched: Watched, death_sig: signal.Signals | None) -> None:
            if not isinstance(watched.proc, ForkedProc):
                super().close(death_sig)
                return
            if watched.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for stream in (getattr(self, "_stdout", None), getattr(self, "_stderr", None)):
                if stream is not None:
                    stream.close()

    def get_subprocess_handler(**kwargs: Any) -> SubprocessHandler:
        return ZygoteHandler(**kwargs)

    api.get_subprocess_handler = get_subprocess_handler  # type: ignore[assignment]
    stop_restarts_after_the_same_error()


def stop_restarts_after_the_same_error() -> None:
    """torchrun's agent restarts a failed worker group while it has restarts
    left; after the same error twice (MEMORY) it raises SameErrorTwice there
    instead: torchrun stops the workers, closes the rendezvous, and the agent
    ends with ExitCode.SAME_ERROR (__main__.py)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    restart = SimpleElasticAgent._restart_workers
    if getattr(restart, "same_error_checked", False):
        return

    def _restart_workers(self: Any, worker_group: Any) -> None:
        if MEMORY.repeated is not None:
            raise sameerror.SameErrorTwice(MEMORY.repeated)
        restart(self, worker_group)

    _restart_workers.same_error_checked = True  # type: ignore[attr-defined]
    SimpleElasticAgent._restart_workers = _restart_workers  # type: ignore[method-assign]


def kill_if_stopped(watched: Watched, death_sig: signal.Signals | None) -> None:
    """A worker that is stopped (SIGSTOP, a debugger) when asked to stop acts
    on no signal but SIGKILL until it is continued: it cannot checkpoint, and
    its peers wait for it in their stop agreement. One still stopped
    STOPPED_GRACE_S later (job control or a test may continue it, and it then
    takes the signal) is killed, with one line that says so, not left to
    torchrun's shutdown timeout; its peers' collectives then fail and they end too."""
    if death_sig in (None, signal.SIGKILL) or watched.proc.poll() is not None or not processes.is_stopped(watched.pid):
        return
    threading.Thread(target=_kill_when_still_stopped, args=(watched, signal.Signals(death_sig)),
                     name=f"stopped worker {watched.pid}", daemon=True).start()


def _kill_when_still_stopped(watched: Watched, death_sig: signal.Signals) -> None:
    deadline = time.monotonic() + STOPPED_GRACE_S
    while time.monotonic() < deadline:
        if watched.proc.poll() is not None or not processes.is_stopped(watched.pid):
            return  # it ended, or was continued and takes the signal
        time.sleep(0.2)
    who = "a worker" if watched.rank is None else f"rank {watched.rank}"
    print(f"ddpkit.agent: {who} (pid {watched.pid}) is stopped (SIGSTOP or a debugger) and was not continued "
          f"within {STOPPED_GRACE_S:g} s of {death_sig.name}: it cannot act on it or write a checkpoint; killed "
          "now, so the job stops without waiting for the shutdown timeout", file=sys.stderr, flush=True)
    try:
        os.killpg(watched.pid, signal.SIGKILL)  # its session: what it started goes with it
    except (ProcessLookupError, PermissionError):
        watched.proc.send_signal(signal.SIGKILL)


def _name(stream: Any) -> str | None:
    return None if stream is None else str(stream.name)

