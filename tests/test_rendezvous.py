"""ddpkit's rendezvous handler (src/ddpkit/rendezvous/handler.py, its membership
rdzv_members.py): a key per node; the round after a loss closes once every
node of the last round has joined it or is lost, instead of after the last
call; the first round waits for the nodes still starting.

The rule's decision (rdzv_members.decide) is checked on its own; the whole
handler on three real processes, each one torchrun agent's rendezvous as
torchrun builds it (the registry, through the entry point), one of them
SIGKILLed, and on a real store in this process."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import threading
import time

import pytest
from bench import rdzv_node
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers

from ddpkit.launch.local import free_port
from ddpkit.rdzv_store import hosted_store
from ddpkit.rendezvous import handler as rendezvous
from ddpkit.rendezvous import runkey
from ddpkit.rendezvous.members import Membership, Rules, View, decide

RUN = "job-1"
RULES = Rules(min_nodes=2, max_nodes=3, last_call_s=30, first_round_s=120, expiry_s=3, waiting_expiry_s=30,
              silent_s=15)
NOW = 1000.0


def _view(joined: list[str], round_: int = 1, previous: list[str] | None = None, silent: dict[str, float] | None = None,
          left: tuple[str, ...] = (), min_at_ago: float | None = 1.0) -> View:
    """Round `round_` with `joined` in it, every node seen just now but the `silent` ones (seconds ago);
    the last round (`previous`) closed 10 s ago."""
    nodes = {*joined, *(previous or ())}
    seen = {n: NOW - (silent or {}).get(n, 0.0) for n in nodes if n not in left}
    return View(round_, joined, seen, frozenset(left), previous, NOW - 10,
                None if min_at_ago is None else NOW - min_at_ago, NOW)


@pytest.mark.parametrize(("joined", "previous", "silent", "left", "closes"), [
    (["a", "b"], ["a", "b", "c"], {"c": 4}, (), True),  # c is lost (silent past 3 s): not waited for
    (["a", "b"], ["a", "b", "c"], {"c": 1}, (), False),  # c trains on, or is on its way
    (["a", "b"], ["a", "b", "c"], {}, ("c",), True),  # c left
    (["d", "a", "b"], ["a", "b"], {}, (), True),  # d was waiting and is in: max_nodes
    (["a"], ["a", "b"], {"b": 5}, (), False),  # below min_nodes: no round to close
    (["d", "e"], ["a", "b"], {"a": 5, "b": 5}, (), False),  # nobody of the last round came: the last call decides
])
def test_a_round_closes_once_every_node_of_the_last_round_has_joined_or_is_lost(
        joined: list[str], previous: list[str], silent: dict[str, float], left: tuple[str, ...], closes: bool) -> None:
    decision = decide(_view(joined, previous=previous, silent=silent, left=left), RULES)
    assert (decision.members is not None) is closes, decision
    if closes:
        assert set(decision.members or ()) == set(joined) - set(left)


def test_the_last_rounds_members_keep_the_first_ranks_and_max_nodes_cap_the_round() -> None:
    decision = decide(_view(["x", "b", "y", "a", "z"], previous=["a", "b", "c"], left=("c",)), RULES)
    assert decision.members == ["a", "b", "x"]  # y and z wait for the next round, without a restart


def test_a_first_rounds_ranks_follow_the_node_names_not_the_order_they_joined_in() -> None:
    decision = decide(_view(["c", "a", "b"], round_=0, min_at_ago=0), RULES)
    assert decision.members == ["a", "b", "c"]  # torch's order: its participants' sorted node descriptors
    later = decide(_view(["z", "b", "y"], previous=["b"], round_=1), RULES)
    assert later.members == ["b", "y", "z"]  # the survivor keeps rank 0; the newcomers ranked by name


@pytest.mark.parametrize(("joined", "min_at_ago", "round_", "near", "closes"), [
    (["a", "b"], 40, 0, False, False),  # the first round, a node still starting: wait, within first_round (120 s)
    (["a", "b"], 130, 0, False, True),  # first_round is over: it closes with the nodes that came
    (["a", "b"], 40, 0, True, True),  # the join's own deadline is near: close rather than time out
    (["a", "b", "c"], 0, 0, False, True),  # every node is in
    (["a", "b"], 40, 1, False, True),  # a later round where nobody's membership is known: the last call (30 s)
    (["a", "b"], None, 0, False, False),  # min_nodes just came: the last call starts
])
def test_the_first_round_waits_for_the_nodes_still_starting(joined: list[str], min_at_ago: float | None,
                                                           round_: int, near: bool, closes: bool) -> None:
    decision = decide(_view(joined, round_=round_, min_at_ago=min_at_ago), RULES, deadline_near=near)
    assert (decision.members is not None) is closes, decision
    assert decision.min_in


@pytest.mark.parametrize(("silent_s", "members", "waiting_for"), [
    (20, None, ["c"]),  # held for c: it comes back, or expires and the round goes on without it
    (5, ["a", "b", "c"], []),  # a starting node's late keep-alive: counted
    (40, None, []),  # past the waiting expiry: c is gone, and two of three wait for the last call
])
def test_a_round_does_not_close_with_a_node_silent_past_half_the_waiting_expiry(
        silent_s: float, members: list[str] | None, waiting_for: list[str]) -> None:
    decision = decide(_view(["a", "b", "c"], round_=0, silent={"c": silent_s}), RULES)
    assert (decision.members, decision.waiting_for) == (members, waiting_for)


def test_the_entry_point_registers_the_handler() -> None:
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    _register_out_of_tree_handlers()
    assert rendezvous_handler_registry._registry.get(rendezvous.NAME) is rendezvous.create
    rendezvous.register()  # the agent's own registration, where the entry point may be missing: the same creator
    rendezvous.register()
    assert rendezvous_handler_registry._registry.get(rendezvous.NAME) is rendezvous.create


def _handlers(port: int, count: int, nodes: tuple[int, int], **conf: int) -> list[rendezvous.Handler]:
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2, "join_timeout": 40,
            **conf}
    return [rendezvous.create(RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{port}", RUN, *nodes,
                                                   local_addr="127.0.0.1", is_host=False, **conf))
            for _ in range(count)]  # type: ignore[misc]


def _join_all(handlers: list[rendezvous.Handler], delays: list[float]) -> dict[int, tuple[int, int, int]]:
    joined: dict[int, tuple[int, int, int]] = {}
    errors: list[str] = []

    def join(i: int) -> None:
        time.sleep(delays[i])
        try:
            info = handlers[i].next_rendezvous()
            joined[i] = (info.rank, info.world_size, handlers[i].round or 0)
        except Exception as exc:  # said in the assertion below
            errors.append(f"node {i}: {exc!r}")
    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return joined


@pytest.mark.timeout(60)
def test_a_full_round_lets_a_newcomer_wait_without_restarting_the_others_and_shutdown_closes() -> None:
    """Three of max 3 in round 0; a fourth waits in round 1, which the others do not restart for
    (num_nodes_waiting 0); one leaves gracefully (shutdown): the rendezvous is closed for everyone, and the
    membership keys are under the run key's id only."""
    port = free_port()
    with hosted_store("127.0.0.1", port) as store:
        handlers = _handlers(port, 4, (2, 3))
        joined = _join_all(handlers[:3], [0, 0, 0])
        assert sorted(rank for rank, _, _ in joined.values()) == [0, 1, 2]
        assert {(world, round_) for _, world, round_ in joined.values()} == {(3, 0)}
        late = threading.Thread(target=lambda: pytest.raises(RendezvousClosedError, handlers[3].next_rendezvous),
                                daemon=True)
        late.start()
        members = Membership(store, runkey.rdzv_run_id(RUN))
        while members.count(1) == 0:
            time.sleep(0.05)
        assert [h.num_nodes_waiting() for h in handlers[:3]] == [0, 0, 0]
        assert handlers[0].shutdown() and all(h.is_closed() for h in handlers)
        late.join(timeout=10)
        assert not late.is_alive()
        for handler in handlers:
            handler.stop_keep_alive()


@pytest.mark.timeout(90)
def test_the_stores_host_ends_after_the_other_members_left_or_went_silent() -> None:
    """The agent whose process holds the job's store stays, as it ends, until
    every other member of its round has left (their exit barrier and leave
    find the store there), and no longer than a silent member's expiry."""
    port = free_port()
    with hosted_store("127.0.0.1", port):
        handlers = _handlers(port, 3, (3, 3), keep_alive_interval=2, keep_alive_max_attempt=3)
        _join_all(handlers, [0, 0, 0])
        host, live, silent = handlers
        host._hosts_store = True  # as torch's c10d backend started the store in its process
        ending = threading.Thread(target=host.shutdown, daemon=True)
        ending.start()
        ending.join(timeout=1.0)
        assert ending.is_alive(), "the store's host ended while the others were still members"
        assert live.shutdown()
        silent.stop_keep_alive()  # gone without leaving: a lost node
        ending.join(timeout=30)
        assert not ending.is_alive(), "the store's host waited past a silent member's expiry"
    assert rendezvous.hosts_store(RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{port}", RUN, 1, 1, is_host=False)) \
        is False
    assert rendezvous.hosts_store(RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{port}", RUN, 1, 1)) is True


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
        # EOF to both at once: each leaves and ends, the store's host (agent 0) once the other left
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            logs = [out[1] for out in pool.map(lambda a: a.communicate(input="", timeout=30), agents[:2])]
        # and it was the rule that completed the round, on one of the two survivors
        assert any("complete without the last call" in log for log in logs), logs
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()


def _last_call_over(port: int, run_id: str, last_call_s: float, timeout: float = 60) -> None:
    """Wait until the first round has min_nodes in and its last call is over (the membership in the store)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    members, give_up = Membership(store, run_id), time.monotonic() + timeout
    while (min_at := members.min_at(0, None)) is None and members.members(0) is None:
        assert time.monotonic() < give_up, "the two early agents never had a round of two"
        time.sleep(0.1)
    if min_at is not None:
        time.sleep(max(0.0, min_at + last_call_s - time.time()) + 2)


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
        _last_call_over(port, runkey.rdzv_run_id(RUN), 2)
        agents.append(rdzv_node.start(rendezvous.NAME, port, RUN, (2, 3), False, conf))
        first = [rdzv_node.joined(a) for a in (agents if first_round_s is None else early)]
        want = 3 if first_round_s is None else 2
        assert sorted(j["rank"] for j in first) == list(range(want)) and {j["world_size"] for j in first} == {want}
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()


@pytest.mark.timeout(60)
def test_a_round_whose_first_joiners_died_is_closed_by_a_later_one() -> None:
    """The three first joiners of round 0 (the nodes that close it) died right after their join: a later
    joiner sees them silent past the waiting expiry (first_round_timeout 4 s) and closes the round itself."""
    port = free_port()
    with hosted_store("127.0.0.1", port) as store:
        members = Membership(store, runkey.rdzv_run_id(RUN))
        for i in range(3):
            members.keep_alive(f"dead-{i}", time.time() - 100)
            members.join(0, f"dead-{i}")
        handlers = _handlers(port, 2, (2, 2), **{rendezvous.FIRST_ROUND_KEY: 4})
        joined = _join_all(handlers, [0, 0])
        closed = members.members(0)
        for handler in handlers:
            handler.stop_keep_alive()
    assert sorted(rank for rank, _, _ in joined.values()) == [0, 1]
    assert {(world, round_) for _, world, round_ in joined.values()} == {(2, 0)}
    assert closed is not None and not any(n.startswith("dead-") for n in closed[1])
