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
the master port range; docs/guides/security.md, threat model).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import psutil

from ..host import netif
from .network import SECTION, Master
from .results import Check, Status

NAME = "master port exposure"


def listen_addresses(port: int) -> list[str]:
    """The local addresses at which a TCP socket of this network namespace
    listens on `port` ('0.0.0.0' or '::': every address)."""
    return sorted({conn.laddr.ip for conn in psutil.net_connections(kind="tcp")
                   if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port})


def _every_address(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_unspecified


def check_exposure(master: Master, rank: int, host: str, interfaces: list[netif.Interface] | None = None,
                   listening: Callable[[int], list[str]] = listen_addresses) -> Check:
    """One row for the host that holds the store: PASS when the port listens
    at the job's address only (or the host has no other network), WARN when
    it listens on every address and the host has others."""
    def row(status: Status, detail: str, fix: str = "") -> Check:
        return Check(SECTION, NAME, status, detail, fix, rank, host)

    if master.addr is None or master.port is None:
        return row(Status.SKIP, "single process: no rendezvous port")
    where = listening(master.port)
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
               "or give each tenant its own master_port range (docs/guides/security.md, threat model)")
