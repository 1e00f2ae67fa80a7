"""The stderr of a Slurm node's agent and of the workers it starts, with
c10d's warning that it could not look up a peer's name kept in the node's log
(nodelog.py) instead.

Each process that connects to the job's TCP store (every agent, every
worker) looks up the store's name, and node 0's agent, which hosts it, each
client's: `getnameinfo` of the address in its IPv4-mapped form
(`::ffff:10.0.0.2`). Where that lookup fails (no DNS server reachable,
EAI_AGAIN; /etc/hosts names only the plain IPv4 form), c10d writes `[c10d]
The hostname of the client socket cannot be retrieved. err=-3` to the
process's stderr from C++, once a process: a line per agent and per worker
in a Slurm output file (seen on the test cluster with its hosts files'
mapped names taken away). No torch setting hides that line alone: the C++
log level (TORCH_CPP_LOG_LEVEL, read once as torch is imported, inherited by
the zygote's workers) would hide every C++ warning of the agent and the
workers, NCCL's and c10d's own among them, and nothing ddpkit runs can answer
the name. A ddpkit launcher drops the line from a node's output
(launch/supervise/reader.NOISE); a Slurm job has none, so the agent puts a
pipe on stderr before it forks the zygote, which the zygote and its workers
inherit, and a thread of the agent copies what comes through it, line by
line, to the job's stderr, that one line to the node's log instead.

What stays: a worker's stderr passes through its agent (its stdout does
not), so a worker's stderr line and its stdout lines may come out a moment
apart; a line left unfinished is copied after IDLE_S. Forked workers end with
the zygote and the zygote with the agent, so nothing writes into the pipe
once the agent is gone; `close` puts the job's stderr back on the agent's fd 2
and copies what is left before it exits."""

from __future__ import annotations

import os
import select
import sys
import threading
from collections.abc import Callable

NOISE = (b"The hostname of the client socket cannot be retrieved.",)
IDLE_S = 0.2  # a line still unfinished after this long is copied as it is (a prompt, a bar)
READ_BYTES = 1 << 16


class NodeStderr:
    """fd 2 of this process, and of the processes it starts, through a pipe
    that a thread of this process copies (see the module's doc)."""

    def __init__(self, keep: Callable[[str], object]) -> None:
        self._keep = keep
        self._original = -1
        self._copy_to = -1  # the thread's own copy of the job's stderr: `close` may run while it copies
        self._read = -1
        self._thread: threading.Thread | None = None

    def redirect(self) -> None:
        """The pipe on fd 2; no thread yet (the zygote is forked from a process without one)."""
        self._original = os.dup(2)
        self._copy_to = os.dup(2)
        self._read, write = os.pipe()
        sys.stderr.flush()
        os.dup2(write, 2)
        os.close(write)

    def copy(self) -> None:
        """Start copying (once the zygote was forked)."""
        self._thread = threading.Thread(target=self._copy, name="ddpkit.agent stderr", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """The job's stderr back on fd 2; what the pipe still holds copied (once
        every writer closed it, or after `timeout_s`)."""
        if self._original < 0:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._original, 2)
        os.close(self._original)
        if self._thread is None:  # never copied: what the pipe holds is dropped with it
            os.close(self._read)
            os.close(self._copy_to)
        else:
            self._thread.join(timeout_s)
            self._thread = None
        self._original = -1

    def _copy(self) -> None:
        held = b""
        while True:
            ready, _, _ = select.select([self._read], [], [], IDLE_S if held else None)
            if not ready:  # a line left unfinished: copied as it is
                self._write(held)
                held = b""
                continue
            chunk = os.read(self._read, READ_BYTES)
            if not chunk:
                break
            *lines, held = (held + chunk).split(b"\n")
            for line in lines:
                self._line(line + b"\n")
        if held:
            self._line(held)
        os.close(self._read)
        os.close(self._copy_to)

    def _line(self, line: bytes) -> None:
        if any(noise in line for noise in NOISE) and \
                self._keep(line.decode("utf-8", "replace")) is not None:
            return
        self._write(line)

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self._copy_to, data):]
            except InterruptedError:
                continue
            except OSError:  # the job's stderr is gone: nothing to copy to, but the pipe is still read
                return


def redirect(keep: Callable[[str], object]) -> NodeStderr:
    """fd 2 through the pipe (`keep`: the node log's writer; None from it: the line is printed); `copy()` next."""
    node = NodeStderr(keep)
    node.redirect()
    return node
