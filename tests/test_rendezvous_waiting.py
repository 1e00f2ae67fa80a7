"""ddpkit's rendezvous (src/ddpkit/rendezvous/handler.py) with nodes that wait for
a round: a waiting node is judged silent by a longer expiry than a training
one, and a round closes only with nodes that showed life lately.

Four real handlers as threads on one real store, one of them starved (no
keep-alive) for longer than the usual expiry while it waits in the first
round: it is waited for, and all four form one round 0."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from ddpkit.launch.local import free_port
from ddpkit.rdzv_store import hosted_store, job_state
from ddpkit.rendezvous import handler as rendezvous
from ddpkit.rendezvous import runkey
from ddpkit.rendezvous.members import Membership

RUN = "job-waiting"
STALL_S = 5  # past the usual expiry (1 s x 3), within the waiting one


def _starved(handler: rendezvous.Handler) -> None:
    """The handler's keep-alives stop for STALL_S after its join: a node still starting on a busy host."""
    members, first = handler._members, threading.Event()
    keep_alive = members.keep_alive
    began: list[float] = []

    def late(node: str, now: float) -> None:
        if not first.is_set():
            first.set()
            began.append(time.monotonic())
            keep_alive(node, now)
        elif time.monotonic() - began[0] >= STALL_S:
            keep_alive(node, now)

    members.keep_alive = late  # type: ignore[method-assign]


@pytest.mark.timeout(60)
def test_a_node_starved_while_it_waits_in_the_first_round_is_waited_for() -> None:
    port, joined, errors = free_port(), {}, []
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2, "join_timeout": 40}
    with hosted_store("127.0.0.1", port) as store:
        handlers = [rendezvous.create(RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{port}", RUN, 4, 4,
                                                           local_addr="127.0.0.1", is_host=False, **conf))
                    for _ in range(4)]
        _starved(handlers[0])  # type: ignore[arg-type]

        def join(i: int, after_s: float) -> None:
            time.sleep(after_s)
            try:
                info = handlers[i].next_rendezvous()
                joined[i] = (info.rank, info.world_size, handlers[i].round)  # type: ignore[attr-defined]
            except Exception as exc:  # said in the assertion below
                errors.append(f"node {i}: {exc!r}")
        # the starved node and two others wait; the fourth comes after the usual expiry is over
        threads = [threading.Thread(target=join, args=(i, after), daemon=True)
                   for i, after in ((0, 0), (1, 0.5), (2, 0.5), (3, STALL_S - 1.5))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=40)
        summary: Any = job_state(store, runkey.rdzv_run_id(RUN))
        waited = Membership(store, runkey.rdzv_run_id(RUN)).members(0)
        for handler in handlers:
            handler.stop_keep_alive()  # type: ignore[attr-defined]
    assert not errors, errors
    assert sorted(rank for rank, _, _ in joined.values()) == [0, 1, 2, 3]
    assert {(world, round_) for _, world, round_ in joined.values()} == {(4, 0)}
    assert waited is not None and len(waited[1]) == 4
    # the store service's watch sees the job (one closed round, four nodes' keep-alives), not yet closed
    assert summary.round == 1 and len(summary.last_heartbeats) == 4 and not summary.closed
