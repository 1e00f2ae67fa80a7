"""ddpkit's rendezvous (src/ddpkit/rendezvous.py) with nodes that wait for
a round: a waiting node is judged silent by a longer expiry than a training
one, a round completes only with nodes that showed life lately, and their
keep-alives count from its completion.

The decisions on torch's own state objects; then four real handlers as
threads on one in-process store, one of them starved for longer than the
usual expiry while it waits in the first round: it is kept, and all four
form one round (torch's own expiry dropped it, and it joined again)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from ddpkit import rendezvous, runkey
from ddpkit.launch.local import free_port
from ddpkit.rdzv_store import hosted_store, rendezvous_state

RUN = "job-waiting"


def _node(name: str) -> dyn._NodeDesc:
    return dyn._NodeDesc(name, 1, 0)


def _state(participants: dict[str, float], complete: bool, waiting: dict[str, float] | None = None) -> Any:
    """A state whose nodes last kept alive the given seconds ago."""
    state = dyn._RendezvousState()
    now = datetime.now(timezone.utc)
    state.complete = complete
    for name, ago in participants.items():
        state.participants[_node(name)] = 0
        state.last_heartbeats[_node(name)] = now - timedelta(seconds=ago)
    for name, ago in (waiting or {}).items():
        state.wait_list.add(_node(name))
        state.last_heartbeats[_node(name)] = now - timedelta(seconds=ago)
    return state


class _Holder:
    def __init__(self, state: Any) -> None:
        self._state = state
        self._settings = dyn.RendezvousSettings(RUN, 2, 4, dyn.RendezvousTimeout(), timedelta(seconds=1), 3)
        self._dead_nodes: list[Any] = []


def _timing() -> rendezvous.AgentTiming:
    return rendezvous.AgentTiming(4, timedelta(seconds=3), timedelta(seconds=120), interval=1)


def test_a_waiting_node_is_kept_where_a_training_one_expires() -> None:
    forming = _Holder(_state({"a": 0, "slow": 10, "gone": 40}, complete=False))
    rendezvous._sanitize(forming, _timing())
    assert {n.addr for n in forming._state.participants} == {"a", "slow"}  # 10 s silent: still starting
    training = _Holder(_state({"a": 0, "lost": 4}, complete=True, waiting={"queued": 10}))
    rendezvous._sanitize(training, _timing())
    assert {n.addr for n in training._state.participants} == {"a"}  # the lost node: 3 s, a fast re-formation
    assert {n.addr for n in training._state.wait_list} == {"queued"}


def _ctx(state: Any, me: str = "a") -> dyn._RendezvousContext:
    settings = dyn.RendezvousSettings(RUN, 2, 3, dyn.RendezvousTimeout(), timedelta(seconds=1), 3)
    return dyn._RendezvousContext(_node(me), state, settings)


@pytest.mark.parametrize(("silent_s", "holds"), [(20, True), (5, False)])
def test_a_round_does_not_complete_with_a_node_silent_past_half_the_waiting_expiry(silent_s: float,
                                                                                  holds: bool) -> None:
    executor = rendezvous._Executor(None, rendezvous._Known(None, RUN), timedelta(seconds=120), _timing())  # type: ignore[arg-type]
    decide = executor._join(lambda ctx, deadline: dyn._Action.ADD_TO_PARTICIPANTS)  # the last joiner completes it
    ctx = _ctx(_state({"b": 0, "c": silent_s}, complete=False))
    want = dyn._Action.SYNC if holds else dyn._Action.ADD_TO_PARTICIPANTS
    assert decide(ctx, time.monotonic() + 600) == want


def test_the_completed_rounds_keep_alives_count_from_its_completion() -> None:
    class Inner:
        def __init__(self) -> None:
            self._state = _state({"a": 0, "b": 7}, complete=False)

        def _mark_rendezvous_complete(self) -> None:
            self._state.complete = True

    inner = Inner()
    rendezvous._alive_from_completion(inner)
    inner._mark_rendezvous_complete()
    recent = datetime.now(timezone.utc) - timedelta(seconds=1)
    assert inner._state.complete and all(beat > recent for beat in inner._state.last_heartbeats.values())


STALL_S = 5  # past the usual expiry (1 s x 3), within the waiting one


def _starved(handler: Any) -> None:
    """The handler's thread stops for STALL_S once it is a participant: a node still starting on a busy host."""
    holder, me, sync = handler._state_holder, handler._this_node, handler._state_holder.sync
    stalled = threading.Event()

    def slow_sync() -> Any:
        answer = sync()
        if not stalled.is_set() and me in holder.state.participants:
            stalled.set()
            time.sleep(STALL_S)
        return answer

    holder.sync = slow_sync


@pytest.mark.timeout(60)
def test_a_node_starved_while_it_waits_in_the_first_round_is_not_dropped() -> None:
    port, joined, errors = free_port(), {}, []
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2, "join_timeout": 40}
    with hosted_store("127.0.0.1", port) as store:
        handlers = [rendezvous.create(RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{port}", RUN, 4, 4,
                                                           local_addr="127.0.0.1", is_host=False, **conf))
                    for _ in range(4)]
        _starved(handlers[0])

        def join(i: int, after_s: float) -> None:
            time.sleep(after_s)
            try:
                info = handlers[i].next_rendezvous()
                joined[i] = (info.rank, info.world_size, handlers[i]._state_holder.state.round)
            except Exception as exc:  # said in the assertion below
                errors.append(f"node {i}: {exc!r}")
        # the starved node and two others wait; the fourth comes after the usual expiry is over
        threads = [threading.Thread(target=join, args=(i, after), daemon=True)
                   for i, after in ((0, 0), (1, 0.5), (2, 0.5), (3, STALL_S - 0.5))]
        for thread in threads:
            thread.start()
        seen: list[int] = []
        while any(thread.is_alive() for thread in threads) and len(seen) < 400:
            state = rendezvous_state(store, runkey.rdzv_run_id(RUN))
            if state is not None and not state.complete:
                seen.append(len(state.participants))
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=30)
        for handler in handlers:
            handler._stop_heartbeats()
    assert not errors, errors
    dropped = [i for i in range(1, len(seen)) if seen[i] < seen[i - 1]]
    assert not dropped, f"participants while the round formed: {seen}"
    assert sorted(rank for rank, _, _ in joined.values()) == [0, 1, 2, 3]
    assert {(world, round_) for _, world, round_ in joined.values()} == {(4, 0)}


def test_a_failed_compare_and_set_answers_with_the_state_read_after_its_pause() -> None:
    """torch writes again at once on what the failed write's answer holds: a token read after the
    pause, not the one the pause made stale."""
    class Inner:
        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool]:
            return (b"then", 1, False)

        def get_state(self) -> tuple[bytes, Any]:
            return (b"now", 2)

    named = rendezvous._Named(Inner())  # type: ignore[arg-type]
    named.timing = _timing()
    assert named.set_state(b"mine", 0) == (b"now", 2, False)
    assert named._failures == 1
