"""The pre-join network checks that need no peer: the interface settings in
force, what `auto` picks, the master's name, this host's master port, and
whether the master's port answers a TCP connect.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Mapping

from ...host import netif
from ...shared.envnames import SOCKET_IFNAMES
from .netproblem import RETRY_S, Peers, Problem

# ---- interfaces ------------------------------------------------------------------

def interface_settings(choice: str, env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(where it came from, value) for every interface setting in force. The
    environment variables win over the flag: that is what NCCL and Gloo read."""
    found = [(var, env[var]) for var in SOCKET_IFNAMES if env.get(var)]
    return found or [("--interface", choice)]


def names_in(value: str) -> list[str]:
    # NCCL's '=eth0' asks for an exact match; '^lo,docker' (exclusion) names no interface to check.
    return [] if value.startswith("^") else [n.lstrip("=") for n in value.split(",") if n]


def interface_problem(source: str, value: str, spans_hosts: bool,
                      have: list[netif.Interface] | None = None) -> Problem | None:
    """A named interface that is missing, down or without an address here,
    Gloo given NCCL's exclusion syntax, or loopback for a job across hosts."""
    have = netif.interfaces() if have is None else have
    if value == "auto":
        return None
    offer = f"use --interface auto or one of this host's interfaces: {netif.listing(have)}"
    if value.startswith("^") and source != "NCCL_SOCKET_IFNAME":
        return Problem("interface", f"{source}={value!r}: Gloo does not accept NCCL's '^' exclusion syntax", offer)
    by_name = {i.name: i for i in have}
    names = names_in(value)
    missing = [n for n in names if n not in by_name]
    if missing:
        return Problem("interface", f"{source}={value!r}: no interface {', '.join(missing)} on host "
                       f"{socket.gethostname()}", f"set it on every node to a name each has; {offer}")
    unusable = [by_name[n] for n in names if not by_name[n].usable]
    if unusable:
        return Problem("interface", f"{source}={value!r}: {', '.join(i.describe() for i in unusable)} "
                       "is down or has no IPv4 address", f"bring it up with an address, or {offer}")
    if spans_hosts and names and all(by_name[n].loopback for n in names):
        return Problem("interface", f"{source}={value!r} is loopback but the job spans hosts: "
                       "peers on other hosts cannot reach it", offer)
    return None


def interface_problems(choice: str, env: Mapping[str, str], spans_hosts: bool) -> list[Problem]:
    found = (interface_problem(src, val, spans_hosts) for src, val in interface_settings(choice, env))
    return [p for p in found if p is not None]


def auto_choice(master_addr: str) -> netif.Choice | Problem:
    """What `auto` picks for this master, or why it cannot pick."""
    try:
        return netif.choose(master_addr)
    except netif.InterfaceError as exc:
        return Problem("interface", str(exc), f"name the interface that reaches the master; this host has "
                       f"{netif.listing()}")


# ---- the master ------------------------------------------------------------------

def resolve_problem(master_addr: str) -> Problem | None:
    try:
        netif.resolve_ipv4(master_addr)
    except netif.InterfaceError as exc:
        return Problem("master address", str(exc), "MASTER_ADDR must be node 0's name as every node resolves it: "
                       "fix DNS or /etc/hosts, or use node 0's IP address")
    return None


def loopback_master_problem(peers: Peers) -> Problem | None:
    """A node other than the master's whose MASTER_ADDR resolves to
    loopback would meet only itself: its peers are on other hosts."""
    if not peers.spans_hosts or peers.master_addr is None:
        return None
    if peers.on_master_node or netif.is_local_name(peers.master_addr):
        return None
    ip = netif.resolve_ipv4(peers.master_addr)
    if not ipaddress.ip_address(ip).is_loopback:
        return None
    return Problem("master address", f"MASTER_ADDR={peers.master_addr} resolves to {ip} (loopback) on "
                   f"{socket.gethostname()}, which is not the master: this rank cannot reach node 0",
                   "make the name resolve to node 0's real address on every node (/etc/hosts, DNS), "
                   "or set MASTER_ADDR to node 0's IP address")


def port_in_use_problem(port: int) -> Problem | None:
    """Can this host listen on `port`? SO_REUSEADDR, as the store sets it:
    only a listener (not a closing connection) makes the bind fail."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return Problem("master port", f"master port {port} is already in use on {socket.gethostname()} "
                           f"({exc.strerror})", f"stop what holds it (`ss -ltnp 'sport = :{port}'`) or choose "
                           "another port (network.master_port in the job spec, or MASTER_PORT)")
    return None


def unreachable_problem(addr: str, port: int, why: str, waited: float) -> Problem:
    return Problem("master reachable", f"cannot reach the master at {addr}:{port} from {socket.gethostname()} "
                   f"within {waited:.0f} s ({why})",
                   f"check that node 0 started the job, that MASTER_ADDR names node 0 as this node resolves it, "
                   f"that no firewall blocks TCP {port} between nodes, and that the interface in use reaches it "
                   f"({netif.listing()})")


def port_answers(addr: str, port: int, window: float, retry_s: float = RETRY_S) -> tuple[bool, str, float]:
    """TCP connect (what `telnet host port` tests), retried for `window`
    seconds: a master a little later than this node is not a fault.
    (answered, why not, seconds taken)."""
    start = time.monotonic()
    deadline = start + window
    why = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(min(left, 2.0), 0.05)):
                return True, "connected", time.monotonic() - start
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() + retry_s >= deadline:
            return False, why, time.monotonic() - start
        time.sleep(retry_s)


def connect_problem(addr: str, port: int, window: float) -> Problem | None:
    answered, why, took = port_answers(addr, port, window)
    return None if answered else unreachable_problem(addr, port, why, took)


# ---- all together ----------------------------------------------------------------

def local_problems(peers: Peers, choice: str, env: Mapping[str, str]) -> list[Problem]:
    """The checks that need no peer: interface, name resolution, the port."""
    problems = interface_problems(choice, env, peers.spans_hosts)
    if peers.master_addr is None:
        return problems
    unresolved = resolve_problem(peers.master_addr)
    if unresolved is not None:
        return [*problems, unresolved]
    if all(value == "auto" for _, value in interface_settings(choice, env)):
        picked = auto_choice(peers.master_addr)
        if isinstance(picked, Problem):
            problems.append(picked)
        elif peers.spans_hosts and picked.name == netif.loopback_name():
            problems.append(Problem("interface", f"auto found only loopback ({picked.reason}) but the job spans "
                                    "hosts: the other nodes cannot reach this one",
                                    f"bring this host's network interface up, or name one: {netif.listing()}"))
    loop = loopback_master_problem(peers)
    if loop is not None:
        problems.append(loop)
    if peers.hosts_store and peers.master_port is not None:
        busy = port_in_use_problem(peers.master_port)
        if busy is not None:
            problems.append(busy)
    return problems
