"""torchrun's c10d rendezvous timeouts for an elastic job, derived from the
one setting `watchdog.loss_s` and the job's node count (docs/DESIGN-NOTES.md,
"How fast a loss is handled").

torchrun reads every value of `--rdzv-conf` as whole seconds
(`RendezvousParameters.get_as_int`), so each is an int with a floor. The
keys are those torch's dynamic rendezvous handler reads
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, create_handler):
join_timeout, last_call_timeout, close_timeout, keep_alive_interval,
keep_alive_max_attempt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# A keep-alive at most once a second (torchrun's unit). An agent's entry
# expires after EXPIRY_KEEP_ALIVES intervals without one: two may be late on a
# busy agent before it is dropped. Dropping a live agent from
# a running round changes nothing until the next membership change, when it
# joins again like the others; the expiry decides how soon a round after a
# crash can start, so it is kept short rather than as long as loss_s.
KEEP_ALIVE_FLOOR_S, EXPIRY_KEEP_ALIVES = 1, 3
# Every keep-alive rewrites the whole rendezvous state (an entry per node) in
# the store on node 0: the interval grows with the node count so that the
# agents together send about this many a second.
KEEP_ALIVES_PER_S = 64
# While an agent waits in the rendezvous, torch reads the whole state once a
# second (a 1 s pause between polls, and the state cached for 1 s): up to a
# second at each step of a membership change (the dead agent's expiry seen,
# the last agent's join seen). ddpkit's handler reads it this often per
# KEEP_ALIVES_PER_S nodes instead, never slower than torch's second: a read
# is one store get, and the agents' monitor loop reads at this rate too
# while the job trains (num_nodes_waiting), about 640 reads a second in all.
STATE_POLL_S, TORCH_STATE_POLL_S = 0.1, 1.0
# A rendezvous that already has min_nodes waits this long for more at the
# least: the nodes' own start-up spread at the first rendezvous (a node that
# misses it joins at a further round, which costs no restart but another last call).
LAST_CALL_FLOOR_S = 3
# Closing the rendezvous is a few store round trips; a loaded store answers
# within seconds.
CLOSE_FLOOR_S = 10


@dataclass(frozen=True)
class RdzvTiming:
    """The derived values, in whole seconds."""

    keep_alive_interval: int
    keep_alive_max_attempt: int
    last_call_timeout: int
    close_timeout: int

    @property
    def expiry_s(self) -> int:
        """When torchrun drops a silent agent from the rendezvous."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


# torchrun's own values (torch's create_handler and RendezvousTimeout), for
# elastic.rendezvous "torchrun".
TORCHRUN = RdzvTiming(keep_alive_interval=5, keep_alive_max_attempt=3, last_call_timeout=30, close_timeout=30)


def torchrun_defaults(last_call_floor_s: int = LAST_CALL_FLOOR_S, close_floor_s: int = CLOSE_FLOOR_S,
                      last_call_s: int | None = None) -> RdzvTiming:
    """torchrun's own rendezvous timeouts, each raised to the target's floor;
    `last_call_s` wins over the last call."""
    return dataclasses.replace(
        TORCHRUN, last_call_timeout=last_call_s or max(last_call_floor_s, TORCHRUN.last_call_timeout),
        close_timeout=max(close_floor_s, TORCHRUN.close_timeout))


def state_poll_s(nodes: int) -> float:
    """Seconds between two reads of the rendezvous state by one waiting agent
    of ddpkit's handler (rendezvous.py), for a job of up to `nodes` nodes."""
    return min(TORCH_STATE_POLL_S, round(STATE_POLL_S * math.ceil(max(1, nodes) / KEEP_ALIVES_PER_S), 3))


def derive(loss_s: float, nodes: int, last_call_floor_s: int = LAST_CALL_FLOOR_S,
           close_floor_s: int = CLOSE_FLOOR_S, last_call_s: int | None = None) -> RdzvTiming:
    """- keep-alive: once a second up to KEEP_ALIVES_PER_S nodes, slower
      above (the store's load), and never slower than a third of loss_s, so
      a silent agent's entry is gone (interval x EXPIRY_KEEP_ALIVES) by the
      time the survivors act on its silence. After a crash the survivors
      re-form at once, and the new round starts when the dead agent's entry
      expires: 3 s up to 64 nodes (torchrun's default 5 s x 3 = 15 s).
    - last call: half of loss_s (the floor, or the target's floor, at
      least). ddpkit's rendezvous (rendezvous.py) skips it after a loss, once
      every node that left the last round is back; it is paid at the first
      round and where that rule cannot tell who will come.
    - close: twice loss_s (floor CLOSE_FLOOR_S, or the target's).
    `last_call_s` (spec elastic.last_call_s) wins over the derived last call."""
    whole = max(1, math.floor(loss_s))
    slowest = max(KEEP_ALIVE_FLOOR_S, whole // EXPIRY_KEEP_ALIVES)
    interval = min(slowest, max(KEEP_ALIVE_FLOOR_S, math.ceil(nodes / KEEP_ALIVES_PER_S)))
    last_call = last_call_s if last_call_s else max(last_call_floor_s, math.ceil(whole / 2))
    return RdzvTiming(interval, EXPIRY_KEEP_ALIVES, last_call, max(close_floor_s, 2 * whole))
