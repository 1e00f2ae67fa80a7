"""The agent's copy of each worker's output, line by line, with its rank tag.

torchrun tees each worker's output into a file and a thread per file
(torch's `tail_logfile`) copies it to the agent's own output, each line
behind the rank tag. torch reads the file in text mode and writes whatever
`readline` returns: a progress bar (tqdm, rich) that redraws itself with a
carriage return becomes one line per redraw, and a redraw read before its
end gets the tag of the next one glued to it. torch's own messages carry a
rank tag of their own (`[rank1]:[W1127 ...]`, every line of the traceback
`init_process_group`'s hook prints), so they got the tag twice.

`install` puts `tail_logfile` here in place of torch's: it copies whole
lines only; a line redrawn with carriage returns is copied as a terminal
would show it (its last state); a bar that keeps redrawing without ending
its line is copied at most once every PROGRESS_EVERY_S; a rank tag the
worker's own line starts with is not repeated; and a traceback is copied
behind a `traceback` record (ddpkit.records), so that a launcher shows its
one exception line (records/tracebacks.py). The files keep every byte.
"""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Callable
from threading import Event
from typing import TextIO

from .. import records
from ..records.base import Record
from ..records.tracebacks import Tracebacks

PROGRESS_EVERY_S = 10.0  # a redrawn line still going is shown this often
READ_BYTES = 1 << 16


class RedrawnLines:
    """Text in, whole lines out: a line ends at a newline, and a carriage
    return starts the line's next state. `feed` returns the lines to copy now;
    `due` the state of a line still being redrawn when PROGRESS_EVERY_S has
    passed since one was last copied; `close` what is left."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S) -> None:
        self.every_s = every_s
        self._line = ""  # the current line's text since its last carriage return
        self._drawn = ""  # its last state before a carriage return
        self._redrawing = False  # the current line had a carriage return: a bar, not a line being written
        self._copied = ""  # the state last copied, and when
        self._copied_at = float("-inf")

    def feed(self, text: str, now: float) -> list[str]:
        out: list[str] = []
        if self._redrawing and self._line and text[:1] not in ("\r", "\n"):
            # A bar writes each state after its carriage return in one write: text that
            # goes on from its state is another writer's (a warning), on a line of its own.
            out.extend([self._line] if self._line != self._copied else [])
            self._line = self._drawn = self._copied = ""
            self._redrawing, self._copied_at = False, float("-inf")
        for piece, end in _pieces(text):
            self._line += piece
            if end == "\n":
                out.append(self._line or self._drawn)
                self._line = self._drawn = self._copied = ""
                self._redrawing, self._copied_at = False, float("-inf")
            elif end == "\r":
                self._drawn = self._line or self._drawn
                self._line, self._redrawing = "", True
        out.extend(self.due(now))
        return out

    def due(self, now: float) -> list[str]:
        state = self._line or self._drawn
        if not self._redrawing or not state or state == self._copied or now - self._copied_at < self.every_s:
            return []
        self._copied, self._copied_at = state, now
        return [state]

    def close(self) -> list[str]:
        last = self._line or self._drawn
        self._line = self._drawn = ""
        self._redrawing = False
        return [last] if last and last != self._copied else []


def _pieces(text: str) -> list[tuple[str, str]]:
    """`text` cut after each newline and carriage return: (piece, the end it
    had: "\\n", "\\r", or "" for the unfinished rest). CR LF ends a line as LF does."""
    pieces: list[tuple[str, str]] = []
    start = 0
    for index, char in enumerate(text):
        if char in "\r\n":
            crlf = char == "\r" and text[index + 1:index + 2] == "\n"
            pieces.append((text[start:index], "" if crlf else char))
            start = index + 1
    pieces.append((text[start:], ""))
    return pieces


def untagged(header: str, line: str) -> list[str]:
    """`line` without the rank tag torch's own messages carry (`header` is
    torchrun's, e.g. `[rank1]:`; the traceback hook adds a space after it).
    A tag inside the line starts another writer's message (torch's warning
    written after an unfinished bar): a line of its own."""
    if not header or header not in line:
        return [line]
    first, *others = line.split(header)
    return ([first] if first else []) + [other[1:] if other.startswith(" ") else other for other in others]


def tail_logfile(header: str, file: str, dst: TextIO, finished: Event, interval_sec: float,
                 log_line_filter: Callable[[str], bool] | None = None) -> None:
    """torch's `tail_logfile`, copying whole lines (see the module's doc)."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    lines, tracebacks = RedrawnLines(), Tracebacks()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def copy(out: list[tuple[Record | None, list[str]]]) -> None:
        for record, text in out:
            framed = records.send(record) if record else None  # ahead of its traceback, where a launcher reads both
            for line in ([framed] if framed else []) + text:
                if log_line_filter is None or log_line_filter(line + "\n"):
                    dst.write(f"{header}{line}\n")

    def take(out: list[str]) -> None:
        copy(tracebacks.feed([part for line in out for part in untagged(header, line)], time.monotonic()))

    with open(file, "rb") as stream:
        while True:
            chunk = stream.read(READ_BYTES)
            if chunk:
                take(lines.feed(decoder.decode(chunk), time.monotonic()))
                continue
            if finished.is_set():
                break
            take(lines.due(time.monotonic()))
            copy(tracebacks.idle(time.monotonic()))
            time.sleep(interval_sec)
        take(lines.feed(decoder.decode(b"", final=True), time.monotonic()))
        take(lines.close())
        copy(tracebacks.close())


def install() -> None:
    """torch's TailLog calls the module's `tail_logfile` by name when it starts."""
    from torch.distributed.elastic.multiprocessing import tail_log

    tail_log.tail_logfile = tail_logfile
