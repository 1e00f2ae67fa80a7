"""ddpkit's rendezvous membership in the store: a key per node and per round
instead of one shared state under compare-and-set.

Under the run's rendezvous id (runkey.rdzv_run_id), prefix `P` =
`torch.rendezvous.<id>.ddpkit/`:

- `P alive/<node>`: the node's last keep-alive (wall-clock seconds), or
  `left`. Each node writes its own key and nothing else: a keep-alive is one
  small `set`, never a rewrite of everyone's.
- `P <r>/count`: round r's joiners so far (an atomic `add`: a join never
  collides with another); `P <r>/list`: their names, one a line (an atomic
  `append`, in the order the store took them); `P <r>/evaluator/<k>`: the
  k-th joiner's name, for the first EVALUATORS (the nodes that close it).
- `P <r>/min_at`: when round r first had min_nodes live joiners (the last
  call counts from it), written once (compare-and-set on an absent key).
- `P <r>/members`: the closed round: its close time, then its members in rank
  order, one a line. Written once, by whichever evaluator's compare-and-set
  comes first; every other node reads it.
- `P latest`: the round to join (the last closed one + 1), a hint for a node
  that starts late; `P closed`: the job's rendezvous is closed.

Which round closes when, with whom, is `decide` (pure: tested on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

LEFT = "left"
BATCH = 256  # keys a multi_get reads at once (as the watchdog reads heartbeats)
EVALUATORS = 3  # a round's first joiners, each of which reads its membership at every poll


def prefix(run_id: str) -> str:
    return f"torch.rendezvous.{run_id}.ddpkit/"


@dataclass(frozen=True)
class Rules:
    """What a round needs to close, in seconds (the handler's settings and timing)."""

    min_nodes: int
    max_nodes: int
    last_call_s: float
    first_round_s: float  # round 0 stays open this long after min_nodes were in (0: the last call alone)
    expiry_s: float  # a member of a closed round silent this long is lost
    waiting_expiry_s: float  # a node waiting for a round silent this long is gone
    silent_s: float  # a node silent this long is not given a rank: the round waits for it


@dataclass(frozen=True)
class View:
    """One evaluator's read of round `round`."""

    round: int
    joined: Sequence[str]  # in the order the store took them, each once
    seen: dict[str, float]  # node -> last keep-alive (wall clock); LEFT's are absent and in `left`
    left: frozenset[str]
    previous: Sequence[str] | None  # the last round's members (None: round 0, or it never closed)
    previous_closed_at: float
    min_at: float | None
    now: float


@dataclass(frozen=True)
class Decision:
    members: list[str] | None  # close the round with these, in rank order (None: not yet)
    why: str = ""
    waiting_for: list[str] = field(default_factory=list)  # silent nodes a closing round waits for
    min_in: bool = False  # min_nodes live joiners are in (the last call may start)


def _age(view: View, node: str, since: float = 0.0) -> float:
    return view.now - max(view.seen.get(node, float("-inf")), since)


def decide(view: View, rules: Rules, deadline_near: bool = False) -> Decision:
    """Whether round `view.round` closes now, and with whom:
    - with max_nodes live joiners, at once;
    - after a round (not the first), once every member of the last round has
      joined this one or is gone (left, or silent past `expiry_s`: a lost
      node): the nodes that will come are known, no last call waits;
    - else once min_nodes are in and the last call is over (round 0: the
      first round's wait, or `deadline_near`: the join's own deadline).
    The last round's members keep the first ranks, in their order; the
    others are let in as they joined and ranked by name (torch's order:
    a first round's ranks follow the hosts, not who started first);
    a node silent past `silent_s` holds a closing round (it comes back, or
    expires and the round goes on without it)."""
    previous = list(view.previous or ())
    live = [n for n in view.joined if n not in view.left and _age(view, n) <= rules.waiting_expiry_s]
    old = set(previous)
    kept = [n for n in previous if n in live][:rules.max_nodes]
    # newcomers are let in as they joined, and ranked by name, as torch ranks its participants
    # (sorted node descriptors): a job's first round gives node ranks in host order, whatever
    # order its agents started in
    chosen = kept + sorted([n for n in live if n not in old][:rules.max_nodes - len(kept)])
    if len(chosen) < rules.min_nodes:
        return Decision(None)
    why = ""
    here = set(view.joined)
    if len(chosen) >= rules.max_nodes:
        why = f"max_nodes ({rules.max_nodes}) have joined"
    elif view.previous is not None and view.round > 0:
        coming = [n for n in previous if n not in here and n not in view.left
                  and _age(view, n, view.previous_closed_at) <= rules.expiry_s]
        if not coming and here & old:
            why = f"every node of round {view.round - 1} has joined or is lost; complete without the last call"
    if not why and view.min_at is not None:
        wait = max(rules.last_call_s, rules.first_round_s) if view.round == 0 else rules.last_call_s
        if view.now >= view.min_at + wait:
            why = "the last call is over"
        elif view.round == 0 and deadline_near:
            why = "the join's deadline is near"
    if not why:
        return Decision(None, min_in=True)
    silent = [n for n in chosen if _age(view, n) > rules.silent_s]
    if silent:
        return Decision(None, why, silent, min_in=True)
    return Decision(chosen, why, min_in=True)


@dataclass
class RendezvousSummary:
    """What the store service's watch reads (rdzv_store.ended): the shape of torch's state it reads."""

    closed: bool
    round: int
    last_heartbeats: dict[str, datetime]


class Membership:
    """One run's membership keys in `store` (a c10d Store: add, append, check,
    get, multi_get, compare_set)."""

    def __init__(self, store: Any, run_id: str) -> None:
        self.store, self.p = store, prefix(run_id)

    # -- reads --------------------------------------------------------------------------------------
    def _get(self, key: str) -> str | None:
        if not self.store.check([self.p + key]):  # get() would block until the store's timeout
            return None
        return bytes(self.store.get(self.p + key)).decode()

    def latest(self) -> int:
        value = self._get("latest")
        return int(value) if value and value.isdigit() else 0

    def is_closed(self) -> bool:
        return bool(self.store.check([self.p + "closed"]))

    def count(self, round_: int) -> int:
        return int(self.store.add(self.p + f"{round_}/count", 0))

    def joined(self, round_: int) -> list[str]:
        names = (self._get(f"{round_}/list") or "").split()
        return list(dict.fromkeys(names))  # each once, in the store's order

    def members(self, round_: int) -> tuple[float, list[str]] | None:
        """Round `round_` as closed: (when, its members in rank order); None while it is open."""
        value = self._get(f"{round_}/members")
        return None if value is None else _parse_members(value)

    def seen(self, nodes: Sequence[str]) -> tuple[dict[str, float], frozenset[str]]:
        """Each node's last keep-alive, and the nodes that left."""
        seen: dict[str, float] = {}
        left = set()
        for i in range(0, len(nodes), BATCH):
            batch = list(nodes[i:i + BATCH])
            keys = [self.p + f"alive/{n}" for n in batch]
            values = self.store.multi_get(keys) if self.store.check(keys) else [self._get(f"alive/{n}") or ""
                                                                               for n in batch]
            for node, raw in zip(batch, values):
                text = raw if isinstance(raw, str) else bytes(raw).decode()
                if text == LEFT:
                    left.add(node)
                else:
                    try:
                        seen[node] = float(text)
                    except ValueError:
                        continue  # no keep-alive yet (or not one of ours): not live
        return seen, frozenset(left)

    def min_at(self, round_: int, now: float | None) -> float | None:
        """When round `round_` first had min_nodes in; `now` records it where none is yet."""
        key = self.p + f"{round_}/min_at"
        if now is not None:
            return float(bytes(self.store.compare_set(key, "", f"{now}")).decode())
        value = self._get(f"{round_}/min_at")
        return None if value is None else float(value)

    # -- writes -------------------------------------------------------------------------------------
    def keep_alive(self, node: str, now: float) -> None:
        self.store.set(self.p + f"alive/{node}", f"{now}")

    def leave(self, node: str) -> None:
        self.store.set(self.p + f"alive/{node}", LEFT)

    def join(self, round_: int, node: str) -> int:
        """Join round `round_` (this node's keep-alive is written first); its place among the joiners (1: first)."""
        place = int(self.store.add(self.p + f"{round_}/count", 1))
        self.store.append(self.p + f"{round_}/list", f"{node}\n")
        if place <= EVALUATORS:
            self.store.set(self.p + f"{round_}/evaluator/{place}", node)
        return place

    def evaluator_alive(self, round_: int, expiry_s: float, now: float) -> bool:
        """Whether one of round `round_`'s evaluators has kept alive within `expiry_s` (a few small reads)."""
        names = [name for k in range(1, EVALUATORS + 1) if (name := self._get(f"{round_}/evaluator/{k}"))]
        seen, left = self.seen(names)
        return any(n not in left and now - seen.get(n, float("-inf")) <= expiry_s for n in names)

    def close(self, round_: int, members: Sequence[str], now: float) -> tuple[float, list[str]]:
        """Close round `round_` with `members` unless another evaluator closed it first; the round as closed."""
        value = bytes(self.store.compare_set(self.p + f"{round_}/members", "",
                                             "\n".join([f"{now}", *members]))).decode()
        self.store.set(self.p + "latest", str(round_ + 1))
        return _parse_members(value)

    def set_closed(self) -> None:
        self.store.set(self.p + "closed", "1")

    def summary(self) -> RendezvousSummary | None:
        """The job's rendezvous as the store service watches it (None: no node joined yet)."""
        latest = self.latest()
        closed_round = self.members(latest - 1) if latest > 0 else None
        nodes = self.joined(latest) + (closed_round[1] if closed_round else [])
        if not nodes and not self.is_closed():
            return None
        seen, _ = self.seen(list(dict.fromkeys(nodes)))
        beats = {n: datetime.fromtimestamp(t, timezone.utc) for n, t in seen.items()}
        return RendezvousSummary(self.is_closed(), latest, beats)


def _parse_members(value: str) -> tuple[float, list[str]]:
    first, *names = value.split("\n")
    try:
        return float(first), names
    except ValueError:
        return 0.0, []  # not a closed round of ours: nobody's rank
