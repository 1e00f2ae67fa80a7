"""Each node's one state in a supervised run, and the moves between states
the supervisor may make (`TRANSITIONS`); any other move raises.

A node is NOT_STARTED until the supervisor starts it, then RUNNING. The
job's watchdog may report it silent: STOPPING_LOST while the supervisor stops
what is left of it. Its exit makes it FINISHED (0) or, non-zero, FAILED
(the run did not go on without it), AWAY (an elastic job went on without it
while its host is revived: it comes back RUNNING, as a new handle) or
EXCLUDED (an elastic job went on without it for good). When the supervisor
stops every node, one still running ends STOPPED, and one whose exit the loop
had not read yet FINISHED or FAILED by its code: after a run, no node is live.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .nodeoutput import NodeHandle


class NodeState(Enum):
    NOT_STARTED = "not started"
    RUNNING = "running"
    STOPPING_LOST = "stopping lost"  # the job's watchdog found it silent: being stopped
    FINISHED = "finished"  # exited 0
    FAILED = "failed"  # exited non-zero, and the run did not go on without it
    AWAY = "away"  # elastic: failed, the job goes on without it while its host is revived
    EXCLUDED = "excluded"  # elastic: failed, the job went on without it to the end
    STOPPED = "stopped"  # still running when the supervisor stopped every node

    @property
    def live(self) -> bool:
        """Started, and its exit not yet read by the supervisor."""
        return self in (NodeState.RUNNING, NodeState.STOPPING_LOST)


_S = NodeState
# Every move the supervisor makes, and why.
TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _S.NOT_STARTED: frozenset({_S.RUNNING}),  # started
    _S.RUNNING: frozenset({_S.STOPPING_LOST,  # reported silent by the job's watchdog
                           _S.FINISHED, _S.FAILED, _S.AWAY, _S.EXCLUDED,  # its exit, by the policy
                           _S.STOPPED}),  # still running when every node was stopped
    _S.STOPPING_LOST: frozenset({_S.FINISHED, _S.FAILED, _S.AWAY, _S.EXCLUDED, _S.STOPPED}),
    _S.AWAY: frozenset({_S.RUNNING,  # its host answered again: a new handle joins the job
                        _S.EXCLUDED}),  # the run ended before its host answered
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
    _S.EXCLUDED: frozenset(),
    _S.STOPPED: frozenset(),
}

_TICKS = itertools.count()  # orders moves: the closing line names excluded nodes in the order they left


class NodeTransitionError(RuntimeError):
    """A move TRANSITIONS does not allow: a bug in the supervisor."""


@dataclass(eq=False)
class NodeTrack:
    """One node of a run: its current handle (a revived node's is new), its
    state, and what the summary says of its past."""

    node: NodeHandle
    state: NodeState = NodeState.NOT_STARTED
    rejoined_after: list[str] = field(default_factory=list)  # why it failed, each time it came back
    # Its own exit status reached the supervisor before anything stopped it:
    # that status is how it failed, even if the job's watchdog reports it
    # silent afterwards (a killed node's ranks stop their heartbeats too). A
    # dropped connection (NO_EXIT_STATUS) is no status: the watchdog's report says more.
    own_exit: bool = False
    moved: int = field(default_factory=lambda: next(_TICKS))

    @property
    def index(self) -> int:
        return self.node.index

    @property
    def failures(self) -> int:
        """How often an elastic job went on without it: each return, and its present absence."""
        return len(self.rejoined_after) + (self.state in (NodeState.AWAY, NodeState.EXCLUDED))

    def move(self, to: NodeState) -> None:
        """To state `to`; NodeTransitionError if TRANSITIONS has no such move."""
        if to not in TRANSITIONS[self.state]:
            raise NodeTransitionError(f"node {self.index}: no move from {self.state.value} to {to.value}")
        self.state, self.moved = to, next(_TICKS)

    def rejoin(self, new: NodeHandle, why: str) -> None:
        """AWAY -> RUNNING as `new`, a fresh handle whose exit has not been seen."""
        self.move(NodeState.RUNNING)
        self.node, self.own_exit = new, False
        self.rejoined_after.append(why)
