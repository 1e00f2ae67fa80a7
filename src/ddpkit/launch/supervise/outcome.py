"""How a supervised run ended (`Outcome`): each node's track (its final
state, launch/supervise/nodestate.py), what ended the run, and what the
supervisor read from the job's output; the run's exit code follows from it."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...shared.exitcodes import WORKER_CODES, ExitCode
from .nodestate import NodeState, NodeTrack

if TYPE_CHECKING:
    from ...records import LostRank, StalledRank, Stop, Straggler
    from .events import StopRequested
    from .nodeoutput import NodeHandle


@dataclass
class Outcome:
    """How a run ended."""

    nodes: list[NodeTrack] = field(default_factory=list)  # one per node, by index
    first_failure: NodeHandle | None = None
    stop_request: StopRequested | None = None
    interrupted: bool = False
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    stalled: list[StalledRank] = field(default_factory=list)  # named by the job's hang watchdog
    stragglers: list[Straggler] = field(default_factory=list)  # named by its straggler judge
    worker_codes: dict[int, int] = field(default_factory=dict)  # node index -> its failed worker's code
    lost: list[LostRank] = field(default_factory=list)  # ranks the job's watchdog found silent (launch/supervise/recovery.py)
    stopped_at: Stop | None = None  # the job's stop record: where it checkpointed on the stop signal, if it did
    knocked_on: set[int] = field(default_factory=set)  # nodes whose workers only lost their peer (blame_own_error)

    def track(self, node: NodeHandle) -> NodeTrack:
        return next(t for t in self.nodes if t.index == node.index)

    @property
    def excluded(self) -> list[NodeHandle]:
        """Elastic: the failed nodes the job went on without, in the order they left."""
        gone = sorted((t for t in self.nodes if t.state is NodeState.EXCLUDED), key=lambda t: t.moved)
        return [t.node for t in gone]

    @property
    def rejoined(self) -> dict[int, list[str]]:
        """Elastic: node index -> why it failed, each time it came back."""
        return {t.index: t.rejoined_after for t in self.nodes if t.rejoined_after}

    def node_code(self, node: NodeHandle) -> int | None:
        """`node_code`; for a node the launcher stopped after its own worker had
        failed (the run's first failure, read late), that worker's code."""
        worker = self.worker_codes.get(node.index)
        code = node_code(node, worker)
        stopped = self.track(node).state is NodeState.STOPPED and code in STOPPED_CODES
        return worker if stopped and worker is not None and worker > 0 else code

    def blame_earliest(self, failed_at: dict[int, float]) -> None:
        """The node whose worker failed first, by the times its agent wrote
        (`failed_at`: node index -> seconds), failed first, whichever node's
        exit reached the launcher first: a worker's failure brings its peers'
        down within moments, and their agents may end sooner than its own."""
        if self.first_failure is None or self.first_failure.index not in failed_at:
            return  # the node read first had no worker fail (killed from outside, lost): it is the first
        if self.node_code(self.first_failure) == ExitCode.SAME_ERROR:
            return  # its agent saw the same error twice: the cause, whoever failed earlier in the start before
        failed = [t for t in self.nodes if t.index in failed_at and t.node.exit_code() != 0]
        if failed:
            self.first_failure = min(failed, key=lambda t: failed_at[t.index]).node

    def blame_own_error(self, own: set[int], knocked_on: set[int]) -> None:
        """A first failure whose workers only lost their peer in a collective
        (a knock-on: gloo's `Connection closed by peer`) did not fail first:
        the node whose worker raised an error of its own did, whichever exit
        or clock came first (`own`, `knocked_on`: node indexes)."""
        self.knocked_on = knocked_on
        first = self.first_failure
        if first is None or first.index not in knocked_on:
            return
        self.first_failure = next((t.node for t in self.nodes if t.index in own), first)

    def blame_lost(self) -> None:
        """A static job stopped for a lost node: that node failed first,
        whichever exit (a survivor's NODE_LOST) reached the loop first."""
        lost = {x.node for x in self.lost}
        if self.first_failure is not None and self.first_failure.index not in lost:
            self.first_failure = next((t.node for t in self.nodes if t.index in lost), self.first_failure)

    @property
    def code(self) -> int:
        if self.interrupted:
            return ExitCode.INTERRUPTED
        if self.stalled:
            return ExitCode.STALLED
        if self.stop_request is not None:
            return self.stop_request.code
        if self.first_failure is not None and any(x.node == self.first_failure.index for x in self.lost):
            return ExitCode.NODE_LOST
        if self.first_failure is not None:
            code = self.node_code(self.first_failure)
            return code if code is not None and code > 0 else ExitCode.FAILED
        return ExitCode.OK


# A node's code when the launcher stopped it (SIGTERM, then SIGKILL after the grace): a shell's 128 + the
# signal, or the signal's bare number where `setsid -w` ran the node (launch ssh: it exits with the raw
# wait status of a child that a signal ended).
STOPPED_CODES = (128 + signal.SIGTERM, 128 + signal.SIGKILL, int(signal.SIGTERM), int(signal.SIGKILL))


def node_code(node: NodeHandle, worker: int | None) -> int | None:
    """The node's exit code; for a torchrun agent's 1, its failed worker's
    own code when that is one of ddpkit's (exitcodes.WORKER_CODES)."""
    code = node.exit_code()
    return worker if code == ExitCode.FAILED and worker in WORKER_CODES else code
