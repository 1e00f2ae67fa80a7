"""What the supervisor's loop reads (`Event`s on one queue), what else may
post them (`EventSource`, `Reviver`), and an elastic run's rules
(`ElasticPolicy`). Nodes post `NodeExited`; anything else that may end a run
(a hang watchdog, say) is an `EventSource` that posts `StopRequested` with its
reason and exit code; the job's watchdog reporting a node silent posts
`NodeReportedLost`; a `Reviver` bringing a failed node of an elastic run back posts
`NodeReturned`. What a node's output holds, as its reader
(launch/supervise/reader.py) gives it out: lines for people (`LineRead`) and
records (`RecordRead`), each decoded once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ... import records
from ...exitcodes import ExitCode

if TYPE_CHECKING:
    from ...spec import Elastic
    from .nodeoutput import NodeHandle


@dataclass(frozen=True)
class NodeExited:
    node: NodeHandle


@dataclass(frozen=True)
class StopRequested:
    """Posted by an event source: stop every node, end with `code`."""

    reason: str
    code: ExitCode


@dataclass(frozen=True)
class NodeReturned:
    """Posted for a Reviver: a failed node's host answers again; `node` is
    a new handle for the same node index, not started yet."""

    node: NodeHandle


@dataclass(frozen=True)
class NodeReportedLost:
    """The job's watchdog reported node `index` silent (launch/supervise/recovery.py):
    stop what is left of it and treat it as a node that failed."""

    index: int


Event = NodeExited | StopRequested | NodeReturned | NodeReportedLost
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


class EventSource(Protocol):
    """Something besides the nodes that may end a run (e.g. a hang watchdog)."""

    def start(self, post: Callable[[Event], None]) -> None: ...

    def stop(self) -> None: ...


class Reviver(Protocol):
    """Brings a failed node of an elastic run back (launch ssh, launch local)."""

    def revive(self, node: NodeHandle, cancelled: threading.Event) -> NodeHandle | None:
        """Blocking, on its own thread: clear what `node` left on its host,
        then wait until the host answers again. A new handle for the same
        node, not started; None once `cancelled` is set."""


@dataclass(frozen=True)
class ElasticPolicy:
    """An elastic run's rules (spec.elastic): the job goes on without a failed
    node while min_nodes others remain, and `reviver` brings it back until it
    failed max_node_failures times."""

    min_nodes: int
    max_node_failures: int
    reviver: Reviver
    # The launcher hosts the rendezvous store (rdzv_store.py): node 0 may go as any
    # other; else node 0's agent holds it, and its loss ends the run.
    any_node: bool = False

    @classmethod
    def of(cls, elastic: Elastic | None, reviver: Reviver, any_node: bool = False) -> ElasticPolicy | None:
        """None for a static job: its first failed node stops the run."""
        return None if elastic is None else cls(elastic.min_nodes, elastic.max_node_failures, reviver, any_node)
