"""The timing rules of ddpkit's rendezvous (src/ddpkit/rendezvous/timing.py): how
often an agent polls and keeps alive, and when it judges another silent, as
the node count and its measured round trip to the store grow. Arithmetic
only: no store, no torch."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ddpkit.rendezvous import timing as t


@pytest.mark.parametrize(("nodes", "round_trip_s", "poll_s"), [
    (16, 0.0, 0.1),  # a waiting agent polls fast on an idle store: a membership change seen within 0.1 s
    (1024, 0.0, 0.2),  # a tenth of a second per 512 nodes
    (16, 0.05, 0.5),  # a slow store (or the agent's starved CPU): it backs off, ten round trips a poll
    (16, 2.0, 1.0),  # never slower than torch's second
    (10_000, 0.0, 1.0),
])
def test_a_waiting_agent_polls_by_the_node_count_and_its_round_trip(nodes: int, round_trip_s: float,
                                                                   poll_s: float) -> None:
    assert t.join_poll_s(nodes, round_trip_s) == poll_s


@pytest.mark.parametrize("nodes", [16, 64, 128, 256, 512, 1024, 4096])
def test_training_agents_read_the_state_a_bounded_number_of_times_a_second(nodes: int) -> None:
    """The reads' bytes grow as N (the state's size) and not N²: N agents together
    read about TRAINING_READS_PER_S a second (up to the cap), never faster than a waiting one."""
    poll = t.training_poll_s(nodes)
    assert poll >= t.join_poll_s(nodes)
    assert nodes / poll <= max(t.TRAINING_READS_PER_S, nodes / t.TRAINING_POLL_MAX_S) + 1e-6
    assert poll <= t.TRAINING_POLL_MAX_S


def test_training_agents_reads_are_flat_in_the_node_count() -> None:
    reads = {n: n / t.training_poll_s(n) for n in (64, 128, 256, 512)}
    assert max(reads.values()) <= t.TRAINING_READS_PER_S + 1e-6


@pytest.mark.parametrize(("expiry", "first_round_s", "round_trip_s", "waiting"), [
    (3, 120, 0.0, 30.0),  # a waiting node: 30 s where a training one expires after 3
    (3, 10, 0.0, 10.0),  # never past the spec's first_round_s
    (3, 0, 0.0, 3.0),  # first_round_s 0: torch's rule, the usual expiry
    (9, 5, 0.0, 9.0),  # never less than the usual one
    (3, 120, 5.0, 50.0),  # a store slower than that: ten round trips
])
def test_a_waiting_node_expires_later_within_the_first_rounds_bound(expiry: float, first_round_s: float,
                                                                    round_trip_s: float, waiting: float) -> None:
    assert t.waiting_expiry_s(expiry, first_round_s, round_trip_s) == waiting


@pytest.mark.parametrize(("round_trip_s", "usual"), [(0.0, 3.0), (0.01, 3.0), (0.5, 5.0)])
def test_a_training_nodes_expiry_stays_the_keep_alives_unless_the_store_is_slower(round_trip_s: float,
                                                                                   usual: float) -> None:
    """What a re-formation after a loss waits for: 3 s on a healthy store."""
    assert t.expiry_s(3, round_trip_s) == usual


def test_an_agents_timing_follows_its_measured_round_trip() -> None:
    timing = t.AgentTiming(16, timedelta(seconds=3), timedelta(seconds=120), interval=1)
    assert (timing.expiry_s(waiting=False), timing.expiry_s(waiting=True), timing.silent_s()) == (3, 30, 15)
    assert (timing.join_poll_s(), timing.training_poll_s()) == (0.1, 0.25)
    for _ in range(50):  # a store that answers in 0.2 s
        timing.took(0.2)
    assert timing.round_trip_s == pytest.approx(0.2, rel=1e-3)
    assert timing.join_poll_s() == 1.0 and timing.expiry_s(waiting=False) == pytest.approx(3.0)
    timing.took(0.2 + 5 * 0.8)  # one slow answer moves the average a fifth of the way
    assert timing.round_trip_s == pytest.approx(1.0, rel=1e-3)
    assert timing.expiry_s(waiting=False) == pytest.approx(10.0, rel=1e-3)
