"""`torchrun --rdzv-backend=ddpkit`: torch's c10d rendezvous with two rules
added: the round after a lost node does not wait out the last call, and the
first round waits for the nodes still starting.

torch's dynamic rendezvous (the handler behind `c10d`) completes a round as
soon as max_nodes have joined; with fewer, once min_nodes are in it waits the
last call for more. After a node is lost the others re-form without it, so
max_nodes never come and every loss pays the whole last call (at loss_s 10,
about 5 of the 15.5 s a crash costs) for a node that is gone.

The rule: a new round starts only when every member of the last round has
left it, the living ones by leaving (each agent's exit at the start of
`next_rendezvous`), a lost one by its keep-alive expiring. So when the new
round begins, the nodes that will come are known: those that left, and those
already on the wait list. Each agent of this handler writes its name to the
store when it leaves a complete round; once everyone named there and on the
wait list (or the redundancy list, where a node restarted at once queues
while its dead self still fills the last round) has joined (and min_nodes is
met), the round is complete at once.
Anything else (a node that left and then died before it joined again, a
round whose members all expired) falls back to torch's own last call.

The first round waits for the whole job: once min_nodes are in, torch
closes it after the last call, and a node still starting then (a slow
image pull, a busy host: the rule at scale, not the exception) is left on
the wait list, to be let in by a restart of every worker. Round 0 instead
stays open until max_nodes have joined or `first_round_timeout` seconds
(rendezvous config; FIRST_ROUND_S by default) have passed since min_nodes
were in, and never past the join operation's own deadline; then it closes
as torch's would, with the nodes that came.

A node waiting for a round (in one not yet complete, or on the wait list)
expires after rdzv_timing.waiting_expiry_s (30 s, within first_round_timeout;
a participant of a complete round, whose expiry a re-formation waits for,
after 3 keep-alives) and keeps alive less often (waiting_keep_alive_s): on a
busy host a starting node misses keep-alives, and dropping it only made it
join again, one more write of the whole state on which the others'
compare-and-sets failed, until on starved CPUs no round formed. A round
completes only with nodes seen within half that expiry (one silent longer
is waited for), so a node dead before its first step gets no rank. A failed
compare-and-set backs off (rdzv_timing.cas_backoff_s). Polls follow each
agent's measured round trip to the store: a waiting agent reads the state
every rdzv_timing.join_poll_s (0.1 s up to 64 nodes; torch's is a second), a
training one (num_nodes_waiting) every training_poll_s, about 64 reads a
second from all agents together at any N.

Registered through the `torchrun.handlers` entry point (pyproject.toml);
torchrun calls `creator()` once and registers what it returns under the
entry point's name. ddpkit's agent registers it too (`register`), so that a
node where ddpkit is importable but not installed with its entry points (a
source tree on PYTHONPATH) has it all the same. The handler is torch's own
(`create_handler`), with its operation executor wrapped: the decisions of
torch's join and exit operations are kept, this module only adds the early
completion and the leaving record. Those operations are private to torch, so `unsupported()`
checks that they are there and `create` falls back to plain c10d, saying
why, when a torch release moves them (tests/test_rendezvous.py pins them).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.utils.logging import get_logger

from . import runkey
from .agreed import RDZV_FIRST_ROUND_KEY as FIRST_ROUND_KEY
from .agreed import RDZV_HANDLER as NAME
from .rdzv_timing import AgentTiming, cas_backoff_s

T = TypeVar("T")
# torch's elastic loggers' level (LOGLEVEL, WARNING by default): with LOGLEVEL=INFO the rule's
# line stands beside torch's own rendezvous lines in the agent's output
log = get_logger(__name__)
# what the rules and the poll use
_NEEDED = ("_RendezvousJoinOp", "_RendezvousExitOp", "_Action", "_delay", "_should_keep_alive",
           "_remove_participant_epilogue")
_HANDLER_NEEDED = ("_op_executor", "_state_holder", "_settings")
_EXECUTOR_NEEDED = ("_mark_rendezvous_complete",)
_HOLDER_NEEDED = ("_cache_duration", "_sanitize", "_state", "_settings")
FIRST_ROUND_S = 120  # its default: a node whose start is slower than this joins at the next membership change
# The first round stops waiting this long before the join operation's deadline, where torch's own
# timeout would take a waiting participant out and fail the rendezvous.
JOIN_MARGIN_S = 10.0


def left_key(run_id: str, round_: int) -> str:
    """The store key that lists (one per line) the nodes that left `round_`,
    under the run's control prefix (runkey.py)."""
    return f"{runkey.control_prefix()}rendezvous.{run_id}.left.{round_}"


def unsupported(handler: Any = None) -> str | None:
    """Why this torch's c10d handler cannot take the rule and the poll (None: it can)."""
    missing = [name for name in _NEEDED if not hasattr(dyn, name)]
    if handler is not None:
        missing += [f"DynamicRendezvousHandler.{name}" for name in _HANDLER_NEEDED if not hasattr(handler, name)]
        if hasattr(handler, "_op_executor"):
            missing += [f"_DistributedRendezvousOpExecutor.{name}" for name in _EXECUTOR_NEEDED
                        if not hasattr(handler._op_executor, name)]
        if hasattr(handler, "_state_holder"):
            missing += [f"_BackendRendezvousStateHolder.{name}" for name in _HOLDER_NEEDED
                        if not hasattr(handler._state_holder, name)]
    return f"torch's dynamic rendezvous has no {', '.join(missing)}" if missing else None


class _Known:
    """Reads and writes the leaving record of one run in the rendezvous store."""

    def __init__(self, store: Store, run_id: str) -> None:
        self._store, self._run_id = store, run_id

    def leave(self, round_: int, node: object) -> None:
        # one atomic append on the store's server (every c10d store has it; torch's stub does not list it)
        self._store.append(left_key(self._run_id, round_), f"{node}\n")  # type: ignore[attr-defined]

    def left(self, round_: int) -> set[str]:
        key = left_key(self._run_id, round_)
        if not self._store.check([key]):  # get() would block until the store's timeout
            return set()
        return set(self._store.get(key).decode().split())


def _all_known_here(ctx: Any, known: _Known) -> bool:
    """A round in the making that every node known to come has joined."""
    state, settings = ctx.state, ctx.settings
    if state.complete or state.closed or state.round == 0 or state.deadline is None:
        return False
    here = {str(node) for node in state.participants}
    if ctx.node not in state.participants or not settings.min_nodes <= len(here) <= settings.max_nodes:
        return False
    # A node on the redundancy list is alive and waiting too: one restarted at once after it died finds the
    # last round still full (its old self counts until its keep-alive expires) and queues there.
    waiting = {str(node) for node in (*state.wait_list, *getattr(state, "redundancy_list", ()))}
    coming = known.left(state.round - 1) | waiting
    return bool(coming) and coming <= here


def _waiting(state: Any, node: Any) -> bool:
    """A node waiting for a round: in one not yet complete, or not in the complete one (its wait list)."""
    return not state.complete or node not in state.participants


def _silent(ctx: Any, silent_s: float) -> list[Any]:
    """The other participants whose last keep-alive is older than `silent_s`."""
    since = datetime.now(timezone.utc) - timedelta(seconds=silent_s)
    beats = ctx.state.last_heartbeats
    return [node for node in ctx.state.participants if node != ctx.node and node in beats and beats[node] < since]


def _sanitize(holder: Any, timing: AgentTiming) -> None:
    """torch's state holder's `_sanitize` (a node whose keep-alive is older than the expiry is removed),
    with this agent's expiry for each node (AgentTiming.expiry_s: a waiting node's is longer)."""
    state, now = holder._state, datetime.now(timezone.utc)
    holder._dead_nodes = [node for node, beat in state.last_heartbeats.items()
                          if beat < now - timedelta(seconds=timing.expiry_s(_waiting(state, node)))]
    removed = False
    for dead in holder._dead_nodes:
        log.info("rendezvous round %d: node %s silent past its expiry, removed", state.round, dead)
        del state.last_heartbeats[dead]
        removed = state.participants.pop(dead, None) is not None or removed
        state.wait_list.discard(dead)
        state.redundancy_list.discard(dead)
    if removed:
        dyn._remove_participant_epilogue(state, holder._settings)


def _alive_from_completion(inner: Any) -> None:
    """The node that completes a round (torch's `_mark_rendezvous_complete`, at the last call or as the
    last joiner) counts every participant's keep-alive from then: each was seen within silent_s, and its
    last one as a waiting node (waiting_keep_alive_s apart) may be older than a complete round's expiry."""
    complete = inner._mark_rendezvous_complete

    def and_alive() -> None:
        complete()
        now = datetime.now(timezone.utc)
        for node in inner._state.participants:
            inner._state.last_heartbeats[node] = now

    inner._mark_rendezvous_complete = and_alive


def _first_round_waits(ctx: Any, first_round: timedelta, op_deadline: float) -> bool:
    """Whether the first round, which torch would now close, stays open for
    the nodes still starting."""
    state = ctx.state
    if state.round != 0 or state.deadline is None or len(state.participants) >= ctx.settings.max_nodes:
        return False
    min_nodes_in = state.deadline - ctx.settings.timeout.last_call  # torch set the deadline when min_nodes joined
    return (datetime.now(timezone.utc) < min_nodes_in + first_round
            and time.monotonic() < op_deadline - JOIN_MARGIN_S)


class _Executor:
    """The handler's operation executor, with the rules added to its join and
    exit operations (every other operation passes through unchanged). Not a
    subclass of torch's private base, so that a torch without it still loads
    this module and `create` can fall back."""

    def __init__(self, inner: Any, known: _Known, first_round: timedelta, timing: AgentTiming | None = None,
                 holder: Any = None) -> None:
        self._inner, self._known, self._first_round = inner, known, first_round
        self._timing = timing or AgentTiming(1, timedelta(seconds=3), first_round)
        self._holder = holder  # its cache follows the polls (None: no cache to set)
        self._held_round = -1

    def _cache(self, seconds: float) -> None:
        if self._holder is not None:
            self._holder._cache_duration = seconds

    def run(self, state_handler: Callable[[Any, float], Any], deadline: float,
            update_deadline: Callable[[timedelta], float] | None = None) -> None:
        if isinstance(state_handler, dyn._RendezvousJoinOp):
            self._cache(self._timing.join_poll_s())
            _POLL.seconds = self._timing.join_poll_s
            try:
                self._inner.run(self._join(state_handler), deadline, update_deadline)
            finally:
                _POLL.seconds = None
                self._cache(self._timing.training_poll_s())
            return
        if isinstance(state_handler, dyn._RendezvousExitOp):
            state_handler = self._exit(state_handler)
        self._inner.run(state_handler, deadline, update_deadline)

    def _holds(self, ctx: Any, action: Any, deadline: float) -> bool:
        """Whether a round, which this action would complete, waits for a
        participant silent past AgentTiming.silent_s (it comes back, or expires
        and the round goes on without it)."""
        state = ctx.state
        completes = action == dyn._Action.MARK_RENDEZVOUS_COMPLETE or (
            action == dyn._Action.ADD_TO_PARTICIPANTS and len(state.participants) + 1 >= ctx.settings.max_nodes)
        if not completes or state.complete or time.monotonic() >= deadline - JOIN_MARGIN_S:
            return False
        silent = _silent(ctx, self._timing.silent_s())
        if silent and self._held_round != state.round:
            self._held_round = state.round
            log.info("rendezvous round %d: waiting for %s, silent for %.0f s, before it completes", state.round,
                     ", ".join(map(str, silent)), self._timing.silent_s())
        return bool(silent)

    def _keep_alive_due(self, ctx: Any) -> bool:
        """torch's rule, with a waiting node's longer interval (AgentTiming.waiting_keep_alive_s)."""
        if not dyn._should_keep_alive(ctx):
            return False
        if not _waiting(ctx.state, ctx.node):
            return True
        since = datetime.now(timezone.utc) - timedelta(seconds=self._timing.waiting_keep_alive_s())
        return bool(ctx.state.last_heartbeats[ctx.node] <= since)

    def _join(self, op: Callable[[Any, float], Any]) -> Callable[[Any, float], Any]:
        def decide(ctx: Any, deadline: float) -> Any:
            action = op(ctx, deadline)
            if (action == dyn._Action.MARK_RENDEZVOUS_COMPLETE and _first_round_waits(ctx, self._first_round,
                                                                                       deadline)) or \
                    self._holds(ctx, action, deadline):
                return dyn._Action.KEEP_ALIVE if self._keep_alive_due(ctx) else dyn._Action.SYNC
            if action == dyn._Action.KEEP_ALIVE and not self._keep_alive_due(ctx):
                action = dyn._Action.SYNC
            if action in (dyn._Action.SYNC, dyn._Action.KEEP_ALIVE) and _all_known_here(ctx, self._known):
                log.info("rendezvous round %d: every node that left round %d has joined; complete without "
                         "the last call", ctx.state.round, ctx.state.round - 1)
                return dyn._Action.MARK_RENDEZVOUS_COMPLETE
            return action
        return decide

    def _exit(self, op: Callable[[Any, float], Any]) -> Callable[[Any, float], Any]:
        def decide(ctx: Any, deadline: float) -> Any:
            action = op(ctx, deadline)
            # Written before the removal is synced, so whoever sees the next round sees this.
            if action == dyn._Action.REMOVE_FROM_PARTICIPANTS and ctx.state.complete:
                self._known.leave(ctx.state.round, ctx.node)
            return action
        return decide


class _Poll(threading.local):
    """The poll of the join operation running on this thread (None: the pause's own)."""

    seconds: Callable[[], float] | None = None


_POLL = _Poll()


class _Pause:
    """Stands in for torch's `_delay` in its dynamic rendezvous module. The
    executor's pause between two polls of the state is torch's only pause of
    a whole second: it becomes the running join's poll (`_POLL`, per thread:
    a process may hold several handlers), else `poll_s`. Every other pause
    (the first round's random skew) is torch's own."""

    def __init__(self, torch_delay: Callable[..., None], poll_s: float) -> None:
        self.torch_delay, self.poll_s = torch_delay, poll_s

    def __call__(self, seconds: float | tuple[float, float]) -> None:
        if seconds == 1:
            seconds = _POLL.seconds() if _POLL.seconds is not None else self.poll_s
        self.torch_delay(seconds=seconds)


def _poll_faster(handler: Any, poll_s: float) -> None:
    """Read the state every `poll_s` while waiting: the pause between polls
    (module-wide; each join operation sets its own on its thread) and the
    state holder's cache, which would otherwise answer from a second-old read."""
    torch_delay = dyn._delay.torch_delay if isinstance(dyn._delay, _Pause) else dyn._delay
    dyn._delay = _Pause(torch_delay, poll_s)
    handler._state_holder._cache_duration = poll_s


class _Named(dyn.RendezvousBackend):
    """The c10d backend under this handler's name: torchrun checks that a
    handler reports the backend it was asked for."""

    def __init__(self, inner: dyn.RendezvousBackend) -> None:
        self._inner = inner
        self.timing: AgentTiming | None = None  # told each round trip's time once create() has one
        self._failures = 0  # compare-and-sets failed in a row (rdzv_timing.cas_backoff_s)

    @property
    def name(self) -> str:
        return NAME

    def _timed(self, call: Callable[[], T]) -> T:
        began = time.monotonic()
        try:
            return call()
        finally:
            if self.timing is not None:
                self.timing.took(time.monotonic() - began)

    def get_state(self) -> tuple[bytes, Any] | None:
        return self._timed(self._inner.get_state)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        answer = self._timed(lambda: self._inner.set_state(state, token))
        if self.timing is None or answer is None:
            return answer
        self._failures = 0 if answer[2] else self._failures + 1
        if answer[2]:
            return answer
        # torch decides again on the state this answer holds and sends its write at once: after a pause,
        # the state read then, so that the write goes with a token that is fresh when it is sent
        time.sleep(random.uniform(0, cas_backoff_s(self._failures, self.timing.round_trip_s)))
        fresh = self.get_state()
        return answer if fresh is None else (fresh[0], fresh[1], False)


def create(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler for `params`, with the rule added. The run id is
    the rendered one tagged with the run key (runkey.rdzv_run_id): torch's
    rendezvous state is under a key no one who read the rendered files can
    name, on every node alike, since every node holds the same key."""
    params.run_id = runkey.rdzv_run_id(params.run_id)
    backend, store = create_backend(params)
    named = _Named(backend)
    handler = dyn.create_handler(store, named, params)
    why = unsupported(handler)
    if why:
        log.warning("ddpkit rendezvous: %s; using plain c10d (a loss waits the last call)", why)
        return handler
    first_round = timedelta(seconds=params.get_as_int(FIRST_ROUND_KEY, FIRST_ROUND_S) or 0)
    settings = handler._settings
    timing = AgentTiming(params.max_nodes, settings.keep_alive_interval * settings.keep_alive_max_attempt, first_round,
                     settings.keep_alive_interval.total_seconds())
    named.timing = timing
    holder = handler._state_holder
    holder._sanitize = lambda: _sanitize(holder, timing)  # type: ignore[attr-defined]
    _alive_from_completion(handler._op_executor)
    # the handler calls only run() on it
    handler._op_executor = _Executor(handler._op_executor, _Known(store, params.run_id),  # type: ignore[assignment]
                                     first_round, timing, holder)
    _poll_faster(handler, timing.join_poll_s())
    return handler


def creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torchrun calls it and registers the result."""
    return create


def register() -> None:
    """Register the handler with torch under its name, as the entry point
    would (torch accepts the same creator registered twice)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(NAME, create)
