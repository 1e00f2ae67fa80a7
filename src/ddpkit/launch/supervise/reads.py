"""What a node's output holds, as its reader (launch/supervise/reader.py)
gives it out: lines for people (`LineRead`) and records (`RecordRead`), each
decoded once. A module of its own, below the reader, the findings and the
printer, so that none of them needs another to name what it is handed."""

from __future__ import annotations

from dataclasses import dataclass

from ... import records


@dataclass(frozen=True)
class LineRead:
    """A line of node `node`'s output for people, with its console prefix
    (`[node0 rank1] `; rank None: the node's own, its agent's)."""

    node: int
    rank: int | None
    prefix: str
    body: str


@dataclass(frozen=True)
class RecordRead:
    """A record node `node`'s output held: framed by the job (`time`: when it
    was written, None when not said), or a traceback the reader found in a
    rank's lines that no agent copied (`framed` False)."""

    node: int
    rank: int | None
    prefix: str
    record: records.Record
    time: float | None = None
    framed: bool = True
