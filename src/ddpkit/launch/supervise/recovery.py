"""What the supervisor learns from a job's lost-node report: which node the
hang watchdog found silent (train/watchdog/node_loss.py's LOST lines), and, in an
elastic job, when the others trained again (rank 0's "elastic: restart"
line after the new rendezvous): the summary says which node was lost, how it
was noticed and how long recovery took.

A launcher cannot see a frozen node on its own (its SSH session still
answers, its container still runs): the job's own heartbeats can. The
supervisor stops that node (launch/supervise/supervisor.py, NodeLost) and applies the
elastic policy to it as to a node that failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# train/watchdog/node_loss.py LOST_LINE
_LOST = re.compile(r"ddpkit watchdog: LOST rank (\d+) node (\d+) host (\S+) pid \d+: no heartbeat for (\d+(?:\.\d+)?)s")
# train/loop/elastic.py changed_line, printed by the new rank 0 once it resumed
_REFORMED = re.compile(r"elastic: restart \d+ of at most \d+; world size (\d+)(?: -> (\d+))?")


@dataclass(frozen=True)
class LostRank:
    """One rank the job's watchdog found silent (from its report line)."""

    rank: int
    node: int
    host: str
    silent_s: float

    @property
    def reason(self) -> str:
        return (f"no heartbeat for {self.silent_s:.0f}s, noticed by the job's heartbeats (frozen, or cut off "
                "without a reset)")


@dataclass
class Recovery:
    """Fed every line (LinePrinter.line) with the supervisor's clock."""

    lost: dict[int, LostRank] = field(default_factory=dict)  # by rank
    silent_since: dict[int, float] = field(default_factory=dict)  # node -> when its silence began
    reformed: list[tuple[int, int, float]] = field(default_factory=list)  # world before, after, seconds after loss

    def read(self, body: str, now: float) -> int | None:
        """Notes a LOST or re-formed line; the node newly reported lost, if any."""
        if "ddpkit watchdog: LOST" in body:
            m = _LOST.search(body)
            if m is None:
                return None
            lost = LostRank(int(m.group(1)), int(m.group(2)), m.group(3), float(m.group(4)))
            self.lost[lost.rank] = lost
            if lost.node in self.silent_since:
                return None
            self.silent_since[lost.node] = now - lost.silent_s
            return lost.node
        if self.silent_since and "elastic: restart" in body:
            m = _REFORMED.search(body)
            if m is not None:
                since = max(self.silent_since.values())
                self.reformed.append((int(m.group(1)), int(m.group(2) or m.group(1)), now - since))
        return None

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
