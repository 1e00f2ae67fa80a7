"""Network interfaces: which ones this host (or network namespace) has, which
one routes to the master, and the NCCL/Gloo variables that pin it.

No torch here. Addresses come from the kernel through ioctl(SIOCGIFADDR) on
the names socket.if_nameindex() lists, so the answer is right inside a
network namespace (where /sys/class/net may still show the parent's view).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # linux/sockios.h
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


class InterfaceError(ValueError):
    """The requested interface does not exist, or no interface reaches the master."""


@dataclass(frozen=True)
class Interface:
    name: str
    address: str | None  # primary IPv4 address, None when the interface has none


def ipv4_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("256s", name.encode()[:15])
        try:
            reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
        except OSError:  # EADDRNOTAVAIL: no IPv4 address; ENODEV: gone meanwhile
            return None
    return socket.inet_ntoa(reply[20:24])


def interfaces() -> list[Interface]:
    """Every interface of this network namespace, in kernel index order."""
    return [Interface(name, ipv4_address(name)) for _, name in sorted(socket.if_nameindex())]


def resolve_ipv4(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror as exc:
        raise InterfaceError(f"master address {host!r} does not resolve to an IPv4 address: {exc}") from None


def route_interface(master_addr: str) -> str:
    """The interface whose address the kernel uses to reach `master_addr`.

    Connecting a UDP socket sends nothing; it only asks the routing table
    which local address would be the source."""
    target = resolve_ipv4(master_addr)
    if ipaddress.ip_address(target).is_loopback:
        return _loopback_name()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, 9))
        except OSError as exc:
            raise InterfaceError(f"no route from this host to the master {master_addr} ({target}): {exc}") from None
        local = sock.getsockname()[0]
    for iface in interfaces():
        if iface.address == local:
            return iface.name
    raise InterfaceError(
        f"the route to {master_addr} leaves from {local}, which no interface carries; "
        "name the interface explicitly (--interface NAME)"
    )


def _loopback_name() -> str:
    for iface in interfaces():
        if iface.address and ipaddress.ip_address(iface.address).is_loopback:
            return iface.name
    return "lo"


def check_names(names: list[str]) -> None:
    known = {iface.name for iface in interfaces()}
    missing = [n for n in names if n not in known]
    if missing:
        raise InterfaceError(
            f"interface {', '.join(missing)} not found on this host; it has {', '.join(sorted(known))} "
            "(use --interface auto, or one of those names)"
        )


def apply_interface(choice: str, master_addr: str | None) -> str | None:
    """Set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for `choice` ('auto', a
    name, or a comma list), leaving any value already in the environment
    alone. Returns the interface value in effect (None: the backends choose)."""
    if choice == "auto":
        if master_addr is None:
            return os.environ.get("GLOO_SOCKET_IFNAME")
        value = route_interface(master_addr)
    else:
        names = [n for n in choice.split(",") if n]
        if any(n.startswith("^") for n in names):
            raise InterfaceError(f"--interface {choice!r}: Gloo does not accept NCCL's '^' exclusion; name interfaces")
        check_names(names)
        value = ",".join(names)
    for var in IFNAME_VARS:
        os.environ.setdefault(var, value)
    return os.environ["GLOO_SOCKET_IFNAME"]


def address_of(value: str | None) -> str | None:
    """The IPv4 address of the first interface in a (comma list) value."""
    if not value:
        return None
    return ipv4_address(value.split(",")[0])
