"""The exceptions each node's workers raised, as their `traceback` records
said them (records/tracebacks.py): the summary's first-failure cell holds the
one that failed the node, where it was raised, not the lines printed before
it; and a rank whose collective lost its peer (the knock-on of another
rank's failure) is named as that on the console, not as a second failure."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...records import Traceback
from ...records.tracebacks import WHERE, knock_on_text


@dataclass(frozen=True)
class RankException:
    """One worker's exception."""

    node: int
    rank: int | None
    line: str  # type: message, with the console's prefix (`[node1 rank1] `)
    at: str | None  # where it was raised, when its traceback had frames
    knock_on: bool  # its collective lost a peer
    late: bool  # it came after its node's agent reported a failed worker


@dataclass
class Exceptions:
    """Every node's worker exceptions, in the order they came."""

    by_node: dict[int, list[RankException]] = field(default_factory=dict)

    def note(self, node: int, rank: int | None, prefix: str, record: Traceback, late: bool) -> str:
        """Keep the exception of `record`; the line the console shows for it."""
        knock_on = bool(record.knock_on)
        text = knock_on_text(record) if knock_on else record.line.removesuffix(WHERE)
        self.by_node.setdefault(node, []).append(
            RankException(node, rank, prefix + text, record.at, knock_on, late))
        if not knock_on:
            return record.line
        cause = self.first_own(other_than=node, rank=rank)
        if cause is None:
            return f"{text}: its collective lost a peer, most often the knock-on of another rank's failure{WHERE}"
        who = "another rank" if cause.rank is None else f"rank {cause.rank}"
        kind = text.partition(": ")[0]
        # No peer address in the line: every rank that lost the same peer prints it alike, and it is merged.
        return f"a knock-on of {who}'s failure: its collective lost a peer ({kind}){WHERE}"

    def first_own(self, other_than: int | None = None, rank: int | None = None) -> RankException | None:
        """The first exception that is no knock-on, of another rank than `rank` of node `other_than`."""
        return next((e for es in self.by_node.values() for e in es
                     if not e.knock_on and not (e.node == other_than and e.rank == rank)), None)

    def of_node(self, node: int, failed_rank: int | None) -> RankException | None:
        """The exception that failed node `node`: its workers' exceptions from
        before its agent reported a failed worker, or from that worker
        (`failed_rank`: its output may reach the launcher after the report),
        one of its own before a knock-on."""
        mine = [e for e in self.by_node.get(node, [])
                if not e.late or (failed_rank is not None and e.rank == failed_rank)]
        return next((e for e in mine if not e.knock_on), mine[0] if mine else None)

    def knocked_on(self) -> set[int]:
        """The nodes whose every exception is a knock-on."""
        return {n for n, es in self.by_node.items() if es and all(e.knock_on for e in es)}

    def own(self) -> set[int]:
        """The nodes with an exception of their own (no knock-on)."""
        return {n for n, es in self.by_node.items() if any(not e.knock_on for e in es)}

    def forget(self, node: int) -> None:
        self.by_node.pop(node, None)
