"""The rendezvous store of an elastic job, hosted by the launcher itself.

torchrun's c10d rendezvous keeps its state in a TCPStore that one agent
hosts; the others are its clients. When that agent's node is lost, the
store goes with it and every other agent fails on its next read: one node
(node 0) must never fail. A launcher that outlives every node (`launch
local`, whose loss ends the run anyway) hosts the store instead, and every
agent is a client (`is_host=0` in its --rdzv-conf): any node may then go,
node 0 too, and the others meet again in the same store.

The store listens on the rendezvous endpoint's address only (a pre-bound
socket handed to TCPStore), not on every address of the host.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from ..listening import listen_fd

if TYPE_CHECKING:
    import torch.distributed as dist


@contextmanager
def hosted_store(host: str, port: int) -> Iterator[dist.TCPStore]:
    """A TCPStore server on host:port for the whole block; OSError when the
    port cannot be taken."""
    import torch.distributed as dist

    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    fd = listen_fd(family, address)
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30), master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        os.close(fd)
        raise OSError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from None
    yield store
