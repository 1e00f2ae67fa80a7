"""torchrun's c10d rendezvous timeouts for an elastic job, derived from the
one setting `watchdog.loss_s` (docs/ELASTIC.md, "How fast a loss is
handled").

torchrun reads every value of `--rdzv-conf` as whole seconds
(`RendezvousParameters.get_as_int`), so each is an int with a floor. The
keys are those torch's dynamic rendezvous handler reads
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, create_handler):
join_timeout, last_call_timeout, close_timeout, keep_alive_interval,
keep_alive_max_attempt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A keep-alive at most once a second (torchrun's unit), and never fewer than
# 2 attempts: one keep-alive late on a busy agent must not drop a live node.
KEEP_ALIVE_FLOOR_S, ATTEMPTS_FLOOR = 1, 2
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


def derive(loss_s: float, last_call_floor_s: int = LAST_CALL_FLOOR_S, close_floor_s: int = CLOSE_FLOOR_S,
           last_call_s: int | None = None) -> RdzvTiming:
    """- keep-alive: a lost agent's entry expires (interval x attempts) no
      later than loss_s after its last keep-alive, so when the survivors
      notice the loss through the workers' heartbeats and re-rendezvous it is
      already gone (torchrun's default 5 s x 3 = 15 s would make them wait
      for it). About a third of loss_s per keep-alive: each one rewrites the
      rendezvous state in the store, so not more often than needed.
    - last call: half of loss_s (the floor, or the target's floor, at
      least). It is paid at every membership change; after a loss the nodes
      that will come are already there.
    - close: twice loss_s (floor CLOSE_FLOOR_S, or the target's).
    `last_call_s` (spec elastic.last_call_s) wins over the derived last call."""
    whole = max(1, math.floor(loss_s))
    interval = max(KEEP_ALIVE_FLOOR_S, whole // 3)
    attempts = max(ATTEMPTS_FLOOR, whole // interval)
    last_call = last_call_s if last_call_s else max(last_call_floor_s, math.ceil(whole / 2))
    return RdzvTiming(interval, attempts, last_call, max(close_floor_s, 2 * whole))
