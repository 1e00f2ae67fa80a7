"""An elastic job's rendezvous as bench/scale.py's --watch-rendezvous sees it:
read from the store every PERIOD s, one JSON object a line, then summed up
(`rounds`).

Two writers, one row: ddpkit's handler (the default, `--rdzv-backend=ddpkit`)
keeps its membership as a key per node and per round
(ddpkit/rendezvous/members.py); torch's c10d handler (`elastic.rendezvous:
torchrun`) keeps one pickled state (ddpkit.rdzv_store.rendezvous_state).
A row: `t` (when read), `rendezvous` (which), `round`, `complete` (the round
has closed), `participants` (its members once closed, its joiners so far
while it forms), `waiting` (torch's wait list), `live` (nodes whose
keep-alive is within the handler's expiry), and for ddpkit's, `closed`: the
last closed round, when it closed (its own stamp) and its member count, so
that a round that closed and was followed by the next between two reads is
not missed.

    python -m bench.rdzv_trace ADDR PORT RUN_ID OUT PERIOD   # runs until killed
"""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import timedelta
from typing import Any

from ddpkit.rdzv_store import rendezvous_state
from ddpkit.rendezvous.members import Membership
from ddpkit.rendezvous.timing import EXPIRY_KEEP_ALIVES, KEEP_ALIVE_FLOOR_S, KEEP_ALIVES_PER_S


def sample(store: Any, run_id: str, now: float | None = None) -> dict[str, Any] | None:
    """The rendezvous of `run_id` in `store` as one row; None before any node joined."""
    members = Membership(store, run_id)
    if members.latest() > 0 or members.joined(0):
        return ddpkit_row(members, time.time() if now is None else now)
    state = rendezvous_state(store, run_id)
    return None if state is None else torch_row(state, time.time() if now is None else now)


def ddpkit_row(members: Membership, now: float) -> dict[str, Any]:
    latest = members.latest()  # the round to join: the last closed one + 1
    forming = members.joined(latest)
    closed = members.members(latest - 1) if latest > 0 else None
    nodes = list(dict.fromkeys(forming + (closed[1] if closed else [])))
    seen, _ = members.seen(nodes)
    # The handler's expiry (rendezvous/timing.py): EXPIRY_KEEP_ALIVES intervals, the interval growing past 1,024 nodes.
    expiry = EXPIRY_KEEP_ALIVES * max(KEEP_ALIVE_FLOOR_S, math.ceil(len(nodes) / KEEP_ALIVES_PER_S))
    row: dict[str, Any] = {"t": now, "rendezvous": "ddpkit", "round": latest, "complete": False,
                           "participants": len(forming), "waiting": 0,
                           "live": sum(1 for at in seen.values() if now - at <= expiry)}
    if closed is not None:
        row["closed"] = {"round": latest - 1, "at": closed[0], "members": len(closed[1])}
        if not forming:  # nobody waits for a next round: the closed one is the job's
            row.update(round=latest - 1, complete=True, participants=len(closed[1]))
    return row


def torch_row(state: Any, now: float) -> dict[str, Any]:
    return {"t": now, "rendezvous": "torch", "round": state.round, "complete": bool(state.complete),
            "participants": len(state.participants), "waiting": len(state.wait_list),
            "live": len(state.last_heartbeats)}


def rounds(trace: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """What the rendezvous did: when each round closed (s from the command: ddpkit's close stamp, or
    torch's first read of it complete, to PERIOD), how often a round in the making lost participants
    (nodes the others removed as dead while they waited: torch's) or live nodes, the most participants
    each round had while it formed, and the rows read."""
    closed: dict[int, dict[str, Any]] = {}
    for row in trace:
        for r, at, n in _closings(row):
            closed.setdefault(r, {"round": r, "at_s": round(at - t0, 2), "participants": n})
    same = [(prev, cur) for prev, cur in zip(trace, trace[1:]) if cur["round"] == prev["round"]]
    drops = sum(1 for prev, cur in same if not cur["complete"] and cur["participants"] < prev["participants"])
    dead = sum(1 for prev, cur in same if cur["live"] < prev["live"])
    peak: dict[int, int] = {}
    for row in trace:
        if not row["complete"]:
            peak[row["round"]] = max(peak.get(row["round"], 0), row["participants"])
    return {"completed": [closed[r] for r in sorted(closed)], "participant_drops": drops, "heartbeat_drops": dead,
            "max_participants_while_forming": peak, "samples": len(trace)}


def _closings(row: dict[str, Any]) -> list[tuple[int, float, int]]:
    if "closed" in row:
        return [(row["closed"]["round"], row["closed"]["at"], row["closed"]["members"])]
    return [(row["round"], row["t"], row["participants"])] if row["complete"] else []


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    addr, port, run_id, out, period = argv[0], int(argv[1]), argv[2], argv[3], float(argv[4])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    with open(out, "a", buffering=1) as file:
        while True:
            row = sample(store, run_id)
            if row is not None:
                file.write(json.dumps(row) + "\n")
            time.sleep(period)


if __name__ == "__main__":
    main(sys.argv[1:])
