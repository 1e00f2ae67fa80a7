"""What a pre-join network check answers (Problem, and NetCheckError that
carries one) and what the checks know of this process's place in the job
(Peers, the rendezvous window). The checks: netlocal.py (no peer needed) and
arrival.py (every rank through the store); netcheck.py runs them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ...host import netif
from ...shared.envnames import DDPKIT_RENDEZVOUS_WINDOW
from ...shared.exitcodes import ExitCode
from .launchinfo import LaunchInfo, StartupError

WINDOW_VAR = DDPKIT_RENDEZVOUS_WINDOW
# A non-master retries the master's port this long; rank 0 waits this long
# after the last arrival. A fault must end the job within 30 s, torch's
# import included. Launchers whose nodes start minutes apart (pods pulling
# images) raise it through DDPKIT_RENDEZVOUS_WINDOW.
DEFAULT_WINDOW_S = 10.0
RETRY_S = 0.2
STORE_REPLY_S = 10.0
ACK_WAIT_S = 3.0  # how long rank 0 keeps the store up so arrived ranks read its verdict


@dataclass(frozen=True)
class Problem:
    check: str
    cause: str
    fix: str

    def line(self) -> str:
        return f"{self.cause}; fix: {self.fix}"


class NetCheckError(StartupError):
    """A pre-join network check failed: the job cannot form its group."""

    exit_code = ExitCode.STARTUP

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.line())
        self.problem = problem


@dataclass(frozen=True)
class Peers:
    """What the checks need to know about this process's place in the job."""

    rank: int
    world_size: int
    spans_hosts: bool       # the job has processes on other hosts
    on_master_node: bool    # this process runs on node 0 (the master's host)
    master_addr: str | None
    master_port: int | None
    hosts_store: bool       # this process opens the rendezvous port itself
    joins_store: bool       # this process meets its peers through a TCP store we may open

    @classmethod
    def from_launch(cls, info: LaunchInfo, env: Mapping[str, str] = os.environ) -> Peers:
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        tcp = info.init_method.startswith(("env://", "tcp://")) and info.master_port is not None
        joins = tcp and not agent_store and info.launcher not in ("single", "spawn")
        node0 = info.node_rank == 0 if info.node_rank is not None else info.rank == 0
        # A master named as loopback (127.0.0.1, localhost) means one machine,
        # and a manual start that was not told its node does not know its hosts.
        local = info.master_addr is None or netif.is_local_name(info.master_addr)
        spans = info.world_size > info.local_world_size and info.node_rank is not None and not local
        return cls(info.rank, info.world_size, spans, node0, info.master_addr,
                   info.master_port, joins and info.rank == 0, joins)


def window_s(env: Mapping[str, str] = os.environ) -> float:
    raw = env.get(WINDOW_VAR, "")
    try:
        return float(raw) if raw else DEFAULT_WINDOW_S
    except ValueError:
        raise NetCheckError(Problem("rendezvous", f"{WINDOW_VAR}={raw!r} is not a number of seconds",
                                    f"unset {WINDOW_VAR} or give seconds, e.g. 120")) from None
