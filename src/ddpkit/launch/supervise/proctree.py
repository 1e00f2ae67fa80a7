"""Process trees on this host, read through psutil.

torchrun starts every worker in a session of its own, so a worker is not in
its agent's process group: signalling the agent's group misses it, and once
the agent is SIGKILLed the worker is re-parented to init and cannot be found
by ancestry any more. Teardown therefore records the whole tree first."""

from __future__ import annotations

import os
import signal

import psutil

from ...host import processes


def descendants(root: int) -> list[int]:
    """Every process below `root` (not `root` itself), whatever its session;
    none once `root` has ended (its children went to init)."""
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []


def with_env(name: str, value: str) -> list[int]:
    """Every process we can read whose environment has name=value (not this
    one): a launcher's nodes and workers after the launcher is gone, whatever
    their session or parent now."""
    return [pid for pid in psutil.pids() if pid != os.getpid() and processes.environ_has(pid, name, value)]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            living.append(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            living.append(pid)
    return living
