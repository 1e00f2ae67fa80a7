"""Process trees on this host, read from /proc.

torchrun starts every worker in a session of its own, so a worker is not in
its agent's process group: signalling the agent's group misses it, and once
the agent is SIGKILLed the worker is re-parented to init and cannot be found
by ancestry any more. Teardown therefore records the whole tree first."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _parents() -> dict[int, int]:
    """pid -> ppid for every process we can read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces and ')': split after the last ')'.
            out[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process left while we read it
            continue
    return out


def descendants(root: int) -> list[int]:
    """Every process below `root` (not `root` itself), whatever its session."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def with_env(name: str, value: str) -> list[int]:
    """Every process we can read whose environment has name=value (not this
    one): a launcher's nodes and workers after the launcher is gone, whatever
    their session or parent now."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if wanted in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


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
