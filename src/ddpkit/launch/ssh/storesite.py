"""Where an elastic `launch ssh` job's rendezvous store lives.

The launcher hosts it (rdzv_store.py) when every node reaches the
launcher: then any node may be lost, node 0 too. The address is this host's
own on the route to node 0 (the source address the kernel picks for it),
which every node tries during the preflight. Until the store takes the
socket over, a listener there answers each connection with a word of this
run, so a node that reached something else at that address does not count:
behind a NAT the nodes live in another network, where the same private
address may well be in use. Where some node does not get the answer (a NAT,
a jump host, a firewall), or there is no route to try, node 0's agent hosts
the store as before and the launcher says so in one line: node 0's loss
then ends the job.
"""

from __future__ import annotations

import secrets
import select
import socket
import threading
from dataclasses import dataclass, field

from ...rdzv_store import listener
from .connect import Endpoint
from .preflight import StoreProbe

ANSWER_PREFIX = "ddpkit-store "


def route_address(node0: Endpoint) -> tuple[str | None, str]:
    """This host's address on the route to node 0, or None and why there is
    none to try."""
    if node0.jump is not None:
        return None, f"node 0 is reached through the jump host {node0.jump.hostname}"
    try:
        family, _, _, _, address = socket.getaddrinfo(node0.hostname, node0.port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: picks the route and the source address, sends nothing
            return str(probe.getsockname()[0]), ""
    except OSError as exc:
        return None, f"no route from this launcher to node 0 ({node0.hostname}: {exc.strerror or exc})"


@dataclass
class Answerer:
    """A socket listening on host:port that answers every connection with
    `answer` until `handover` gives it to the store."""

    host: str
    port: int
    answer: str = field(default_factory=lambda: ANSWER_PREFIX + secrets.token_hex(8))
    _sock: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def open(self) -> Answerer:
        """Listen and answer; OSError when the port cannot be taken here."""
        self._sock = socket.socket(fileno=listener(self.host, self.port))
        self.port = self._sock.getsockname()[1]  # the one the kernel chose for port 0
        self._thread = threading.Thread(target=self._serve, name="store-probe-answerer", daemon=True)
        self._thread.start()
        return self

    @property
    def probe(self) -> StoreProbe:
        return StoreProbe(self.host, self.port, self.answer)

    def _serve(self) -> None:
        assert self._sock is not None
        line = (self.answer + "\n").encode()
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], 0.1)
            if not ready:
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.sendall(line)
                except OSError:
                    continue

    def _quiet(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def handover(self) -> int:
        """Stop answering; the listening socket's descriptor, now the caller's."""
        self._quiet()
        assert self._sock is not None
        fd, self._sock = self._sock.detach(), None
        return fd

    def close(self) -> None:
        self._quiet()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def open_answerer(node0: Endpoint, port: int) -> tuple[Answerer | None, str]:
    """An answerer on this host's address towards node 0, or None and why
    the launcher cannot host the store."""
    host, why = route_address(node0)
    if host is None:
        return None, why
    try:
        return Answerer(host, port).open(), ""
    except OSError as exc:
        return None, f"this launcher cannot listen on {host}:{port} ({exc.strerror or exc})"


def unreached(host: str, port: int, detail: str) -> str:
    return f"the nodes cannot reach this launcher at {host}:{port} ({detail})"


def node0_hosts_line(why: str) -> str:
    """The one line an elastic job starts with when node 0 hosts its store."""
    return (f"launch ssh: node 0's agent hosts the rendezvous store, so losing node 0 ends the job: {why}; "
            "to let any node go, run launch ssh on a host every node reaches directly (no NAT or jump host "
            "between them)")
