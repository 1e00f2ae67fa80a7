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

if TYPE_CHECKING:
    import torch.distributed as dist


def listener(host: str, port: int) -> int:
    """The file descriptor of a socket listening on host:port, for TCPStore to
    own (torch's own listener sets SO_REUSEADDR too)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


@contextmanager
def hosted_store(host: str, port: int) -> Iterator[dist.TCPStore]:
    """A TCPStore server on host:port for the whole block; OSError when the
    port cannot be taken."""
    import torch.distributed as dist

    fd = listener(host, port)
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30), master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        os.close(fd)
        raise OSError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from None
    yield store
