"""The agent's own stderr in a Slurm job, with c10d's warning that it could
not look up a peer's name kept in the node's log (nodelog.py) instead.

Node 0's agent hosts the job's TCP store, and for each connection c10d looks
up the client's name (`getnameinfo` of its address, in its IPv4-mapped form
`::ffff:10.0.0.2` on a dual-stack socket). Where that lookup fails (no DNS
server reachable, EAI_AGAIN; /etc/hosts names only the plain IPv4 form), c10d
writes `[c10d] The hostname of the client socket cannot be retrieved. err=-3`
to the process's stderr from C++, once a process, and uses the address instead.
No torch setting hides that one line: the C++ log level (TORCH_CPP_LOG_LEVEL,
read once as torch is imported and inherited by the zygote's workers) would
hide every C++ warning of the agent and of the workers with it, and nothing
ddpkit runs can answer the name. A ddpkit launcher drops the line from a
node's output (launch/supervise/reader.NOISE); a Slurm job has none, so the
agent reads its own stderr through a pipe and moves that line alone.

Only the agent's own writes go through the pipe: it is put in place after
the zygote was forked, so the zygote and the workers forked from it write to
the job's stderr directly (a worker started as a new interpreter, where no
zygote forks, inherits the pipe, and its lines are copied as they are). The
copier is a thread of the agent; `close` puts the job's stderr back and copies
what is left before the agent exits."""

from __future__ import annotations

import os
import select
import sys
import threading
from collections.abc import Callable

NOISE = (b"The hostname of the client socket cannot be retrieved.",)
IDLE_S = 0.2  # a line still unfinished after this long is copied as it is (a prompt, a bar)
READ_BYTES = 1 << 16


class OwnStderr:
    """fd 2 of this process through a pipe that `copy` reads (see the module's doc)."""

    def __init__(self, keep: Callable[[str], object]) -> None:
        self._keep = keep
        self._original = -1
        self._read = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._original = os.dup(2)
        self._read, write = os.pipe()
        sys.stderr.flush()
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, name="ddpkit.agent stderr", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """The job's stderr back on fd 2; what the pipe still holds copied (once
        every writer closed it, or after `timeout_s`)."""
        if self._thread is None:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._original, 2)
        self._thread.join(timeout_s)
        self._thread = None

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

    def _line(self, line: bytes) -> None:
        if any(noise in line for noise in NOISE) and \
                self._keep(line.decode("utf-8", "replace")) is not None:
            return
        self._write(line)

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self._original, data):]
            except InterruptedError:
                continue
            except OSError:  # the job's stderr is gone: nothing to copy to, but the pipe is still read
                return


def start(keep: Callable[[str], object]) -> OwnStderr:
    """The agent's stderr through the copier (`keep`: the node log's writer; None from it: print the line)."""
    own = OwnStderr(keep)
    own.start()
    return own
