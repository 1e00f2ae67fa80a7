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

import ctypes
import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

from .. import envnames

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """SIGKILL this process as soon as its parent ends (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _rank_gone() -> bool:
    """The rank that started the server ended already (before the death signal was set)."""
    pid = os.environ.get(envnames.DDPKIT_LOADER_RANK_PID)
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def worker_init(worker_id: int) -> None:
    """Each loader worker: ends with the fork server that forked it."""
    del worker_id
    die_with_parent()
    if _rank_gone():
        os._exit(0)


def worker_context(preload: list[str]) -> BaseContext:
    """The fork server's context, the server started now with `preload` imported."""
    os.environ[envnames.DDPKIT_LOADER_RANK_PID] = str(os.getpid())
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *preload])
    forkserver.ensure_running()
    return ctx


# In the fork server (the first module it preloads): end with the rank.
if os.environ.get(envnames.DDPKIT_LOADER_RANK_PID) == str(os.getppid()) and "multiprocessing.forkserver" in sys.modules \
        and multiprocessing.parent_process() is None and sys.argv[:1] == ["-c"]:
    die_with_parent()
    if _rank_gone():
        os._exit(0)
