"""A socket listening on one address, handed to a TCPStore server to own
(`TCPStore(master_listen_fd=)`), so that a store answers on the address it
was asked for, not on every address of the host as torch's own listener
does. The trainer's rendezvous store and the launcher's elastic store both
open theirs here."""

from __future__ import annotations

import socket
from typing import Any


def listen_fd(family: socket.AddressFamily, address: Any) -> int:
    """The file descriptor of a socket of `family` listening at `address`
    (SO_REUSEADDR, as torch's own listener); OSError when it cannot bind."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()
