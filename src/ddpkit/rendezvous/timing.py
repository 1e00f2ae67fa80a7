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
import threading
from dataclasses import dataclass
from datetime import timedelta

# A keep-alive at most once a second (torchrun's unit). An agent's entry
# expires after EXPIRY_KEEP_ALIVES intervals without one: two may be late on a
# busy agent before it is dropped. Dropping a live agent from
# a running round changes nothing until the next membership change, when it
# joins again like the others; the expiry decides how soon a round after a
# crash can start, so it is kept short rather than as long as loss_s.
KEEP_ALIVE_FLOOR_S, EXPIRY_KEEP_ALIVES = 1, 3
# A keep-alive of ddpkit's handler is one small write of the node's own key
# (rdzv_members.py; torch's rewrote the whole state, an entry per node): the
# interval grows with the node count above this many nodes only, so that the
# agents together send about this many a second, and a lost node's expiry
# (3 intervals, what a re-formation waits for) stays 3 s up to 1,024 nodes.
KEEP_ALIVES_PER_S = 1024
# While an agent waits in the rendezvous, torch reads the whole state once a
# second (a 1 s pause between polls, and the state cached for 1 s). ddpkit's
# handler reads one key (is its round closed?) every STATE_POLL_S per
# POLL_NODES nodes, never slower than torch's second; a round's evaluators
# read its joiners and their keep-alives at the same pace.
STATE_POLL_S, TORCH_STATE_POLL_S = 0.1, 1.0
POLL_NODES = 512
# A rendezvous that already has min_nodes waits this long for more at the
# least: the nodes' own start-up spread at the first rendezvous (a node that
# misses it joins at a further round, which costs no restart but another last call).
LAST_CALL_FLOOR_S = 3
# Closing the rendezvous is a few store round trips; a loaded store answers
# within seconds.
CLOSE_FLOOR_S = 10


# A node waiting for a round (in a round not yet complete, or on the wait
# list) is judged silent by a longer expiry than a participant of a complete
# round: a node still starting (importing torch, its zygote forking on a busy
# host) misses keep-alives, and dropping it only makes it join again, one
# more join (torch's c10d: a write of the whole state, on which the others'
# compare-and-sets failed, a livelock on starved CPUs: 16 hosts on 2 cores
# never formed a first round at 3 s expiry). A
# waiting node is kept WAITING_EXPIRY_S, never past the first round's own
# wait (elastic.first_round_s, the bound the spec sets) and never less than
# the usual expiry; a node silent for half of it is not counted in a round
# that completes (it is waited for instead: a node dead before its first
# step costs no restart). A participant of a complete round (training) has
# the usual expiry: a re-formation waits for the lost node's, so it stays fast.
WAITING_EXPIRY_S = 30
# Each agent times its own requests to the store (a moving
# average): on a loaded store, or an agent's own starved CPU, a round trip
# is slow, and so are its keep-alives. A silent node expires no sooner than
# EXPIRY_ROUND_TRIPS of them, and a waiting agent polls no more often than
# one every POLL_ROUND_TRIPS of them (it backs off as the store slows).
EXPIRY_ROUND_TRIPS, POLL_ROUND_TRIPS = 10, 10
LATENCY_WEIGHT = 0.2  # the moving average's weight of a new round trip
# While the job trains, an agent reads the next round's counter only to see a
# node waiting to join (num_nodes_waiting, from torchrun's monitor loop,
# answered from a cache of this age): the agents together read it about this
# many times a second at most. A node that waits is noticed within
# TRAINING_POLL_MAX_S at most.
TRAINING_READS_PER_S, TRAINING_POLL_MAX_S = 64, 10.0


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
    """Seconds between two polls of one waiting agent of ddpkit's handler
    (rendezvous.py), for a job of up to `nodes` nodes."""
    return min(TORCH_STATE_POLL_S, round(STATE_POLL_S * math.ceil(max(1, nodes) / POLL_NODES), 3))


def join_poll_s(nodes: int, round_trip_s: float = 0.0) -> float:
    """Seconds between two polls of an agent waiting in a
    rendezvous: state_poll_s, or POLL_ROUND_TRIPS of the agent's measured
    round trip to the store where that is longer, never slower than torch's
    second."""
    return round(min(TORCH_STATE_POLL_S, max(state_poll_s(nodes), POLL_ROUND_TRIPS * round_trip_s)), 3)


def training_poll_s(nodes: int, round_trip_s: float = 0.0) -> float:
    """Seconds a training agent's read of the next round is kept (its
    num_nodes_waiting answered from it): the agents together read about
    TRAINING_READS_PER_S a second, each no faster than it would poll waiting."""
    return round(min(TRAINING_POLL_MAX_S, max(join_poll_s(nodes, round_trip_s), nodes / TRAINING_READS_PER_S)), 3)


def expiry_s(expiry: float, round_trip_s: float = 0.0) -> float:
    """When an agent judges another silent: the keep-alives' expiry, or
    EXPIRY_ROUND_TRIPS of its measured round trip to the store where longer."""
    return max(float(expiry), EXPIRY_ROUND_TRIPS * round_trip_s)


def waiting_expiry_s(expiry: float, first_round_s: float, round_trip_s: float = 0.0) -> float:
    """The expiry of a silent node waiting for a round: WAITING_EXPIRY_S,
    within first_round_s (0: torch's rule, the usual expiry), never less than
    the usual one (expiry_s)."""
    usual = expiry_s(expiry, round_trip_s)
    return usual if first_round_s <= 0 else max(usual, min(float(first_round_s), WAITING_EXPIRY_S))


def derive(loss_s: float, nodes: int, last_call_floor_s: int = LAST_CALL_FLOOR_S,
           close_floor_s: int = CLOSE_FLOOR_S, last_call_s: int | None = None) -> RdzvTiming:
    """- keep-alive: once a second up to KEEP_ALIVES_PER_S nodes, slower
      above (the store's load), and never slower than a third of loss_s, so
      a silent agent's entry is gone (interval x EXPIRY_KEEP_ALIVES) by the
      time the survivors act on its silence. After a crash the survivors
      re-form at once, and the new round closes when the dead agent's entry
      expires: 3 s up to 1,024 nodes (torchrun's default 5 s x 3 = 15 s).
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


class AgentTiming:
    """One agent's timing in ddpkit's rendezvous (rendezvous.py): its
    measured round trip to the store (a moving average of its requests),
    and the expiries and polls
    that follow from it. `expiry` is the settings' (keep-alive interval x
    attempts), `first_round` the first round's wait (first_round_timeout)."""

    def __init__(self, nodes: int, expiry: timedelta, first_round: timedelta, interval: float = 1.0) -> None:
        self.nodes, self.expiry, self.first_round = nodes, expiry.total_seconds(), first_round.total_seconds()
        self.interval = interval
        self.round_trip_s = 0.0
        self._lock = threading.Lock()

    def took(self, seconds: float) -> None:
        with self._lock:
            self.round_trip_s += LATENCY_WEIGHT * (seconds - self.round_trip_s)

    def expiry_s(self, waiting: bool) -> float:
        """When this agent judges another node silent: one waiting for a round, or a participant of the
        complete one (a lost node, whose expiry a re-formation waits for)."""
        if waiting:
            return waiting_expiry_s(self.expiry, self.first_round, self.round_trip_s)
        return expiry_s(self.expiry, self.round_trip_s)

    def silent_s(self) -> float:
        """A participant of a round not yet complete silent this long is not counted in its completion."""
        return max(self.expiry_s(waiting=False), self.expiry_s(waiting=True) / 2)

    def join_poll_s(self) -> float:
        return join_poll_s(self.nodes, self.round_trip_s)

    def training_poll_s(self) -> float:
        return training_poll_s(self.nodes, self.round_trip_s)
