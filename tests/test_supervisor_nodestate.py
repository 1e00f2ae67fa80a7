"""Each node's one state in a supervised run (launch/supervise/nodestate.py):
every move TRANSITIONS allows is made, every other raises, and a revived
node's track keeps why it failed."""

from __future__ import annotations

import pytest

from ddpkit.launch.supervise.nodestate import TRANSITIONS, NodeState, NodeTrack, NodeTransitionError

S = NodeState


class _Node:
    def __init__(self, index: int) -> None:
        self.index, self.host, self.label = index, f"h{index}", f"node{index}"


# Why each move happens; the table below must name every one TRANSITIONS allows, and no other.
ALLOWED = [
    (S.NOT_STARTED, S.RUNNING),  # started
    (S.RUNNING, S.STOPPING_LOST),  # the job's watchdog found it silent
    (S.RUNNING, S.FINISHED),  # exit 0
    (S.RUNNING, S.FAILED),  # exit non-zero: fail fast
    (S.RUNNING, S.AWAY),  # elastic: the job goes on, its host is revived
    (S.RUNNING, S.EXCLUDED),  # elastic: at its last allowed failure
    (S.RUNNING, S.STOPPED),  # still running when every node was stopped
    (S.STOPPING_LOST, S.FINISHED),
    (S.STOPPING_LOST, S.FAILED),
    (S.STOPPING_LOST, S.AWAY),
    (S.STOPPING_LOST, S.EXCLUDED),
    (S.STOPPING_LOST, S.STOPPED),
    (S.AWAY, S.RUNNING),  # its host answered again
    (S.AWAY, S.EXCLUDED),  # the run ended first
]
REFUSED = [(a, b) for a in NodeState for b in NodeState if (a, b) not in ALLOWED]


def test_the_table_allows_exactly_these_moves() -> None:
    assert {(a, b) for a, moves in TRANSITIONS.items() for b in moves} == set(ALLOWED)
    assert set(TRANSITIONS) == set(NodeState)


@pytest.mark.parametrize(("start", "to"), ALLOWED, ids=lambda s: s.name)
def test_an_allowed_move_is_made(start: NodeState, to: NodeState) -> None:
    track = NodeTrack(_Node(1), start)  # type: ignore[arg-type]  # _Node has what a track reads
    before = track.moved
    track.move(to)
    assert track.state is to and track.moved > before


@pytest.mark.parametrize(("start", "to"), REFUSED, ids=lambda s: s.name)
def test_any_other_move_raises_and_leaves_the_state(start: NodeState, to: NodeState) -> None:
    track = NodeTrack(_Node(1), start)  # type: ignore[arg-type]
    with pytest.raises(NodeTransitionError, match=f"node 1: no move from {start.value} to {to.value}"):
        track.move(to)
    assert track.state is start


def test_only_running_and_stopping_lost_are_live() -> None:
    assert {s for s in NodeState if s.live} == {S.RUNNING, S.STOPPING_LOST}


def test_a_revived_node_runs_as_its_new_handle_and_keeps_why_it_failed() -> None:
    old, new = _Node(2), _Node(2)
    track = NodeTrack(old, S.RUNNING, own_exit=True)  # type: ignore[arg-type]
    track.move(S.AWAY)
    assert track.failures == 1
    track.rejoin(new, "exit status 137")  # type: ignore[arg-type]
    assert track.node is new and track.state is S.RUNNING and not track.own_exit
    assert track.rejoined_after == ["exit status 137"] and track.failures == 1
    track.move(S.EXCLUDED)
    assert track.failures == 2


def test_a_node_that_was_never_away_cannot_rejoin() -> None:
    track = NodeTrack(_Node(0), S.RUNNING)  # type: ignore[arg-type]
    with pytest.raises(NodeTransitionError):
        track.rejoin(_Node(0), "exit status 1")  # type: ignore[arg-type]
    assert track.rejoined_after == []
