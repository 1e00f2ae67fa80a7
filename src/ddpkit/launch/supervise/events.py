"""What the supervisor's loop reads (`Event`s on one queue), what else may
post them (`EventSource`, `Reviver`), and an elastic run's rules
(`ElasticPolicy`). Nodes post `NodeExited`; anything else that may end a run
(a hang watchdog, say) is an `EventSource` that posts `StopRequested` with its
reason and exit code; the job's watchdog reporting a node silent posts
`NodeReportedLost`; a `Reviver` bringing a failed node of an elastic run back posts
`NodeReturned`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...shared.exitcodes import ExitCode

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
