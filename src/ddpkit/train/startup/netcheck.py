"""Network checks that run before a process joins any process group, shared
by `ddpkit train` and `ddpkit doctor`.

Each check answers with a Problem: one line of cause and one of fix. Without
these, a wrong interface name ends in gloo's traceback, a master that nobody
can reach or a rank that never starts ends only at the 30-minute rendezvous
timeout, and a port already taken ends in a raw DistNetworkError.

    store = before_join(info, choice, dist_timeout_s)              # train (this module)
    problems = interface_problems(choice, env, spans_hosts)        # doctor (netlocal.py)

The arrival check (which ranks never came) needs the rendezvous store: when
this process hosts it (rank 0 under srun, mpirun, a pod or a manual start),
rank 0 opens the TCPStore itself, every rank checks in under its own key, and
rank 0 names the ranks that did not check in within the window. The same
store then carries the process group, so the port is opened once. Under
torchrun the agent holds the store and has already met its peers: only the
local checks run.

The parts: netproblem.py (Problem, Peers, the window), netlocal.py (the
checks that need no peer), arrival.py (the check-in through the store).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ...host import netif
from .arrival import arrival
from .launchinfo import LaunchInfo
from .netlocal import auto_choice, connect_problem, interface_settings, local_problems
from .netproblem import NetCheckError, Peers, window_s

if TYPE_CHECKING:
    import torch.distributed as dist


def before_join(info: LaunchInfo, choice: str, dist_timeout_s: float,
                env: Mapping[str, str] = os.environ) -> dist.TCPStore | None:
    """Run every check for this process; raise NetCheckError on the first
    problem. Returns the rendezvous store for init_process_group(store=...)
    when this process meets its peers through one we open, else None."""
    peers = Peers.from_launch(info, env)
    problems = local_problems(peers, choice, env)
    if problems:
        raise NetCheckError(problems[0])
    _say_interface(info, choice, env)
    if not peers.joins_store:
        return None
    assert peers.master_addr is not None and peers.master_port is not None
    window = window_s(env)
    if not peers.hosts_store:
        unreachable = connect_problem(peers.master_addr, peers.master_port, window)
        if unreachable is not None:
            raise NetCheckError(unreachable)
    return arrival(peers, window, dist_timeout_s)


def _say_interface(info: LaunchInfo, choice: str, env: Mapping[str, str]) -> None:
    """One log line per node: which interface the job will use, and why."""
    if info.local_rank != 0 or info.master_addr is None:
        return
    settings = interface_settings(choice, env)
    source, value = settings[-1]  # Gloo's variable when set: this job's transport on CPU
    if value == "auto":
        picked = auto_choice(info.master_addr)
        value, why = (picked.name, picked.reason) if isinstance(picked, netif.Choice) else ("?", picked.cause)
    else:
        why = f"from {source}"
    node = "" if info.node_rank is None else f"node {info.node_rank} "
    print(f"ddpkit: {node}host {socket.gethostname()} interface {value} ({why})", file=sys.stderr, flush=True)
