"""torch's exit barrier, with the agent that holds the job's store leaving last.

At a job's end every agent waits in torch's exit barrier (store_util.barrier:
each adds to a count, the last one sets a key, every agent waits for it).
The agent whose process holds the job's TCP store (node 0's, in a Slurm or
`launch.sh` job) returns from that wait as soon as the others do and exits,
taking the store with it: a reply still on its way to another agent is lost,
and that agent logs torch's "Error waiting on exit barrier" with a
DistNetworkError traceback into the output people read, on a job that ended
well (seen in a Slurm job's output file under load). So once through the
barrier each agent says so (one `add`), and the agent that holds the store
waits until every agent has, LINGER_S at most (one that died after the
barrier never says it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

THROUGH_KEY = "ddpkit/exit-barrier/through"  # in the round's store, beside torch's own barrier keys
LINGER_S = 10.0
POLL_S = 0.1


def hosts_store(args: Any) -> bool:
    """Whether this agent (torchrun's parsed `args`) starts the job's store:
    node 0's under the static rendezvous (--master-addr), else the c10d
    rendezvous' `is_host` setting or whether its endpoint names this machine."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from ..rendezvous.handler import hosts_store as params_host

    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        return int(args.node_rank) == 0
    conf = _parse_rendezvous_config(args.rdzv_conf or "")
    return params_host(RendezvousParameters(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, 1, 1, **conf))


def install(holds_store: bool) -> None:
    """torch's exit barrier followed by `through`; the store's holder waits in it."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    if getattr(SimpleElasticAgent._exit_barrier, "ddpkit_noted", False):
        return
    barrier: Callable[[Any], None] = SimpleElasticAgent._exit_barrier

    def _exit_barrier(agent: Any) -> None:
        barrier(agent)
        through(agent._store, agent._worker_group.group_world_size, holds_store)

    _exit_barrier.ddpkit_noted = True  # type: ignore[attr-defined]
    SimpleElasticAgent._exit_barrier = _exit_barrier  # type: ignore[method-assign]


def through(store: Any, world: int, holds_store: bool) -> int:
    """Say this agent is through the barrier; the store's holder waits until
    all `world` agents are (LINGER_S at most). How many it saw through."""
    try:
        count = int(store.add(THROUGH_KEY, 1))
        deadline = time.monotonic() + LINGER_S
        while holds_store and count < world and time.monotonic() < deadline:
            time.sleep(POLL_S)
            count = int(store.add(THROUGH_KEY, 0))
    except Exception:  # the store is gone already (its holder ended): nothing left to wait for
        return 0
    return count
