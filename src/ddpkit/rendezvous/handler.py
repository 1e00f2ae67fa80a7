"""`torchrun --rdzv-backend=ddpkit`: ddpkit's own rendezvous handler, on a
membership with a key per node (rdzv_members.py), in the c10d store torch's
c10d backend would use (`create_backend`: the same endpoint, is_host and
timeouts).

torch's dynamic rendezvous keeps the whole membership (participants, wait
list, every node's last keep-alive) in one pickled state under
compare-and-set: every join, keep-alive and poll reads or rewrites all of
it, N joins are N commits in a row, and N writers at once make one
another's compare-and-sets fail. Here:

- a join is one `add` on the round's counter and one `append` of the
  node's name (no collision, O(1)); a keep-alive is a `set` of the node's
  own key; a waiting node polls one key (is its round closed?);
- one of the first joiners of a round (its evaluators: the first three;
  any other only once none of them has kept alive within the waiting
  expiry) reads the joiners and their keep-alives (`multi_get`s) and closes the round
  (rdzv_members.decide) with one compare-and-set that only the first
  succeeds at; ranks are the closed list's order;
- while the job trains, `num_nodes_waiting` reads the next round's counter
  (a few bytes), N agents together about TRAINING_READS_PER_S a second.

The rules kept from before (docs/DESIGN-NOTES.md, elastic jobs): the round
after a lost node closes once every member of the last round has joined it
or is lost (no last call); the first round waits for the nodes still
starting until max_nodes have joined or `first_round_timeout` (FIRST_ROUND_S
by default) after min_nodes were in, never past the join's own deadline; a
node waiting for a round expires after rdzv_timing.waiting_expiry_s, a member
of a closed round after its keep-alives (a re-formation waits for the lost
node's), and a round does not close with a node silent past half the waiting
expiry (one dead before its first step gets no rank); a node that arrives
while the round is full waits without restarting the others; a graceful
leave (`shutdown`) marks the node gone and closes the job's rendezvous, as
torch's does.

Registered through the `torchrun.handlers` entry point (pyproject.toml);
ddpkit's agent registers it too (`register`), for a node where ddpkit is on
PYTHONPATH without its entry points.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint
from torch.distributed.elastic.utils.logging import get_logger

from ..shared.agreed import RDZV_FIRST_ROUND_KEY as FIRST_ROUND_KEY
from ..shared.agreed import RDZV_HANDLER as NAME
from . import runkey
from .members import EVALUATORS, Decision, Membership, Rules, View, decide
from .timing import AgentTiming

# torch's elastic loggers' level (LOGLEVEL, WARNING by default): with LOGLEVEL=INFO the rounds' lines
# stand beside torch's own in the agent's output
log = get_logger(__name__)
FIRST_ROUND_S = 120  # its default: a node whose start is slower than this joins at the next membership change
# The first round closes this long before the join's deadline, which would fail the rendezvous.
JOIN_MARGIN_S = 10.0
# A waiting node checks whether the job's rendezvous was closed this often (one small read).
CLOSED_POLL_S = 2.0
# The store's host, as it ends, polls for the other members' leave this often, and waits this long at
# most for a member that keeps alive without leaving (a frozen one): its agent's exit waits as long.
LINGER_POLL_S, LINGER_MAX_S = 0.2, 30.0
_NODE_IDS = itertools.count()  # several handlers in one process (the simulation) are distinct nodes


def node_name(addr: str | None) -> str:
    """This agent's name in the membership: host, process and a counter (torch's node descriptor's parts)."""
    return f"{addr or socket.getfqdn()}_{os.getpid()}_{next(_NODE_IDS)}"


class Handler(RendezvousHandler):
    """One agent's rendezvous (torch's RendezvousHandler interface)."""

    def __init__(self, store: Store, params: RendezvousParameters, first_round_s: float,
                 hosts_store: bool = False) -> None:
        self._store, self._run_id, self._lock = store, params.run_id, threading.Lock()
        self._hosts_store = hosts_store  # the job's store lives in this process (torch's is_host)
        self._members = Membership(_Locked(store, self._lock), params.run_id)
        self.node = node_name(params.local_addr)
        self._addr = params.local_addr
        self.min_nodes, self.max_nodes = params.min_nodes, params.max_nodes
        self.join_timeout_s = float(params.get_as_int("join_timeout", 600) or 600)
        self.last_call_s = float(params.get_as_int("last_call_timeout", 30) or 0)
        interval = float(params.get_as_int("keep_alive_interval", 5) or 5)
        attempts = params.get_as_int("keep_alive_max_attempt", 3) or 3
        self.timing = AgentTiming(params.max_nodes, timedelta(seconds=interval * attempts),
                                  timedelta(seconds=first_round_s), interval)
        self.first_round_s = first_round_s
        self.round: int | None = None  # the round this node is a member of
        self.rank_list: list[str] = []
        self._beats: threading.Event | None = None
        self._waiting_cache: tuple[float, int] = (float("-inf"), 0)
        self._held: tuple[int, tuple[str, ...]] | None = None

    # -- torch's interface --------------------------------------------------------------------------
    def get_backend(self) -> str:
        return NAME

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return bool(self._timed(self._members.is_closed))

    def set_closed(self) -> None:
        self._members.set_closed()

    def shutdown(self) -> bool:
        self.stop_keep_alive()
        try:
            self._members.leave(self.node)
            self._members.set_closed()
            if self._hosts_store:
                self._linger()
        except Exception as exc:  # torch's handler says it and goes on: the agent is ending anyway
            log.warning("ddpkit rendezvous: node %s could not close the rendezvous: %s", self.node, exc)
            return False
        return True

    def _linger(self) -> None:
        """The job's store lives in this agent: it stays until every other
        member of the round has left or gone silent (a lost node), so that
        their last requests (torch's exit barrier, their own leave) do not
        find it gone and fill a job that ended well with c10d's errors."""
        expiry = self.timing.expiry_s(waiting=False)
        others = [n for n in self.rank_list if n != self.node]
        deadline = time.monotonic() + LINGER_MAX_S
        while others and time.monotonic() < deadline:
            seen, left = self._members.seen(others)
            now = time.time()
            others = [n for n in others if n not in left and now - seen.get(n, 0.0) < expiry]
            if others:
                time.sleep(LINGER_POLL_S)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting in the next round, where the others should restart for them: any that is a member of
        this round (a restart is under way), or, in a round short of max_nodes, any newcomer."""
        if self.round is None:
            return 0
        at, answer = self._waiting_cache
        if time.monotonic() - at < self.timing.training_poll_s():
            return answer
        answer = 0
        if self._timed(lambda: self._members.count(self.round + 1)) > 0:  # type: ignore[operator]
            waiting = self._members.joined(self.round + 1)
            mine = set(self.rank_list)
            if any(n in mine for n in waiting) or len(self.rank_list) < self.max_nodes:
                answer = len(waiting)
        self._waiting_cache = (time.monotonic(), answer)
        return answer

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.join_timeout_s
        self._waiting_cache = (float("-inf"), 0)
        round_ = max(self._timed(self._members.latest), -1 if self.round is None else self.round + 1)
        if self.round is None:
            time.sleep(random.uniform(0, 0.3))  # torch's skew of the first joins
        self._start_keep_alive()
        while True:
            if self._members.is_closed():
                raise RendezvousClosedError()
            closed = self._wait_in(round_, deadline)
            if self.node in closed:
                break
            log.info("rendezvous round %d closed full without node %s: it waits for round %d", round_, self.node,
                     round_ + 1)
            round_ += 1
        self.round, self.rank_list = round_, closed
        rank, world = closed.index(self.node), len(closed)
        log.info("node %s joined round %d of the rendezvous %s as rank %d in a world of %d", self.node, round_,
                 self._run_id, rank, world)
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{round_}", self._store)
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo.build(rank, store, local_addr=self._addr))

    # -- a round ------------------------------------------------------------------------------------
    def _wait_in(self, round_: int, deadline: float) -> list[str]:
        """Join round `round_` and wait until it closes; its members."""
        self._members.keep_alive(self.node, time.time())
        place = self._timed(lambda: self._members.join(round_, self.node))
        # a node past the first joiners reads the whole round only where they are gone (all three dead)
        lonely_check, lonely = time.monotonic() + self.timing.expiry_s(waiting=True) / 2, False
        closed_seen = float("-inf")
        while True:
            got: tuple[float, list[str]] | None = self._timed(lambda: self._members.members(round_))
            if got is not None:
                return got[1]
            now = time.monotonic()
            if now - closed_seen >= CLOSED_POLL_S:  # the job ended (a node's shutdown) while this one waited
                closed_seen = now
                if self._members.is_closed():
                    raise RendezvousClosedError()
            if now >= deadline:
                raise RendezvousTimeoutError(f"round {round_} of the rendezvous {self._run_id} did not close "
                                             f"within join_timeout ({self.join_timeout_s:.0f} s)")
            if place > EVALUATORS and not lonely and now >= lonely_check:
                lonely_check = now + random.uniform(0.5, 1.0) * self.timing.expiry_s(waiting=True) / 2
                lonely = self._evaluators_gone(round_)
            if place <= EVALUATORS or lonely:
                closed: list[str] | None = self._evaluate(round_, deadline)
                if closed is not None:
                    return closed
            time.sleep(self.timing.join_poll_s())

    def _evaluate(self, round_: int, deadline: float) -> list[str] | None:
        """Read round `round_`'s membership and close it where `decide` says so; its members once closed."""
        members = self._members
        joined = self._timed(lambda: members.joined(round_))
        previous = members.members(round_ - 1) if round_ > 0 else None
        old = previous[1] if previous else []
        seen, left = self._timed(lambda: members.seen(list(dict.fromkeys([*joined, *old]))))
        view = View(round_, joined, seen, left, old if previous else None, previous[0] if previous else 0.0,
                    members.min_at(round_, None), time.time())
        decision = decide(view, self._rules(), time.monotonic() >= deadline - JOIN_MARGIN_S)
        if decision.min_in and view.min_at is None:
            view = View(**{**view.__dict__, "min_at": members.min_at(round_, view.now)})
            decision = decide(view, self._rules(), time.monotonic() >= deadline - JOIN_MARGIN_S)
        self._say_held(round_, decision)
        if decision.members is None:
            return None
        closed: list[str] = self._timed(lambda: members.close(round_, decision.members or [], time.time()))[1]
        if closed == decision.members:
            log.info("rendezvous round %d: %s; closed with %d nodes", round_, decision.why, len(closed))
        return closed

    def _evaluators_gone(self, round_: int) -> bool:
        gone = not self._members.evaluator_alive(round_, self.timing.expiry_s(waiting=True), time.time())
        if gone:
            log.info("rendezvous round %d: its first joiners are gone; node %s reads it", round_, self.node)
        return gone

    def _rules(self) -> Rules:
        timing = self.timing
        return Rules(self.min_nodes, self.max_nodes, self.last_call_s, self.first_round_s,
                     timing.expiry_s(waiting=False), timing.expiry_s(waiting=True), timing.silent_s())

    def _say_held(self, round_: int, decision: Decision) -> None:
        if decision.waiting_for and self._held != (round_, tuple(decision.waiting_for)):
            self._held = (round_, tuple(decision.waiting_for))
            log.info("rendezvous round %d: waiting for %s, silent for %.0f s, before it completes", round_,
                     ", ".join(decision.waiting_for), self.timing.silent_s())

    # -- keep-alives --------------------------------------------------------------------------------
    def _start_keep_alive(self) -> None:
        if self._beats is not None:
            return
        stop = self._beats = threading.Event()
        interval = self.timing.interval

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self._timed(lambda: self._members.keep_alive(self.node, time.time()))
                except Exception as exc:  # the store is gone: the agent's next call says so
                    log.warning("ddpkit rendezvous: node %s's keep-alive failed: %s", self.node, exc)

        threading.Thread(target=beat, name=f"ddpkit-rdzv-keep-alive-{self.node}", daemon=True).start()

    def stop_keep_alive(self) -> None:
        if self._beats is not None:
            self._beats.set()
            self._beats = None

    def _timed(self, call: Callable[[], Any]) -> Any:
        began = time.monotonic()
        try:
            return call()
        finally:
            self.timing.took(time.monotonic() - began)


class _Locked:
    """The store, one request at a time from this agent's threads (its keep-alive and its polls)."""

    def __init__(self, store: Store, lock: threading.Lock) -> None:
        self._store, self._lock = store, lock

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            with self._lock:
                return method(*args)
        return call


def create(params: RendezvousParameters) -> RendezvousHandler:
    """ddpkit's handler for `params`. The run id is the rendered one tagged
    with the run key (runkey.rdzv_run_id): the membership is under keys no one
    who read the rendered files can name, on every node alike."""
    params.run_id = runkey.rdzv_run_id(params.run_id)
    _, store = create_backend(params)
    first_round_s = float(params.get_as_int(FIRST_ROUND_KEY, FIRST_ROUND_S) or 0)
    return Handler(store, params, first_round_s, hosts_store=hosts_store(params))


def hosts_store(params: RendezvousParameters) -> bool:
    """Whether torch's c10d backend started the job's store in this process:
    its `is_host` setting, else whether the endpoint names this machine."""
    configured = params.get_as_bool("is_host")
    if configured is not None:
        return bool(configured)
    return _matches_machine_hostname(parse_rendezvous_endpoint(params.endpoint, default_port=29400)[0])


def creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torchrun calls it and registers the result."""
    return create


def register() -> None:
    """Register the handler with torch under its name, as the entry point
    would (torch accepts the same creator registered twice)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(NAME, create)
