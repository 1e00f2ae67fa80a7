"""A JSON Lines file a process appends records to, opened once and kept
open (`Appender`): a job's watchdog, its progress and the launcher's metrics
sink each write a record a second or more, and opening the file for each one
cost more than the record itself.

What keeping it open must not lose:

- a crash: each record is one unbuffered `write` with O_APPEND, so a record
  sent is in the file (the kernel's page cache) when `write` returns, and a
  killed process loses nothing it sent; O_APPEND also keeps the lines of the
  several processes of one host whole, as the file opened per record did;
- a fork: a child (a forkserver's agents, multiprocessing's workers) closes
  its inherited copy at once (`os.register_at_fork`) and opens its own on
  its first record, so that it never writes through, or later closes, a
  descriptor number that its parent's file no longer owns; a child that
  execs (torchrun's workers) does not inherit it at all (O_CLOEXEC);
- a requeue, a removed or renamed file: a Slurm job requeued runs in new
  processes, which open the file anew; a process that lives on while its
  file is removed (the folder cleaned, the run deleted) or replaced finds
  it by the file's link count or inode at its next record and opens the
  path again, so records go to the file people read, not to an unlinked one;
- another path: `send` asks for its node's file each time (the channel's
  folder can change within a process, as tests do); a new path closes the
  old descriptor and opens the new one."""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


_OPEN: weakref.WeakSet[Appender] = weakref.WeakSet()  # every Appender of this process, for a forked child


class Appender:
    """Appends whole lines to the file at one path at a time; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._fd = -1
        self._inode = (0, 0)
        _OPEN.add(self)

    def __del__(self) -> None:
        self.close()

    def write(self, path: Path, line: str) -> None:
        """`line` (with its newline) appended to `path` (made with its folder) in one write;
        OSError when it cannot be."""
        data = line.encode("utf-8")
        with self._lock:
            fd = self._open(path)
            while data:  # one write for a line of any size a regular file takes; the rest if cut short
                data = data[os.write(fd, data):]

    def _open(self, path: Path) -> int:
        if self._fd >= 0 and self._path == path and self._same_file(path):
            return self._fd
        self.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, FLAGS, 0o666)
        stat = os.fstat(fd)
        self._path, self._fd, self._inode = path, fd, (stat.st_dev, stat.st_ino)
        return fd

    def _same_file(self, path: Path) -> bool:
        """The path still names the file the descriptor writes (not removed, not replaced)."""
        try:
            stat = os.stat(path)
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == self._inode

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._path = -1, None

    def _forked(self) -> None:
        """In a forked child: its inherited copy closed, a lock no other thread holds."""
        self._lock = threading.Lock()
        self.close()


def _after_fork_in_child() -> None:
    for appender in list(_OPEN):
        appender._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
