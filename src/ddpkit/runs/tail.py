"""A log file followed as it grows: each read returns the lines completed
since the last one, and a line still being written waits in a buffer until
its newline comes (or the run has ended: `rest`). Bytes are buffered, not
text, so a character cut between two writes is decoded whole. `ddpkit logs
--follow` and `submit slurm --follow` read their files with it; a stream
that is not a file (a container's log stream) can use its `LineBuffer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LineBuffer:
    """Bytes in, complete lines out (without their newlines)."""

    partial: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]

    def flush(self) -> list[str]:
        """The last line without its newline, once nothing more will come."""
        last, self.partial = self.partial, b""
        return [last.decode("utf-8", "replace")] if last else []


@dataclass
class Tail:
    """One file, read from where the last read stopped."""

    path: Path
    offset: int = 0
    buffer: LineBuffer = field(default_factory=LineBuffer)

    def read(self) -> list[str]:
        """The complete lines written since the last read; none while the
        file does not exist yet."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        return self.buffer.feed(chunk)

    def rest(self) -> list[str]:
        """The last line without its newline, once nothing more will come."""
        return self.buffer.flush()
