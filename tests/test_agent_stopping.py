"""The agent on a stop signal (agent/stopping.py), without starting torchrun:
the first stop signal raises torch's SignalException, a repeat while it
stops its workers is noted instead, torch's shutdown chatter is dropped,
and one line says how the node's workers ended. The same through a real
agent: tests/test_preempt_torchrun.py."""

from __future__ import annotations

import logging
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.api import SignalException

from ddpkit.agent import stopping


@pytest.fixture
def last(monkeypatch: pytest.MonkeyPatch) -> stopping.SignalShutdown:
    """A fresh LAST, and torch's handler, shutdown and loggers put back after the test."""
    fresh = stopping.SignalShutdown()
    monkeypatch.setattr(stopping, "LAST", fresh)
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", LocalElasticAgent._shutdown)
    for name in stopping.TORCH_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    return fresh


def test_the_first_stop_signal_raises_and_a_repeat_during_the_stop_is_noted(last: stopping.SignalShutdown) -> None:
    with pytest.raises(SignalException) as raised:
        stopping.on_stop_signal(signal.SIGUSR2, None)
    assert raised.value.sigval == signal.SIGUSR2
    stopping.on_stop_signal(signal.SIGTERM, None)  # before torch's shutdown began, within REPEAT_S: the same stop
    last.stopping = True
    last.at = time.monotonic() - 10 * stopping.REPEAT_S
    stopping.on_stop_signal(signal.SIGTERM, None)  # while the workers stop, however late
    assert last.first == signal.SIGUSR2 and last.later == [signal.SIGTERM, signal.SIGTERM]


def test_a_repeat_long_after_a_swallowed_stop_raises_again(last: stopping.SignalShutdown) -> None:
    with pytest.raises(SignalException):
        stopping.on_stop_signal(signal.SIGINT, None)
    last.at = time.monotonic() - 2 * stopping.REPEAT_S  # no shutdown began: something caught the first
    with pytest.raises(SignalException):
        stopping.on_stop_signal(signal.SIGINT, None)


def test_the_shutdown_notes_the_workers_exit_codes_and_the_node_and_logs_no_chatter(
        last: stopping.SignalShutdown, caplog: pytest.LogCaptureFixture) -> None:
    stopping.install()
    assert api._terminate_process_handler is stopping.on_stop_signal  # what torch registers as workers start
    closed: list[Any] = []
    procs = {1: SimpleNamespace(proc=SimpleNamespace(poll=lambda: 75)),
             0: SimpleNamespace(proc=SimpleNamespace(poll=lambda: -9))}
    agent = SimpleNamespace(_worker_watchdog=None, _health_check_server=None, _worker_group=SimpleNamespace(group_rank=1),
                            _pcontext=SimpleNamespace(subprocess_handlers=procs,
                                                      close=lambda sig, timeout: closed.append((sig, timeout))))
    LocalElasticAgent._shutdown(agent, signal.SIGUSR2, 30)  # type: ignore[arg-type]
    assert closed == [(signal.SIGUSR2, 30)] and last.stopping
    assert (last.node, last.codes) == (1, [-9, 75])
    with caplog.at_level(logging.WARNING):
        logging.getLogger(stopping.TORCH_LOGGERS[0]).warning("Received %s death signal, shutting down workers", 12)
        logging.getLogger(stopping.TORCH_LOGGERS[1]).warning("Sending process %s closing signal %s", 7, "SIGUSR2")
        logging.getLogger(stopping.TORCH_LOGGERS[1]).warning("Unable to shutdown process %s via %s, forcefully "
                                                             "exiting via %s", 7, 15, 9)
    assert [r.getMessage() for r in caplog.records] == ["Unable to shutdown process 7 via 15, forcefully exiting via 9"]


def test_one_line_says_the_signal_the_node_and_how_its_workers_ended() -> None:
    line = stopping.stopped_line
    assert line(signal.SIGUSR2, stopping.SignalShutdown(node=1, codes=[75, 75], later=[signal.SIGTERM, signal.SIGTERM])) == \
        "ddpkit.agent: node 1: SIGUSR2: its 2 workers stopped (exit 75); SIGTERM too, while stopping"
    assert line(signal.SIGTERM, stopping.SignalShutdown(node=0, codes=[75, -9])) == \
        "ddpkit.agent: node 0: SIGTERM: its 2 workers stopped (exit 75, killed by SIGKILL)"
    assert line(signal.SIGINT, stopping.SignalShutdown(node=0, codes=[0])) == \
        "ddpkit.agent: node 0: SIGINT: its worker stopped (exit 0)"
    assert line(signal.SIGTERM, stopping.SignalShutdown()) == "ddpkit.agent: SIGTERM: no workers were running"
