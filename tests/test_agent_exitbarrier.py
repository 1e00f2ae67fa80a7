"""The agent that holds the job's store leaves torch's exit barrier last
(agent/exitbarrier.py): on a real TCP store, it waits until every agent
said it is through, no longer than LINGER_S for one that never does; the
others say so and go; which agent holds the store, from torchrun's line."""

from __future__ import annotations

import argparse
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ddpkit.agent import exitbarrier
from ddpkit.launch.local import free_port


def test_the_stores_holder_waits_until_every_agent_is_through_the_barrier() -> None:
    port = free_port()
    holder = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    other = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    seen: list[int] = []
    waiting = threading.Thread(target=lambda: seen.append(exitbarrier.through(holder, 2, holds_store=True)))
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive(), "the store's holder went before the other agent was through"
    assert exitbarrier.through(other, 2, holds_store=False) == 2  # the other says so and goes at once
    waiting.join(timeout=10)
    assert not waiting.is_alive() and seen == [2]


def test_the_holder_waits_no_longer_than_linger_for_an_agent_that_never_comes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exitbarrier, "LINGER_S", 0.5)
    holder = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30))
    assert exitbarrier.through(holder, 3, holds_store=True) == 1


def test_a_store_already_gone_ends_the_wait() -> None:
    port = free_port()
    holder = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    other = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    del holder  # the store's holder ended
    assert exitbarrier.through(other, 2, holds_store=False) == 0


def _args(backend: str, endpoint: str = "", conf: str = "", node_rank: int = 0) -> argparse.Namespace:
    return argparse.Namespace(rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_conf=conf, rdzv_id="job",
                              node_rank=node_rank)


@pytest.mark.parametrize(("args", "holds"), [
    (_args("static", node_rank=0), True),  # --master-addr: node 0's agent starts the store
    (_args("static", node_rank=1), False),
    (_args("c10d", "node0:29500", "is_host=1"), True),
    (_args("c10d", "127.0.0.1:29500", "is_host=0,join_timeout=60"), False),  # a launcher's or a service's store
    (_args("c10d", "127.0.0.1:29500"), True),  # no setting: the endpoint names this machine
    (_args("c10d", "10.255.255.1:29500"), False),
])
def test_which_agent_holds_the_store_comes_from_its_line(args: argparse.Namespace, holds: bool) -> None:
    assert exitbarrier.hosts_store(args) is holds
