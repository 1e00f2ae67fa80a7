"""A Python traceback in a worker's output, held until it is whole and given
out as one `traceback` record (records.Traceback: its exception line, and how
many lines it had) ahead of its lines: a console shows the exception once,
a node's log keeps every line. Used by the agent, which copies each worker's
output line by line (agent/tailing.py), and by a launcher's reader (launch/supervise/reader.py) for the
workers' lines no agent copied (launch ssh, docker: torch's traceback hook
tags each line with the rank, after a space).

A traceback starts at `Traceback (most recent call last):` at some indent
(the hook's space), has frames (`File "..."`) indented deeper, and ends at
the first line back at its own indent after its last frame: the exception,
with torch's C++ continuation (`At:` and its frames). Chained tracebacks
(`During handling of the above exception ...`) are one.

The record also says where the exception was raised (the innermost frame of
the program's own code, not a library's) and whether it is a collective's
lost peer (gloo's `Connection closed by peer`, NCCL's `remote process
exited`): on a rank whose peer failed first, that is a knock-on, not a
failure of its own, and a launcher says so instead of showing a second
exception.
"""

from __future__ import annotations

import re

from .base import Record
from .job import Traceback, keys_of

TRACEBACK = "Traceback (most recent call last):"
FRAME = 'File "'
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
HOLD_S = 2.0  # a traceback not whole after this goes out as it is
HOLD_LINES = 400
SHOWN_CHARS = 400
WHERE = "  (its traceback: the node's log)"  # after the exception, in a record's line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def exception_at(lines: list[str]) -> int | None:
    """Where the exception a held traceback ends with is (see the module's
    doc); None while there is none yet."""
    if not lines:
        return None
    base = _indent(lines[0])
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith(FRAME) and _indent(line) > base]
    if not frames:
        return None
    for index in range(frames[-1] + 1, len(lines)):
        line = lines[index]
        if line.strip() and _indent(line) == base and not line.lstrip().startswith(CHAINED):
            return index
    return None


def continues(line: str, base: int) -> bool:
    """Whether `line` still belongs to the exception above it: torch's C++
    errors add a blank line and `At:` with their own frames, indented."""
    return not line.strip() or line.strip() == "At:" or _indent(line) > base


def block_end(lines: list[str], at: int) -> int:
    """The last line of the exception at lines[at], its continuation included."""
    base, end = _indent(lines[0]), at
    while end + 1 < len(lines) and continues(lines[end + 1], base):
        end += 1
    return end


def exception_line(lines: list[str]) -> str | None:
    at = exception_at(lines)
    return None if at is None else lines[at].strip()


def record_of(lines: list[str], at: int) -> Record:
    """The record for a traceback whose exception is lines[at]."""
    exception = lines[at].strip()
    shown = exception if len(exception) <= SHOWN_CHARS else exception[:SHOWN_CHARS] + "..."
    end = block_end(lines, at) + 1
    return Traceback(lines=end, line=shown + WHERE, at=raised_at(lines[:at]),
                     knock_on=is_knock_on(exception) or None, hides=keys_of(lines[:end]))


# A frame line: `  File "/job/train.py", line 42, in training_step`.
FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
# Where a frame is a library's or Python's own, not the program's.
LIBRARY = ("site-packages/", "dist-packages/", "<frozen ", "/lib/python3.")


def raised_at(lines: list[str]) -> str | None:
    """Where the last exception of a traceback (its lines before the exception
    line) was raised, as `file:line in function`: the innermost frame of the
    program's own code, else the innermost frame; None without frames."""
    last = max((i for i, line in enumerate(lines) if line.lstrip().startswith(CHAINED)), default=-1)
    frames = [m for line in lines[last + 1:] if (m := FRAME_LINE.match(line))]
    if not frames:
        return None
    own = [m for m in frames if not any(part in m["file"] for part in LIBRARY)]
    frame = (own or frames)[-1]
    return f"{frame['file']}:{frame['line']} in {frame['func']}"


# A collective's lost peer: a backend's words (gloo's, NCCL's, c10d's store) with a peer gone.
BACKENDS = ("gloo", "nccl", "distbackenderror", "distnetworkerror", "c10d", "processgroup", "tcpstore")
PEER_GONE = ("connection closed by peer", "connection reset by peer", "closed by remote peer", "broken pipe",
             "remote process exited", "remote worker crashing", "communicator was aborted", "ncclremoteerror",
             "failed to recv, got 0 bytes")


def is_knock_on(exception: str) -> bool:
    """Whether an exception line says a collective lost its peer: on a rank
    whose peer failed, the knock-on of that failure."""
    text = exception.lower()
    return any(b in text for b in BACKENDS) and any(p in text for p in PEER_GONE)


def knock_on_text(record: Traceback) -> str:
    """A knock-on exception, short: its type and the sentence that names the
    lost peer (gloo adds advice and an emoji), without the record's WHERE."""
    exception = record.line.removesuffix(WHERE)
    kind, _, message = exception.partition(": ")
    lowered = message.lower()
    at = min((i for p in PEER_GONE if (i := lowered.find(p)) >= 0), default=0)
    end = message.find(". ", at)
    return f"{kind}: {(message if end < 0 else message[:end]).rstrip('.')}"


class Tracebacks:
    """Whole lines in, (record or None, lines) out: lines that are no
    traceback come out at once with no record; a traceback comes out with
    its record once whole. Whole: at a pause in the output (`idle`, for
    output written at once, as torch's hook does), or as soon as its
    exception line comes (`at_exception`, for lines that arrive one by one).
    A traceback not whole after HOLD_S, or longer than HOLD_LINES, comes
    out as it is."""

    def __init__(self, at_exception: bool = False) -> None:
        self.at_exception = at_exception
        self._held: list[str] = []
        self._since = 0.0
        self._continuing: int | None = None  # at_exception: the indent of the exception just given out

    def feed(self, lines: list[str], now: float) -> list[tuple[Record | None, list[str]]]:
        out: list[tuple[Record | None, list[str]]] = []
        for line in lines:
            if self._continuing is not None and continues(line, self._continuing):
                continue  # its exception's continuation: with the traceback, in the node's log
            self._continuing = None
            if self._held:
                self._held.append(line)
                if len(self._held) >= HOLD_LINES:
                    out.append(self._release(whole=False))
                elif self.at_exception and exception_at(self._held) is not None:
                    self._continuing = _indent(self._held[0])
                    out.append(self._release(whole=True))
            elif line.strip() == TRACEBACK:
                self._held, self._since = [line], now
            else:
                out.append((None, [line]))
        return out

    def take_held(self) -> list[str]:
        """The lines of a traceback held so far, no longer held (its record came: they are its)."""
        held, self._held = self._held, []
        return held

    def idle(self, now: float) -> list[tuple[Record | None, list[str]]]:
        """At a pause in the output: a held traceback that ends with its exception is whole."""
        if self._held and exception_at(self._held) is not None:
            return [self._release(whole=True)]
        return [self._release(whole=False)] if self._held and now - self._since > HOLD_S else []

    def close(self) -> list[tuple[Record | None, list[str]]]:
        return [self._release(whole=exception_at(self._held) is not None)] if self._held else []

    def _release(self, whole: bool) -> tuple[Record | None, list[str]]:
        held, self._held = self._held, []
        end = exception_at(held)
        return (record_of(held, end), held) if whole and end is not None else (None, held)
