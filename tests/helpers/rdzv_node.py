"""`python -m tests.helpers.rdzv_node BACKEND ENDPOINT RUN_ID MIN MAX IS_HOST CONF`:
one torchrun agent's rendezvous handler and nothing else (no workers), as
tests/test_rendezvous.py drives it. BACKEND is looked up in torchrun's own
registry (entry points included), so `ddpkit` is what torchrun would build.

Joins a round, prints one JSON line (rank, world size, when), then
joins the next round each time a line arrives on standard input, until EOF."""

from __future__ import annotations

import json
import logging
import sys
import time

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler


def main() -> None:
    backend, endpoint, run_id, min_nodes, max_nodes, is_host, conf = sys.argv[1:8]
    logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")  # levels: torch's, from LOGLEVEL
    config = {k: int(v) for k, v in (kv.split("=") for kv in conf.split(","))}
    params = RendezvousParameters(backend, endpoint, run_id, int(min_nodes), int(max_nodes),
                                  local_addr="127.0.0.1", is_host=is_host == "1", **config)
    handler = get_rendezvous_handler(params)
    while True:
        info = handler.next_rendezvous()
        print(json.dumps({"rank": info.rank, "world_size": info.world_size, "at": time.time()}), flush=True)
        if not sys.stdin.readline():
            break
    handler.shutdown()


if __name__ == "__main__":
    main()
