"""One torchrun agent's rendezvous handler and nothing else (no workers), in
a process of its own, as bench/rendezvous.py and tests/test_rendezvous.py
drive it:

  python -m bench.rdzv_node BACKEND ENDPOINT RUN_ID MIN MAX IS_HOST CONF_JSON

BACKEND is looked up in torchrun's own registry (entry points included), so
`ddpkit` is what torchrun would build.

The node joins a round, prints one JSON line (rank, world size, when), then
joins the next round each time a line arrives on standard input, until EOF.
The driver's side is `start`, `joined` and `next_round`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def node(argv: list[str]) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    backend, endpoint, run_id, min_nodes, max_nodes, is_host, conf = argv[:7]
    logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")  # levels: torch's, from LOGLEVEL
    params = RendezvousParameters(backend, endpoint, run_id, int(min_nodes), int(max_nodes),
                                  local_addr="127.0.0.1", is_host=is_host == "1", **json.loads(conf))
    handler = get_rendezvous_handler(params)
    while True:
        info = handler.next_rendezvous()
        print(json.dumps({"rank": info.rank, "world_size": info.world_size, "at": time.time()}), flush=True)
        if not sys.stdin.readline():
            break
    handler.shutdown()


def start(backend: str, port: int, run_id: str, nodes: tuple[int, int], is_host: bool, conf: dict[str, int],
          *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """One node, its rendezvous on 127.0.0.1:`port`, `nodes` = (min, max)."""
    argv = [sys.executable, "-m", "bench.rdzv_node", backend, f"127.0.0.1:{port}", run_id, str(nodes[0]),
            str(nodes[1]), "1" if is_host else "0", json.dumps(conf)]
    return subprocess.Popen(argv, cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def joined(agent: subprocess.Popen[str]) -> dict[str, float]:
    """The round `agent` joined next (its JSON line); raises with its stderr when it ended instead."""
    line = agent.stdout.readline() if agent.stdout else ""
    if not line:
        agent.kill()
        raise RuntimeError(f"an agent ended without joining a round:\n{agent.communicate()[1][-3000:]}")
    return json.loads(line)


def next_round(agents: list[subprocess.Popen[str]]) -> None:
    """Send each agent to its next round (as its workers' failure sends torchrun's agent)."""
    for agent in agents:
        assert agent.stdin is not None  # stdin=PIPE
        agent.stdin.write("next\n")
        agent.stdin.flush()


if __name__ == "__main__":
    node(sys.argv[1:])
