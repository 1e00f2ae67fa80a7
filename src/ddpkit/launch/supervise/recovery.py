"""What the supervisor learns from a job's lost-node report: which node the
hang watchdog found silent (the `lost` record of train/watchdog/node_loss.py),
and, in an elastic job, when the others trained again (the `reformed` record
rank 0 sends after the new rendezvous): the summary says which node was lost, how it
was noticed and how long recovery took.

A launcher cannot see a frozen node on its own (its SSH session still
answers, its container still runs): the job's own heartbeats can. The
supervisor stops that node (launch/supervise/supervisor.py, NodeReportedLost) and applies the
elastic policy to it as to a node that failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...records import LostRank, NodeLost, Reformed


@dataclass
class Recovery:
    """Fed the job's `lost` and `reformed` records (launch/supervise/findings.py) with the supervisor's clock."""

    lost: dict[int, LostRank] = field(default_factory=dict)  # by rank
    silent_since: dict[int, float] = field(default_factory=dict)  # node -> when its silence began
    reformed: list[tuple[int, int, float]] = field(default_factory=list)  # world before, after, seconds after loss

    def node_lost(self, verdict: NodeLost, now: float) -> list[int]:
        """Notes the lost ranks; the nodes newly reported lost."""
        new = []
        for lost in verdict.lost:
            self.lost[lost.rank] = lost
            if lost.node not in self.silent_since:
                self.silent_since[lost.node] = now - lost.silent_s
                new.append(lost.node)
        return new

    def trained_again(self, reformed: Reformed, now: float) -> None:
        """The job re-formed; counted as a recovery after a node was reported lost."""
        if self.silent_since:
            since = max(self.silent_since.values())
            self.reformed.append((reformed.before, reformed.world, now - since))
    def forget(self, node: int) -> None:
        """A lost node that came back (elastic) is in the job again."""
        self.lost = {r: x for r, x in self.lost.items() if x.node != node}
        self.silent_since.pop(node, None)

    def of_node(self, node: int) -> LostRank | None:
        return next((x for x in sorted(self.lost.values(), key=lambda x: x.rank) if x.node == node), None)

    def summary(self) -> str:
        """"; recovery: ..." for the closing line of a job that went on."""
        if not self.reformed:
            return ""
        before, after, took = self.reformed[0]
        return (f"; recovery: the others trained again {took:.0f}s after the node went silent "
                f"(world size {before} -> {after})")
