"""Where the DataLoader's worker processes come from, and how they end with their rank.

By the time the first batch is asked for, a rank runs other threads: the hang
watchdog's, gloo's or NCCL's, the store client's. A fork copies the locks those
threads hold at that instant, unlocked by nobody in the child, and a worker
that touches one waits forever (seen here: a rank stalled at step 0 on workers
that never sent a batch). So the workers are forked from a fork server: a
fresh, single-threaded interpreter with torch and the dataset's module imported
once (preload), started beside the rest of the set-up.

A fork server's children do not notice their rank's death the way forked
workers do: torch's worker checks that its parent is still the process that
started it, and their parent is the server, which in turn stays up while any
child holds its pipe. A rank that leaves by os._exit (the watchdog's exit 13
and 14) or SIGKILL would leave both behind for good. Importing this module in
the server (it is the first preload) ties the server to the rank, and
`worker_init` ties each worker to the server, with Linux's parent-death
signal: the rank gone, the rest is SIGKILLed at once.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

from ...host import processes
from ...shared import envnames

TRACKER_QUIET = "ignore:resource_tracker:UserWarning"


def die_with_parent(parent_var: str) -> None:
    """End with the parent whose pid is in $parent_var (processes.die_with)."""
    processes.die_with(int(os.environ.get(parent_var, "0")))


def worker_init(worker_id: int) -> None:
    """Each loader worker: ends with the fork server that forked it."""
    del worker_id
    die_with_parent(envnames.DDPKIT_LOADER_SERVER_PID)


def worker_context(preload: list[str]) -> BaseContext:
    """The fork server's context, the server started now with `preload` imported."""
    os.environ[envnames.DDPKIT_LOADER_RANK_PID] = str(os.getpid())
    # multiprocessing's resource tracker (started with the server, from this
    # interpreter's -W options) reclaims the queues' semaphores after a rank
    # that left by os._exit or a signal, and warns about "leaked semaphore
    # objects" in the job's log each time: expected there, so not said.
    if TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_QUIET)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *preload])
    forkserver.ensure_running()
    return ctx


def _in_fork_server() -> bool:
    """This process is a fork server started by worker_context (it runs
    multiprocessing.forkserver's main from `python -c`, as no other process does)."""
    return (envnames.DDPKIT_LOADER_RANK_PID in os.environ and sys.argv[:1] == ["-c"]
            and "multiprocessing.forkserver" in sys.modules and multiprocessing.parent_process() is None
            and envnames.DDPKIT_LOADER_SERVER_PID not in os.environ)


# In the fork server (the first module it preloads): end with the rank, and
# tell the workers forked from here which pid is theirs to end with.
if _in_fork_server():
    os.environ[envnames.DDPKIT_LOADER_SERVER_PID] = str(os.getpid())
    die_with_parent(envnames.DDPKIT_LOADER_RANK_PID)
