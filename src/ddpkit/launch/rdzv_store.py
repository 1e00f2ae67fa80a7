"""The rendezvous store of an elastic job, hosted by the launcher itself.

torchrun's c10d rendezvous keeps its state in a TCPStore that one agent
hosts; the others are its clients. When that agent's node is lost, the
store goes with it and every other agent fails on its next read: one node
(node 0) must never fail. A launcher that outlives every node (`launch
local`, whose loss ends the run anyway) hosts the store instead, and every
agent is a client (`is_host=0` in its --rdzv-conf): any node may then go,
node 0 too, and the others meet again in the same store. `launch ssh` does
the same where every node reaches the launcher (launch/ssh/storesite.py).

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


def listener(host: str, port: int) -> int:
    """A socket listening on host:port only, for hosted_store to own later;
    OSError when the port cannot be taken."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return listen_fd(family, address)


@contextmanager
def hosted_store(host: str, port: int, fd: int | None = None) -> Iterator[dist.TCPStore]:
    """A TCPStore server on host:port for the whole block, on `fd` when the
    caller opened the listener already (listener); OSError when the port
    cannot be taken."""
    import torch.distributed as dist

    fd = listener(host, port) if fd is None else fd
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30), master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        os.close(fd)
        raise OSError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from None
    yield store
