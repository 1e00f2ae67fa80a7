"""Each node's output as it comes, read once into what it holds: lines for
people (`LineRead`) and the records the job and its agent send
(`RecordRead`, ddpkit.records, framed on their output), each frame decoded
here and nowhere else. The reader keeps nothing of the run; it knows only the shape of a
node's stream:

- torchrun's rank tag (`[rank1]:`) gives each line its rank and its console
  prefix (`[node0 rank1] `);
- a line its writers meant as several (a bar without its newline, then a
  frame or a tagged warning) is several (`glued_apart`);
- a record names the lines it stands for, which the node's log keeps and
  the console does not: an `agent_report`'s and a `traceback`'s lines by
  their content (`hides`: a key of each line), matched on the record's own
  stream (its node and rank) whatever other lines, nodes or records come
  between them, and a `cause`'s own line (shown once, at the run's end, by
  the supervisor); a record of a writer that named none (an older ddpkit's)
  hides the number of lines it says follow it;
- a rank's traceback that no agent copied (launch ssh, docker) is held until
  whole and given out as its `traceback` record (records/tracebacks.py); so
  is one whose lines come before its record: the record then finds its
  traceback already given out (by its exception, on its node and rank) and
  is not given out again, so the console shows the same whichever came first;
- torch's lines that say nothing a person can act on (`NOISE`) are dropped."""

from __future__ import annotations

from collections import Counter

from ... import records
from ...records.tracebacks import Tracebacks
from .reads import LineRead, RecordRead

# torch's lines that say nothing a person can act on, kept off the console (the node logs
# keep them): c10d's client looks up the name of the IPv4-mapped form of the address it
# connected to, which /etc/hosts does not answer, and warns when DNS cannot be reached
# (hosts named by /etc/hosts alone), once per process that connects.
NOISE = ("The hostname of the client socket cannot be retrieved.",)


Read = LineRead | RecordRead  # what one line of a node's output holds


def noisy(body: str) -> bool:
    return any(noise in body for noise in NOISE)


class OutputReader:
    """Every node's lines in, in the order they came; what each holds out
    (`read`, `close`). Not thread-safe: its caller (the LinePrinter) reads
    one line at a time."""

    def __init__(self) -> None:
        # (node, rank or None: its agent) -> the keys of lines a record stands for, still to come
        self._hidden: dict[tuple[int, int | None], Counter[str]] = {}
        # (node, rank or None) -> lines a record of a writer that named none said follow it, still to come
        self._following: dict[tuple[int, int | None], int] = {}
        # (node, rank) -> the exception lines of tracebacks given out from their lines before their record came
        self._found: dict[tuple[int, int], list[str]] = {}
        self._causes: dict[tuple[int, str], int] = {}  # (node, cause line) -> copies still to come
        self._tracebacks: dict[tuple[int, int], Tracebacks] = {}  # (node, rank): its traceback held till whole
        self._labels: dict[int, str] = {}  # node index -> its label, for what close() gives out

    def read(self, node: int, label: str, text: str, now: float) -> list[Read]:
        """What one line node `node` (its prefix's `label`) wrote holds; `now`: the clock's time."""
        self._labels[node] = label
        return [read for piece in glued_apart(text) for read in self._piece(node, label, piece, now)]

    def _piece(self, node: int, label: str, text: str, now: float) -> list[Read]:
        match = records.rank_tagged(text)
        rank = match[0] if match else None
        prefix = f"[{label} rank{rank}] " if match else f"[{label}] "
        body = match[1] if match else text
        stamped = _record(body)
        if stamped is not None:
            return self._announced(node, rank, prefix, stamped, now)
        if self._causes.get((node, body)):  # a cause line its record announced: shown once, at the end
            self._causes[(node, body)] -= 1
            return []
        if self._stood_for(node, rank, body):  # an agent's report, a traceback: the node's log has it
            return []
        if self._following.get((node, rank)):
            self._following[(node, rank)] -= 1
            return []
        if noisy(body):
            return []
        if rank is None:
            return [LineRead(node, rank, prefix, body)]
        # A rank's own lines that no agent copied (launch ssh, docker): its traceback, one line.
        tracebacks = self._tracebacks.get((node, rank))
        if tracebacks is None:  # (made once per rank, not per line)
            tracebacks = self._tracebacks[(node, rank)] = Tracebacks(at_exception=True)
        return self._given_out(node, rank, prefix, tracebacks.feed([body], now))

    def _announced(self, node: int, rank: int | None, prefix: str, stamped: records.Stamped,
                   now: float) -> list[Read]:
        """A record, and the lines it stands for on its stream (module doc)."""
        record = stamped.record
        read: list[Read] = [RecordRead(node, rank, prefix, record, stamped.time)]
        if isinstance(record, records.Traceback) and rank is not None:
            found = self._found.get((node, rank), [])
            if record.line in found:  # its lines came first: given out from them
                found.remove(record.line)
                return []
            if record.hides is None:
                self._following[(node, rank)] = record.lines
                return read
            self._hide(node, rank, record.hides)
            return self._held_lines_taken(node, rank, now) + read
        if isinstance(record, records.AgentReport):
            if record.hides is None:
                self._following[(node, None)] = record.lines
            else:
                self._hide(node, None, record.hides)
        elif isinstance(record, records.Cause):
            self._causes[(node, record.line)] = self._causes.get((node, record.line), 0) + 1
        return read

    def _hide(self, node: int, rank: int | None, keys: tuple[str, ...]) -> None:
        self._hidden.setdefault((node, rank), Counter()).update(keys)

    def _stood_for(self, node: int, rank: int | None, body: str) -> bool:
        """Whether `body` is a line a record of its stream stands for (and is now taken off its list)."""
        keys = self._hidden.get((node, rank))
        if not keys:
            return False
        key = records.line_key(body)
        if not keys[key]:
            return False
        keys[key] -= 1
        if not keys[key]:
            del keys[key]
        return True

    def _held_lines_taken(self, node: int, rank: int, now: float) -> list[Read]:
        """A traceback's record that came after some of its lines: the ones held are its; any other is let go."""
        tracebacks = self._tracebacks.get((node, rank))
        if tracebacks is None:
            return []
        rest = [line for line in tracebacks.take_held() if not self._stood_for(node, rank, line)]
        return self._given_out(node, rank, self._prefix(node, rank), tracebacks.feed(rest, now)) if rest else []

    def _prefix(self, node: int, rank: int) -> str:
        return f"[{self._labels.get(node, f'node{node}')} rank{rank}] "

    def _given_out(self, node: int, rank: int, prefix: str,
                   released: list[tuple[records.Record | None, list[str]]]) -> list[Read]:
        out: list[Read] = []
        for record, lines in released:
            if isinstance(record, records.Traceback):
                self._found.setdefault((node, rank), []).append(record.line)  # its own record may follow
                out.append(RecordRead(node, rank, prefix, record, framed=False))
            else:
                out += [LineRead(node, rank, prefix, line) for line in lines]
        return out

    def close(self) -> list[Read]:
        """Every held traceback (one never finished: its lines as they came)."""
        out: list[Read] = []
        for (node, rank), tracebacks in self._tracebacks.items():
            out += self._given_out(node, rank, self._prefix(node, rank), tracebacks.close())
        self._tracebacks.clear()
        return out

    def forget(self, node: int) -> None:
        """A node that comes back (elastic): no lines of its last run still to come."""
        self._following = {key: n for key, n in self._following.items() if key[0] != node}
        self._hidden = {key: keys for key, keys in self._hidden.items() if key[0] != node}
        self._found = {key: found for key, found in self._found.items() if key[0] != node}


def _record(body: str) -> records.Stamped | None:
    """The record of a framed line; None for any other line, and for a record
    this launcher cannot read (shown as it came)."""
    try:
        return records.unframe(body)
    except records.RecordError:
        return None


def glued_apart(text: str) -> list[str]:
    """One read line as the lines its writers meant. Where a worker's output
    shares the agent's stream (launch ssh, docker), an unfinished line (a bar
    without its newline, a process killed mid-line) gets the next writer's
    line glued to it: a record's frame, torch's rank-tagged warning. Each
    starts a line of its own."""
    if "\r" not in text and text.find(records.RANK_TAG_OPEN, 1) < 0 and text.find(records.FRAME, 1) < 0:
        return [text]  # nothing glued, nothing redrawn: nearly every line, at the cost of three scans
    pieces: list[str] = []
    for part in _split_before(text, records.FRAME):
        tag = records.rank_tagged(part)
        if records.is_frame(tag[1] if tag else part):
            pieces.append(part)
            continue
        drawn = f"{records.RANK_TAG_OPEN}{tag[0]}{records.RANK_TAG_CLOSE}{as_drawn(tag[1])}" if tag else as_drawn(part)
        starts = [0, *records.tag_starts(drawn)]
        pieces += [drawn[a:b] for a, b in zip(starts, [*starts[1:], len(drawn)])]
    return [piece for index, piece in enumerate(pieces) if piece or index == 0]


def _split_before(text: str, marker: str) -> list[str]:
    """`text` cut before each `marker` after its start, except after a bare
    rank tag (torchrun's `[rank0]:` before a record is the record's own)."""
    parts, start = [], 0
    at = text.find(marker, 1)
    while at > 0:
        if not records.is_bare_tag(text[start:at]):
            parts.append(text[start:at])
            start = at
        at = text.find(marker, at + 1)
    return [*parts, text[start:]]


def as_drawn(line: str) -> str:
    """A line redrawn with carriage returns (a progress bar whose output no
    agent copied line by line: launch ssh, docker) as a terminal shows it:
    its last state, not one line per redraw."""
    if "\r" not in line:
        return line
    states = [state for state in line.split("\r") if state.strip()]
    return states[-1] if states else ""
