"""The agent's pre-imported worker parent: one process per torchrun agent,
forked from the agent before it has threads, with torch, torch._dynamo and
ddpkit's trainer imported once; every worker of every restart is forked from
it instead of starting an interpreter and importing torch again.

Why a process of its own and not a fork of the agent at each start: by then
the agent runs threads (the rendezvous keep-alive, the store, the log
tailers), and a fork copies the locks they hold, unlocked by nobody in the
child (train/data/loader_procs.py saw a rank stall on that). The zygote is forked
while the agent is single-threaded and never starts a thread itself.

A worker forked here is what torchrun's Popen would have started: a session
of its own (the agent ends it with killpg), the environment, working
directory, argv and stdout/stderr files torchrun gave it, unbuffered stdio
(torchrun runs `python -u`), and the exit code an interpreter would have
ended with. What differs: no exec happens, so /proc/PID/environ shows the
agent's environment (everything but torchrun's per-worker variables, which
the worker's os.environ has), and the worker's parent is the zygote, not the
agent. /proc/PID/cmdline, what ps shows, is rewritten to the worker's line
(worker.show_argv): the agent's line holds the worker's, so it fits. What a
forked worker does to become one is worker.py's; this module is the zygote
and the agent's end of it.

The protocol, over one socket pair: the agent sends a WorkerRequest and gets
("pid", pid) or ("fail", why) back; whenever a worker ends the zygote sends
("exit", pid, returncode) (a signal as a negative number, as Popen says it).
The zygote ends when the agent's end closes (the agent ended) and with its
parent (processes.die_with), never on a stop signal (SPARED), and each
worker with the zygote: where torchrun's Popen workers outlive an agent
that was SIGKILLed (by Slurm after KillWait, by the OOM killer), running on
unsupervised, a forked worker never does.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, Pipe, wait
from typing import cast

from ..host import processes
from ..shared import envnames
from . import worker
from .worker import WorkerRequest

READ_SLICE_S = 0.1  # the longest a reader of the workers' exits holds the connection at a time
# How long a worker's start waits for the zygote's answer: its imports (a few
# seconds; minutes only on a machine in trouble) come first.
SPAWN_REPLY_S = 120.0
# torch.cuda.is_available() asks NVML, not the CUDA runtime, when this is 1 (torch.cuda._nvml_based_avail).
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


class Zygote:
    """The agent's end: forks workers and learns their exit codes."""

    def __init__(self, conn: Connection, pid: int) -> None:
        self.pid = pid
        self._conn = conn
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self.alive = True
        self.refused: str | None = None  # why the zygote forks no worker (said once; workers start as interpreters)

    def spawn(self, request: WorkerRequest) -> int | None:
        """The new worker's pid, or None when the zygote could not fork it
        (the caller starts that worker the ordinary way)."""
        with self._lock:
            try:
                self._conn.send(request)
                while True:
                    if not self._conn.poll(SPAWN_REPLY_S):
                        self._give_up()
                        return None
                    reply = self._conn.recv()
                    if reply[0] == "pid":
                        return int(reply[1])
                    if reply[0] == "fail":
                        self._refuse(str(reply[1]))
                        return None
                    self._exits[reply[1]] = reply[2]
            except (OSError, EOFError):
                self.alive = False
                return None

    def close(self) -> None:
        """End the zygote and reap it, so that it is gone before the agent is
        (a launcher that checks nothing is left finds nothing). Its workers
        are in sessions of their own and stay, as Popen's would."""
        self.alive = False
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass  # reaped already
        self._conn.close()

    def _refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why
            print(f"ddpkit.agent: workers start as new interpreters: {why}", file=sys.stderr, flush=True)

    @property
    def takes_requests(self) -> bool:
        """Whether the next worker may be asked of the zygote."""
        return self.alive and self.refused is None

    def _give_up(self) -> None:
        """A zygote that does not answer (stuck in its imports): ended, and the
        agent starts its workers the ordinary way from now on."""
        self.alive = False
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(f"ddpkit.agent: the zygote did not answer within {SPAWN_REPLY_S:g} s; "
              "workers start as new interpreters", file=sys.stderr, flush=True)

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """The worker's returncode once it ended, waiting up to `timeout` s
        for news of it; None while it runs. A long wait reads in slices of
        READ_SLICE_S, letting go of the connection between them: another
        thread's question (the stopped-worker check polls while torchrun's
        shutdown waits) is answered meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            with self._lock:
                self._read(pid, max(0.0, min(left, READ_SLICE_S)))
                code = self._exits.get(pid)
            if code is not None or not self.alive or left <= READ_SLICE_S:
                return code

    def _read(self, pid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while pid not in self._exits and self.alive:
            left = max(0.0, deadline - time.monotonic())
            try:
                if not self._conn.poll(left):
                    return
                reply = self._conn.recv()
            except (OSError, EOFError):
                self.alive = False
                return
            if reply[0] == "exit":
                self._exits[reply[1]] = reply[2]


def start(preload: tuple[str, ...]) -> Zygote | None:
    """Fork the zygote now, or None when this process already runs threads
    (a fork would be unsafe: the agent then starts its workers the ordinary way)."""
    if threading.active_count() != 1 or not hasattr(os, "pidfd_open"):
        return None
    agent_end, zygote_end = Pipe(duplex=True)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        agent_end.close()
        try:
            _serve(zygote_end, parent, preload)
        finally:
            os._exit(0)  # never back into the agent's code
    zygote_end.close()
    return Zygote(agent_end, pid)


# ---- in the zygote ---------------------------------------------------------------


# What launchers and schedulers send to every process of a job (launch local's
# stop, Slurm's step signals, `--signal`): the zygote lives on through them,
# since its workers end with it and may be checkpointing on that very signal;
# it ends with its agent. Blocked, not ignored: a fork inherits the mask, and a
# signal sent to a new worker before it unblocks them waits for it instead of
# being lost (an ignored one would be).
SPARED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _serve(conn: Connection, parent: int, preload: tuple[str, ...]) -> None:
    # A session of its own: a signal to the agent's process group (a terminal's
    # Ctrl-C, a launcher's stop) is the agent's to handle, not the zygote's.
    os.setsid()
    signal.pthread_sigmask(signal.SIG_BLOCK, SPARED)
    processes.die_with(parent)
    preload_modules(preload)
    refusal = cuda_refusal()
    worker.show_argv(["ddpkit.agent:", "zygote", "of", "agent", str(parent)])
    gc.collect()
    gc.freeze()  # objects from before the fork stay out of the workers' collections: fewer pages copied
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for ready in wait([conn, *children]):
            if ready is conn:
                try:
                    request = conn.recv()
                except (OSError, EOFError):
                    return  # the agent ended
                if refusal is not None:
                    conn.send(("fail", refusal))
                else:
                    _fork_worker(conn, request, children)
            else:
                reap(conn, cast(int, ready), children)


def preload_modules(preload: tuple[str, ...]) -> None:
    """Import `preload`, asking NVML rather than the CUDA runtime whether a GPU
    is there should a module ask torch.cuda.is_available() while it is
    imported: the runtime's answer would leave the zygote's forks unable to
    use CUDA (cuda_refusal), NVML's leaves them as a new interpreter is."""
    own = NVML_CHECK not in os.environ
    if own:
        os.environ[NVML_CHECK] = "1"
    try:
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception:  # a worker that needs it imports it again, and says why it fails
                continue
    finally:
        if own:
            os.environ.pop(NVML_CHECK, None)


def cuda_refusal() -> str | None:
    """Why a worker forked from this process could not use CUDA, or None.

    A CUDA runtime call (torch.cuda.is_available() through the runtime, a
    tensor on the GPU) in the zygote marks every later fork "bad" in torch:
    the worker's first CUDA call raises "Cannot re-initialize CUDA in forked
    subprocess". Nothing shows that mark in the process that made it, so a
    throw-away fork reads it; it costs one fork, once per agent."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    extra = os.environ.get(envnames.DDPKIT_AGENT_PRELOAD)
    why = "the zygote's imports initialised CUDA, and a forked worker could not use the GPU" + \
        (f" (DDPKIT_AGENT_PRELOAD={extra})" if extra else "")
    if torch.cuda.is_initialized():
        return why
    probe = os.fork()
    if probe == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(probe, 0)
    return why if os.waitstatus_to_exitcode(status) != 0 else None


def _fork_worker(conn: Connection, request: WorkerRequest, children: dict[int, int]) -> None:
    if threading.active_count() != 1:
        conn.send(("fail", "the zygote runs threads"))
        return
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        for fd in children:
            os.close(fd)
        conn.close()
        worker.become(request, zygote, SPARED)  # never returns
    children[os.pidfd_open(pid)] = pid
    conn.send(("pid", pid))


def reap(conn: Connection, pidfd: int, children: dict[int, int]) -> None:
    """Wait for the child whose pidfd is ready and tell the other end its exit code."""
    pid = children.pop(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    try:
        conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
    except OSError:
        pass  # the other end is gone; nobody to tell
