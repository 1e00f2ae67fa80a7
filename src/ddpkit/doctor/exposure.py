"""Where the master port listens on the master's host, and so which of the
host's networks can reach the job's store.

torch's TCPStore has no authentication: any client that reaches the port can
read and write every key, join an elastic rendezvous or disturb a static
one. torchrun's agent (and torch's store wherever ddpkit does not open it
itself) listens on every address of the host, so on a host with more than
the job's network (a second NIC, a management network, docker0) the port
answers there too. The doctor can only see this host's side: the addresses
the port listens at and the host's other addresses. Whether a machine
outside the job can route to them is the network's business (a firewall on
the master port range; docs/FAILURES.md, threat model).
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from .. import netif
from .network import SECTION, Master
from .results import Check, Status

NAME = "master port exposure"
_LISTEN = "0A"  # the kernel's TCP_LISTEN in /proc/net/tcp's `st` column
PROC_NET = Path("/proc/net")


def _decode(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[at:at + 4][::-1] for at in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listen_addresses(port: int, proc_net: Path = PROC_NET) -> list[str]:
    """The local addresses at which a TCP socket of this network namespace
    listens on `port` ('0.0.0.0' or '::': every address)."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc_net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            addr, _, port_hex = fields[1].partition(":")
            if fields[3] == _LISTEN and int(port_hex, 16) == port:
                found.add(_decode(addr))
    return sorted(found)


def _every_address(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_unspecified


def check_exposure(master: Master, rank: int, host: str, interfaces: list[netif.Interface] | None = None,
                   proc_net: Path = PROC_NET) -> Check:
    """One row for the host that holds the store: PASS when the port listens
    at the job's address only (or the host has no other network), WARN when
    it listens on every address and the host has others."""
    def row(status: Status, detail: str, fix: str = "") -> Check:
        return Check(SECTION, NAME, status, detail, fix, rank, host)

    if master.addr is None or master.port is None:
        return row(Status.SKIP, "single process: no rendezvous port")
    where = listen_addresses(master.port, proc_net)
    if not where:
        return row(Status.SKIP, f"nothing listens on {master.port} on this host: the store is on another")
    try:
        job_ip = netif.resolve_ipv4(master.addr)
    except netif.InterfaceError:
        job_ip = master.addr
    listed = ", ".join(where)
    if not any(_every_address(a) for a in where):
        return row(Status.PASS, f"{master.port} listens at {listed} only; any machine that routes to it can "
                                "still connect: firewall the port range to the job's hosts")
    others = [i for i in (netif.interfaces() if interfaces is None else interfaces)
              if i.usable and not i.loopback and i.address != job_ip]
    if not others:
        return row(Status.PASS, f"{master.port} listens on every address ({listed}), and this host has no "
                                f"network but the job's ({job_ip})")
    return row(Status.WARN,
               f"{master.port} listens on every address ({listed}): besides the job's {master.addr} ({job_ip}) it "
               f"answers on {', '.join(i.describe() for i in others)}, and torch's store lets any client that "
               "reaches it read and write the rendezvous",
               f"allow TCP {master.port} (the job's master port range) only from the job's hosts with a firewall, "
               "or give each tenant its own master_port range (docs/FAILURES.md, threat model)")
