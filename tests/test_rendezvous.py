"""ddpkit's rendezvous handler (src/ddpkit/rendezvous.py): torch's c10d
rendezvous, with the round after a loss completed once every node that left
the last round is back, instead of after the last call.

The rule's decision is checked on torch's own state objects and a real
in-process store; the whole handler on three real processes, each one
torchrun agent's rendezvous as torchrun builds it (the registry, through
the entry point), one of them SIGKILLed."""

from __future__ import annotations

import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest
from bench import rdzv_node
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers

from ddpkit import rendezvous, runkey
from ddpkit.launch.local import free_port
from ddpkit.rdzv_store import rendezvous_state
from ddpkit.rdzv_timing import state_poll_s

RUN = "job-1"


def _node(name: str) -> dyn._NodeDesc:
    return dyn._NodeDesc(name, 1, 0)


def _ctx(me: str, here: list[str], round_: int = 1, waiting: tuple[str, ...] = (), min_nodes: int = 2,
         max_nodes: int = 3, redundant: tuple[str, ...] = ()) -> dyn._RendezvousContext:
    state = dyn._RendezvousState()
    state.round = round_
    state.participants = {_node(n): 0 for n in here}
    state.wait_list = {_node(n) for n in waiting}
    state.redundancy_list = {_node(n) for n in redundant}
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=30) if len(here) >= min_nodes else None
    settings = dyn.RendezvousSettings(RUN, min_nodes, max_nodes, dyn.RendezvousTimeout(),
                                      timedelta(seconds=1), 2)
    return dyn._RendezvousContext(_node(me), state, settings)


def _known(*left: str, round_: int = 0) -> rendezvous._Known:
    known = rendezvous._Known(HashStore(), RUN)
    for name in left:
        known.leave(round_, _node(name))
    return known


def test_this_torch_has_what_the_rule_wraps() -> None:
    assert rendezvous.unsupported() is None


@pytest.mark.parametrize(("here", "left", "waiting", "me", "complete"), [
    (["a", "b"], ["a", "b"], (), "a", True),  # the lost node c never left: it is not waited for
    (["a", "b"], ["a", "b", "c"], (), "a", False),  # c left and is on its way
    (["a", "b", "d"], ["a", "b"], ("d",), "a", True),  # d was waiting and has joined
    (["a", "b"], ["a", "b"], ("d",), "a", False),  # d was waiting and has not joined yet
    (["a"], ["a"], (), "a", False),  # below min_nodes: no round to complete
    (["a", "b"], ["a", "b"], (), "z", False),  # only a participant completes the round
    (["a", "b"], [], (), "a", False),  # nobody left a round (it expired whole): the last call decides
])
def test_a_round_is_complete_once_every_node_known_to_come_has_joined(
        here: list[str], left: list[str], waiting: tuple[str, ...], me: str, complete: bool) -> None:
    assert rendezvous._all_known_here(_ctx(me, here, waiting=waiting), _known(*left)) is complete


def test_a_node_queued_on_the_redundancy_list_is_waited_for() -> None:
    """Node c died and was started again at once: the last round was still full (its dead self
    counted until its keep-alive expired), so the new c queued on the redundancy list."""
    assert not rendezvous._all_known_here(_ctx("a", ["a", "b"], redundant=("c2",)), _known("a", "b"))
    assert rendezvous._all_known_here(_ctx("a", ["a", "b", "c2"], redundant=("c2",)), _known("a", "b"))


def test_the_first_round_and_other_rounds_keep_the_last_call() -> None:
    assert not rendezvous._all_known_here(_ctx("a", ["a", "b"], round_=0), _known("a", "b"))
    # the record read is the one of the round before, not another
    assert not rendezvous._all_known_here(_ctx("a", ["a", "b"], round_=5), _known("a", "b", round_=3))


def _first_round(here: list[str], min_nodes_in_s_ago: float, round_: int = 0) -> dyn._RendezvousContext:
    """A round torch would close now: min_nodes joined `min_nodes_in_s_ago`, its last call (30 s) is over."""
    ctx = _ctx("a", here, round_=round_)
    ctx.state.deadline = datetime.now(timezone.utc) - timedelta(seconds=min_nodes_in_s_ago) + ctx.settings.timeout.last_call
    return ctx


@pytest.mark.parametrize(("here", "since_s", "round_", "op_left_s", "waits"), [
    (["a", "b"], 40, 0, 600, True),  # the first round, a node still starting: wait, within first_round (120 s)
    (["a", "b"], 130, 0, 600, False),  # first_round is over: it closes with the nodes that came
    (["a", "b"], 40, 0, 5, False),  # the join operation's own deadline is near: close rather than time out
    (["a", "b", "c"], 40, 0, 600, False),  # every node is in (torch completes it at max_nodes anyway)
    (["a", "b"], 40, 1, 600, False),  # a later round: the last call as torch's (or the rule after a loss)
])
def test_the_first_round_waits_for_the_nodes_still_starting(
        here: list[str], since_s: float, round_: int, op_left_s: float, waits: bool) -> None:
    ctx = _first_round(here, since_s, round_)
    first_round = timedelta(seconds=rendezvous.FIRST_ROUND_S)
    assert rendezvous._first_round_waits(ctx, first_round, time.monotonic() + op_left_s) is waits


def test_the_first_rounds_wait_keeps_the_node_alive_instead_of_closing() -> None:
    """Where torch's join says close, the wrapped join syncs (or sends its keep-alive) and waits on."""
    executor = rendezvous._Executor(None, _known(), timedelta(seconds=rendezvous.FIRST_ROUND_S))
    decide = executor._join(lambda ctx, deadline: dyn._Action.MARK_RENDEZVOUS_COMPLETE)
    ctx = _first_round(["a", "b"], 40)
    ctx.state.last_heartbeats[ctx.node] = datetime.now(timezone.utc)  # a fresh keep-alive: no new one due
    assert decide(ctx, time.monotonic() + 600) == dyn._Action.SYNC
    ctx.state.last_heartbeats[ctx.node] = datetime.now(timezone.utc) - timedelta(seconds=5)
    assert decide(ctx, time.monotonic() + 600) == dyn._Action.KEEP_ALIVE
    assert decide(_first_round(["a", "b"], 130), time.monotonic() + 600) == dyn._Action.MARK_RENDEZVOUS_COMPLETE


def test_the_entry_point_registers_the_handler() -> None:
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    _register_out_of_tree_handlers()
    assert rendezvous_handler_registry._registry.get(rendezvous.NAME) is rendezvous.create
    rendezvous.register()  # the agent's own registration, where the entry point may be missing: the same creator
    rendezvous.register()
    assert rendezvous_handler_registry._registry.get(rendezvous.NAME) is rendezvous.create


def test_a_waiting_agent_polls_the_state_every_state_poll_s() -> None:
    """The executor's 1 s pause between polls, and only it, becomes the poll;
    the state holder's cache follows, or a poll would answer from a second-old read."""
    paused: list[object] = []
    pause = rendezvous._Pause(lambda seconds: paused.append(seconds), 0.1)
    pause(seconds=1)
    pause(seconds=(0, 0.3))  # the first round's random skew stays torch's
    assert paused == [0.1, (0, 0.3)]
    params = dyn.RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{free_port()}", RUN, 2, 130, is_host=True,
                                      local_addr="127.0.0.1")
    torch_delay = dyn._delay
    try:
        handler = rendezvous.create(params)
        assert isinstance(dyn._delay, rendezvous._Pause) and dyn._delay.torch_delay is torch_delay
        assert dyn._delay.poll_s == handler._state_holder._cache_duration == state_poll_s(130) == 0.3
        rendezvous.create(params)  # a second handler replaces the pause, it does not wrap it
        assert dyn._delay.torch_delay is torch_delay
    finally:
        dyn._delay = torch_delay


LAST_CALL_S = 30  # what the round after the loss would wait without the rule
CONF = {"last_call_timeout": LAST_CALL_S, "keep_alive_interval": 1, "keep_alive_max_attempt": 2, "join_timeout": 60}


def _agent(backend: str, port: int, host: bool) -> subprocess.Popen[str]:
    return rdzv_node.start(backend, port, RUN, (2, 3), host, CONF, env={"LOGLEVEL": "INFO"})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_round_after_a_killed_node_completes_without_the_last_call() -> None:
    port = free_port()
    agents = [_agent(rendezvous.NAME, port, host=i == 0) for i in range(3)]
    try:
        first = [rdzv_node.joined(a) for a in agents]
        assert sorted(j["rank"] for j in first) == [0, 1, 2] and {j["world_size"] for j in first} == {3}
        agents[2].send_signal(signal.SIGKILL)
        agents[2].wait(timeout=10)
        lost_at = time.time()
        rdzv_node.next_round(agents[:2])  # their workers failed: both agents go to the next round
        second = [rdzv_node.joined(a) for a in agents[:2]]
        assert sorted(j["rank"] for j in second) == [0, 1] and {j["world_size"] for j in second} == {2}
        took = max(j["at"] for j in second) - lost_at
        # the keep-alive expiry (2 s) and a few 0.1 s polls; the last call alone would be 30 s
        assert took < LAST_CALL_S - 5, f"the round after the loss took {took:.1f}s"
        logs = [a.communicate(input="", timeout=30)[1] for a in agents[:2]]  # EOF: each leaves and ends
        # and it was the rule that completed the round, on one of the two survivors
        assert any("complete without the last call" in log for log in logs), logs
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()


def _last_call_over(port: int, run_id: str, timeout: float = 60) -> None:
    """Wait until the first round has min_nodes in and its last call is over (torch's c10d state in the store)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    give_up = time.monotonic() + timeout
    while (state := rendezvous_state(store, run_id)) is None or (state.deadline is None and not state.complete):
        assert time.monotonic() < give_up, "the two early agents never had a round of two"
        time.sleep(0.1)
    if state.deadline is not None:  # torch clears it when it closes the round
        time.sleep(max(0.0, (state.deadline - datetime.now(timezone.utc)).total_seconds()) + 2)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("first_round_s", [None, 0])
def test_a_node_later_than_the_last_call_is_in_the_first_round(first_round_s: int | None) -> None:
    """Two agents are in and the last call (2 s) is over when the third
    starts. None (the default wait): one first round of all three. 0 (the
    last call alone, as torch's c10d): the first round closed with two, the
    control."""
    port = free_port()
    conf = {**CONF, "last_call_timeout": 2,
            **({rendezvous.FIRST_ROUND_KEY: first_round_s} if first_round_s is not None else {})}
    early = [rdzv_node.start(rendezvous.NAME, port, RUN, (2, 3), i == 0, conf) for i in range(2)]
    agents = list(early)
    try:
        _last_call_over(port, runkey.rdzv_run_id(RUN))
        agents.append(rdzv_node.start(rendezvous.NAME, port, RUN, (2, 3), False, conf))
        first = [rdzv_node.joined(a) for a in (agents if first_round_s is None else early)]
        want = 3 if first_round_s is None else 2
        assert sorted(j["rank"] for j in first) == list(range(want)) and {j["world_size"] for j in first} == {want}
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
