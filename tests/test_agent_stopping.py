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
    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", LocalElasticAgent._invoke_run)
    monkeypatch.setattr(LocalElasticAgent, "_initialize_workers", LocalElasticAgent._initialize_workers)
    monkeypatch.setattr(api.PContext, "close", api.PContext.close)
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


def test_once_the_run_is_over_a_stop_signal_is_noted_not_raised(last: stopping.SignalShutdown,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher stops every node as this one's workers end on their own:
    raised, the signal would print torch's traceback from its last shutdown
    (its log tailers' wait) or an atexit hook."""
    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", lambda self, role="default": "workers ended")
    stopping.install()
    assert not last.ending
    assert LocalElasticAgent._invoke_run(SimpleNamespace()) == "workers ended"  # type: ignore[arg-type]
    assert last.ending
    stopping.on_stop_signal(signal.SIGTERM, None)
    assert last.first is None and last.later == [signal.SIGTERM]


def test_a_stop_signal_while_the_run_goes_on_still_raises(last: stopping.SignalShutdown,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def run_loop(self: object, role: str = "default") -> None:
        stopping.on_stop_signal(signal.SIGTERM, None)  # as torch's handler runs in the agent's loop

    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", run_loop)
    stopping.install()
    with pytest.raises(SignalException):
        LocalElasticAgent._invoke_run(SimpleNamespace())  # type: ignore[arg-type]
    assert not last.ending and last.first == signal.SIGTERM  # the signal's own stop, not the run's end


def shutdown_hit_by(sig: signal.Signals) -> Any:
    """torch's shutdown of the workers, the stop signal arriving in its wait for them."""
    def shutdown(self: object, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        stopping.on_stop_signal(sig, None)  # raised here, it would cut the wait short with torch's traceback
    return shutdown


def test_a_stop_signal_during_a_restarts_stop_of_the_workers_is_raised_when_they_would_start_again(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[object] = []
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", shutdown_hit_by(signal.SIGTERM))
    monkeypatch.setattr(LocalElasticAgent, "_initialize_workers", lambda self, group: started.append(group))
    stopping.install()
    agent = SimpleNamespace(_pcontext=None)
    LocalElasticAgent._shutdown(agent)  # type: ignore[arg-type]
    assert last.deferred == signal.SIGTERM and last.first is None and not last.in_shutdown
    with pytest.raises(SignalException) as raised:
        LocalElasticAgent._initialize_workers(agent, "group")  # type: ignore[arg-type]
    assert raised.value.sigval == signal.SIGTERM and last.first == signal.SIGTERM and not started
    LocalElasticAgent._initialize_workers(agent, "group")  # type: ignore[arg-type]
    assert started == ["group"]  # a start with nothing deferred is torch's own (the control)


def test_a_stop_signal_during_the_runs_last_stop_of_the_workers_raises_nothing(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", shutdown_hit_by(signal.SIGTERM))

    def failed_run(self: object, role: str = "default") -> str:
        LocalElasticAgent._shutdown(self)  # type: ignore[arg-type]  # torch's _stop_workers on a failure, no restart left
        return "failed"

    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", failed_run)
    stopping.install()
    assert LocalElasticAgent._invoke_run(SimpleNamespace(_pcontext=None)) == "failed"  # type: ignore[arg-type]
    assert last.ending and last.first is None


def test_a_stop_signal_while_torch_closes_a_failed_groups_processes_raises_nothing(
        last: stopping.SignalShutdown, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker failed: torch's poll closes the group's processes and log
    tailers at once, inside the run's loop, and the launcher's stop of every
    node comes in that wait (seen as torch's 'error in log tailer' traceback)."""
    stopping.install()
    tailer = SimpleNamespace(stop=lambda: stopping.on_stop_signal(signal.SIGTERM, None))
    group = SimpleNamespace(_close=lambda death_sig, timeout: None, _tail_logs=[tailer],
                            filtered_stdout=None, filtered_stderr=None)
    api.PContext.close(group)  # type: ignore[arg-type]
    assert last.deferred == signal.SIGTERM and last.first is None and not last.in_shutdown


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


def test_the_agent_exits_75_only_where_every_worker_checkpointed_on_the_stop() -> None:
    code = stopping.stopped_code
    assert code(stopping.SignalShutdown(node=0, codes=[75, 75])) == 75
    assert code(stopping.SignalShutdown(node=0, codes=[75, -9])) == 1  # one was killed before it checkpointed
    assert code(stopping.SignalShutdown(node=0, codes=[75, None])) == 1
    assert code(stopping.SignalShutdown()) == 1  # no workers were running: torchrun's 1


def test_one_line_says_the_signal_the_node_and_how_its_workers_ended() -> None:
    line = stopping.stopped_line
    assert line(signal.SIGUSR2, stopping.SignalShutdown(node=1, codes=[75, 75], later=[signal.SIGTERM, signal.SIGTERM])) == \
        "ddpkit.agent: node 1: SIGUSR2: its 2 workers stopped (exit 75); SIGTERM too, while stopping"
    assert line(signal.SIGTERM, stopping.SignalShutdown(node=0, codes=[75, -9])) == \
        "ddpkit.agent: node 0: SIGTERM: its 2 workers stopped (exit 75, killed by SIGKILL)"
    assert line(signal.SIGINT, stopping.SignalShutdown(node=0, codes=[0])) == \
        "ddpkit.agent: node 0: SIGINT: its worker stopped (exit 0)"
    assert line(signal.SIGTERM, stopping.SignalShutdown()) == "ddpkit.agent: SIGTERM: no workers were running"
