"""A stop signal (Ctrl-C, a launcher's stop, a scheduler's pre-emption or
requeue) read as one line per node.

torchrun's agent turns a stop signal into SignalException in its main loop,
logs `Received N death signal, shutting down workers`, sends each worker the
signal (`Sending process N closing signal ...`) and waits for them. A second
stop signal while it waits (Slurm sends SIGTERM to every process of a job it
requeues, moments after the pre-emption signal) raised SignalException again
from inside that wait: the agent stopped waiting for workers that were still
writing their checkpoint, and printed both exceptions chained, ~60 lines,
where people read a job's output (a Slurm output file has no launcher to
fold them).

`install` changes three things: a stop signal that arrives once the agent
is stopping is noted, not raised (`on_stop_signal`), so the agent waits for
its workers as torch's shutdown timeout allows (the workers got the first
signal; passing them the second would change what they stop for: a trainer
requeues on the pre-emption signal only); torch's two shutdown warnings are
not printed (a Slurm job keeps them in the node's log, nodelog.py); and
`stopped_line` says what happened instead, from the workers' exit codes.
A worker that failed by itself is not a stop: it still reaches ChildFailedError
and its cause line, as before. That holds when the stop signal comes after
the worker ended and before torch's monitor saw it (every monitor_interval,
0.1 s): srun's --kill-on-bad-exit sends SIGTERM to every node as soon as the
first one's agent ended, and a node whose own worker failed a moment later
(a stall every rank saw) would otherwise end as stopped by SIGTERM, its
worker's code lost. Such a signal waits for the monitor's next look
(`_looked_at`): a failure ends the agent with its worker's code, a group
still running is stopped then.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

# torch's own log lines on a stop (agent/server/api.py, multiprocessing/api.py): what
# `stopped_line` says in one line. Matched on the message template, so a torch release that
# rewords them shows them again rather than hiding something else.
SHUTDOWN_CHATTER = frozenset({"Received %s death signal, shutting down workers", "Sending process %s closing signal %s"})
# torch's line on a failed worker group (multiprocessing/api.py), which the agent's own line says where no
# launcher reads its records (a Slurm job: __main__.report); kept in the node's log there, printed elsewhere.
FAILURE_CHATTER = frozenset({"failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"})
REPEAT_S = 5.0  # a stop signal this soon after the first is the same stop (see on_stop_signal)
# What launchers and schedulers send to stop a job (the zygote's SPARED); ignored once the agent's end is decided.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
TORCH_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


@dataclass
class SignalShutdown:
    """What the agent's last shutdown on a signal found."""

    first: int | None = None  # the stop signal torch raised SignalException for
    node: int | None = None  # the node's rank in the last rendezvous; None before one
    codes: list[int | None] = field(default_factory=list)  # each worker's exit code, None if it still ran
    later: list[int] = field(default_factory=list)  # stop signals that arrived while it stopped the workers
    stopping: bool = False  # torchrun's shutdown began: the agent ends
    at: float = 0.0  # time.monotonic() of the first stop signal
    ending: bool = False  # torchrun's run is over (its workers ended on their own): the agent exits
    in_shutdown: bool = False  # torch's shutdown of the workers runs now (a restart's, or the run's last)
    deferred: int | None = None  # a first stop signal that came during it: raised when the workers would start again
    watching: bool = False  # torch's monitor looks at running workers (from their start until they all succeeded)
    failed: bool = False  # the monitor found a worker failed: the run ends, or restarts its workers


LAST = SignalShutdown()
# Whether one of this agent's workers ended before anyone stopped it, asked in a signal handler (no lock,
# no read of the zygote: handler.a_worker_ended); nothing can say so until `install` is told.
def _none_known() -> bool:
    return False


_worker_ended: Callable[[], bool] = _none_known


class QuietShutdown(logging.Filter):
    """torch's shutdown warnings off the agent's output (`stopped_line` says
    it in one line); in a Slurm job kept in the node's log (nodelog.py), with
    torch's line on a failed group (the agent's `report` line says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from . import nodelog

        if record.msg not in SHUTDOWN_CHATTER and record.msg not in FAILURE_CHATTER:
            return True
        kept = nodelog.keep(f"{record.levelname} {record.name}: {record.getMessage()}",
                            "torch, on the stop" if record.msg in SHUTDOWN_CHATTER else "torch, on the failure")
        return kept is None and record.msg in FAILURE_CHATTER


def install(worker_ended: Callable[[], bool] | None = None) -> None:
    """torch's stop signal handler replaced (`on_stop_signal`), how the shutdown ended noted, its
    chatter kept off the output; `worker_ended`: whether a worker ended before torch stopped it
    (safe in a signal handler)."""
    global _worker_ended
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    if worker_ended is not None:
        _worker_ended = worker_ended

    for name in TORCH_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietShutdown) for f in logger.filters):
            logger.addFilter(QuietShutdown())
    # torch registers it by its module name as each worker group starts (PContext.start)
    api._terminate_process_handler = on_stop_signal
    if not getattr(LocalElasticAgent._shutdown, "ddpkit_noted", False):
        LocalElasticAgent._shutdown = _noting(LocalElasticAgent._shutdown)  # type: ignore[method-assign]
    if not getattr(LocalElasticAgent._invoke_run, "ddpkit_noted", False):
        LocalElasticAgent._invoke_run = _ending_after(LocalElasticAgent._invoke_run)  # type: ignore[method-assign]
    if not getattr(api.PContext.close, "ddpkit_noted", False):
        api.PContext.close = _marking_shutdown(api.PContext.close)  # type: ignore[method-assign]
    if not getattr(LocalElasticAgent._initialize_workers, "ddpkit_noted", False):
        LocalElasticAgent._initialize_workers = _deferred_first(  # type: ignore[method-assign]
            LocalElasticAgent._initialize_workers)
    if not getattr(LocalElasticAgent._monitor_workers, "ddpkit_noted", False):
        LocalElasticAgent._monitor_workers = _looked_at(  # type: ignore[method-assign]
            LocalElasticAgent._monitor_workers)


def _noting(shutdown: Callable[..., None]) -> Callable[..., None]:
    """torch's shutdown, noting that it began and how the workers ended."""

    def _shutdown(self: Any, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        outer, LAST.stopping, LAST.in_shutdown = LAST.in_shutdown, True, True
        try:
            shutdown(self, death_sig, timeout)
        finally:
            LAST.in_shutdown = outer
        if self._pcontext is not None:
            LAST.codes = exit_codes(self._pcontext)
        LAST.node = getattr(getattr(self, "_worker_group", None), "group_rank", None)

    _shutdown.ddpkit_noted = True  # type: ignore[attr-defined]
    return _shutdown


def _marking_shutdown(close: Callable[..., None]) -> Callable[..., None]:
    """torch's stop of a worker group's processes and their log tailers: when
    a worker failed, torch's poll runs it at once, before the agent's own
    shutdown, so it marks `in_shutdown` too."""

    def _close(self: Any, *args: Any, **kwargs: Any) -> None:
        outer, LAST.in_shutdown = LAST.in_shutdown, True
        try:
            close(self, *args, **kwargs)
        finally:
            LAST.in_shutdown = outer

    _close.ddpkit_noted = True  # type: ignore[attr-defined]
    return _close


def _ending_after(invoke_run: Callable[..., Any]) -> Callable[..., Any]:
    """The run's loop; once it is over without a stop signal (the workers
    ended, or failed with no restart left), torch's last shutdown follows and
    the agent exits: a stop signal from then on is noted (`ending`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def _invoke_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = invoke_run(self, *args, **kwargs)
        except SignalException:
            raise
        except BaseException:
            ending()
            raise
        ending()
        return result

    _invoke_run.ddpkit_noted = True  # type: ignore[attr-defined]
    return _invoke_run


def _deferred_first(initialize: Callable[..., None]) -> Callable[..., None]:
    """torch's start of the workers, which raises first a stop signal that
    came while the workers of a failed round were being stopped (a restart):
    the agent then stops as if it had come a moment later."""

    def _initialize_workers(self: Any, *args: Any, **kwargs: Any) -> None:
        LAST.failed = LAST.watching = False
        _raise_deferred()
        initialize(self, *args, **kwargs)
        LAST.watching = True

    _initialize_workers.ddpkit_noted = True  # type: ignore[attr-defined]
    return _initialize_workers


def _looked_at(monitor: Callable[..., Any]) -> Callable[..., Any]:
    """torch's look at the workers (every monitor_interval), which decides a
    stop signal that came after a worker ended and before this look
    (`on_stop_signal`): a failed group ends the run (the signal noted) or
    restarts, which raises it first (`_deferred_first`); a group still running
    (or all done), or whose workers ended on that signal themselves, is
    stopped now, as if the signal had just come."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    def _monitor_workers(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = monitor(self, *args, **kwargs)
        state = getattr(result, "state", None)
        if state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            if LAST.deferred is not None and stopped_by(LAST.deferred, result):
                _raise_deferred()  # the workers ended on the signal itself (srun sends it to them too): a stop
            LAST.failed = True
        else:
            _raise_deferred()
            if state == WorkerState.SUCCEEDED:
                LAST.watching = False
        return result

    _monitor_workers.ddpkit_noted = True  # type: ignore[attr-defined]
    return _monitor_workers


def stopped_by(sig: int, result: Any) -> bool:
    """Whether every failed worker of a monitor's `result` ended on `sig` itself:
    killed by it, its shell's 128+N, or checkpointed and exited 75 (a stop, not a failure)."""
    from ..shared.exitcodes import ExitCode

    codes = [getattr(failure, "exitcode", None) for failure in (getattr(result, "failures", None) or {}).values()]
    return bool(codes) and all(code in (-sig, 128 + sig, int(ExitCode.PREEMPTED)) for code in codes)


def _raise_deferred() -> None:
    """The stop signal held back (`on_stop_signal`), raised now as torch's handler would have raised it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if LAST.deferred is not None:
        sig, LAST.deferred = LAST.deferred, None
        LAST.first, LAST.at = sig, time.monotonic()
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=signal.Signals(sig))


def on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """torch's handler (multiprocessing/api.py's `_terminate_process_handler`):
    SignalException in the agent's loop, which stops the workers and ends the
    agent. A stop signal after that, while the agent stops its workers or within
    REPEAT_S of the first (before torch's shutdown began), is noted in LAST
    instead: raised, it would end the agent's wait for workers still writing
    their checkpoint. Later than that and with no shutdown begun, something
    swallowed the first, and it is raised again. Once torchrun's run is over
    (`ending`), every stop signal is noted; a first one during torch's own
    stop of the workers, or once its monitor found a worker failed, is noted
    and raised when they would start again (`_deferred_first`): the run's last
    stop ends the agent anyway. A first one after a worker ended, before the
    monitor's next look, is held for that look (`_looked_at`), which tells a
    failure (the agent ends with its worker's code) from a stop."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    now = time.monotonic()
    if LAST.ending or (LAST.first is not None and (LAST.stopping or now - LAST.at < REPEAT_S)):
        LAST.later.append(signum)
        return
    # torch's own stop of the workers runs (raised, it would cut short its waits), or a worker failed
    # or ended unseen (the failure, not the stop, says how this node ended), or one is held already
    if LAST.deferred is not None or LAST.in_shutdown or LAST.failed or (LAST.watching and _worker_ended()):
        LAST.deferred = signum if LAST.deferred is None else LAST.deferred
        return
    LAST.first, LAST.at = signum, now
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def ending() -> None:
    """torchrun's run is over: a stop signal from now on (a launcher stopping
    every node as this one ends on its own) is noted, not raised; raised, it
    would print torch's traceback from wherever the agent's exit was (torch's
    last shutdown waiting for its log tailers, an atexit hook) instead of the
    agent's own end."""
    LAST.ending = True


def settled() -> None:
    """The agent's end is decided (its exit status set): a stop signal from now
    on is ignored. Python puts the default action back for every signal it
    handled as its interpreter finalizes, and a SIGTERM then (srun stopping
    every node as this one ends: tens of ms with torch loaded) would kill the
    agent, its status the signal's (143), not the one it decided."""
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # not the main thread, or a signal this system lacks
            pass


def exit_codes(pcontext: Any) -> list[int | None]:
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers is None:
        return []
    return [handler.proc.poll() for _, handler in sorted(handlers.items())]


def name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _ended(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {name(-code)}"
    return f"exit {code}"


def stopped_code(stop: SignalShutdown | None = None) -> int:
    """The agent's exit status for a stop (LAST's unless `stop`): 75 where
    every worker checkpointed on it and exited 75, so that the scheduler's
    record of the node (Slurm's exit code, a container's or pod's) says a
    checkpointed stop, as an srun task's own does; else 1, torchrun's."""
    from ..shared.exitcodes import ExitCode

    stop = LAST if stop is None else stop
    checkpointed = bool(stop.codes) and all(code == ExitCode.PREEMPTED for code in stop.codes)
    return int(ExitCode.PREEMPTED if checkpointed else ExitCode.FAILED)


def stopped_line(sig: int, stop: SignalShutdown | None = None) -> str:
    """The agent's one line for a stop by `sig` (LAST's unless `stop`): the node, and how its workers ended."""
    stop = LAST if stop is None else stop
    where = "" if stop.node is None else f" node {stop.node}:"
    if not stop.codes:
        said = "no workers were running"
    else:
        ends = list(dict.fromkeys(_ended(code) for code in stop.codes))
        count = len(stop.codes)
        said = f"{'its worker' if count == 1 else f'its {count} workers'} stopped ({', '.join(ends)})"
    later = list(dict.fromkeys(name(s) for s in stop.later))
    also = f"; {' and '.join(later)} too, while stopping" if later else ""
    return f"ddpkit.agent:{where} {name(sig)}: {said}{also}"
