"""Network interfaces: which ones this host (or network namespace) has, which
one the other nodes reach this job by, and the NCCL/Gloo variables that pin it.

No torch here. Addresses and flags come from the kernel through ioctl
(SIOCGIFADDR, SIOCGIFFLAGS) on the names socket.if_nameindex() lists, so the
answer is right inside a network namespace (where /sys/class/net may still
show the parent's view).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from ..shared.envnames import SOCKET_IFNAMES

SIOCGIFFLAGS = 0x8913  # linux/sockios.h
SIOCGIFADDR = 0x8915
IFF_UP = 0x1           # linux/if.h
IFNAME_VARS = SOCKET_IFNAMES
# Names a user writes when they mean "this machine only": loopback is right then.
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


class InterfaceError(ValueError):
    """The requested interface does not exist, or no interface reaches the master."""


@dataclass(frozen=True)
class Interface:
    name: str
    address: str | None  # primary IPv4 address, None when the interface has none
    up: bool = True      # IFF_UP: `ip link set NAME down` clears it

    @property
    def loopback(self) -> bool:
        return self.address is not None and ipaddress.ip_address(self.address).is_loopback

    @property
    def usable(self) -> bool:
        """Up with an IPv4 address: something a peer could connect to."""
        return self.up and self.address is not None

    def describe(self) -> str:
        state = "" if self.up else " (down)"
        return f"{self.name}={self.address or 'no IPv4'}{state}"


@dataclass(frozen=True)
class Choice:
    """What `auto` picked, and why (for the log line and the doctor)."""

    name: str
    reason: str


def _ioctl(name: str, request_code: int) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("256s", name.encode()[:15])
        try:
            return fcntl.ioctl(sock.fileno(), request_code, request)
        except OSError:  # EADDRNOTAVAIL: no IPv4 address; ENODEV: gone meanwhile
            return None


def ipv4_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None if it has none."""
    reply = _ioctl(name, SIOCGIFADDR)
    return None if reply is None else socket.inet_ntoa(reply[20:24])


def is_up(name: str) -> bool:
    reply = _ioctl(name, SIOCGIFFLAGS)
    return reply is not None and bool(struct.unpack_from("H", reply, 16)[0] & IFF_UP)


def interfaces() -> list[Interface]:
    """Every interface of this network namespace, in kernel index order."""
    return [Interface(name, ipv4_address(name), is_up(name)) for _, name in sorted(socket.if_nameindex())]


def listing(have: list[Interface] | None = None) -> str:
    """'lo=127.0.0.1, eth0=10.0.0.2': what a fix message offers instead."""
    return ", ".join(i.describe() for i in (interfaces() if have is None else have))


def resolve_ipv4(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (socket.gaierror, UnicodeError) as exc:
        raise InterfaceError(f"master address {host!r} does not resolve to an IPv4 address: {exc}") from None


def is_local_name(master_addr: str) -> bool:
    """The user named loopback on purpose (a one-machine job), as opposed to a
    host name that this host's resolver happens to map to 127.0.1.1."""
    try:
        return ipaddress.ip_address(master_addr).is_loopback
    except ValueError:
        return master_addr.lower() in LOCAL_NAMES


def choose(master_addr: str) -> Choice:
    """The interface `auto` pins for a job whose master is `master_addr`.

    The route to the master when it is another host. When the master's name
    resolves to loopback here (Debian/Ubuntu map a host's own name to
    127.0.1.1 on node 0), the route says `lo`, which the other nodes cannot
    reach: take the interface they reach this host by instead. Loopback only
    when the master was named as loopback (localhost, 127.0.0.1) or this host
    has nothing else."""
    target = resolve_ipv4(master_addr)
    if not ipaddress.ip_address(target).is_loopback:
        return _routed(master_addr, target)
    if is_local_name(master_addr):
        return Choice(loopback_name(), f"{master_addr} is loopback: a one-machine job")
    real = outward_interface()
    if real is None:
        return Choice(loopback_name(), f"{master_addr} -> {target} and this host has no other interface up")
    return Choice(real.name, f"{master_addr} -> {target} (loopback) here; {real.reason}")


def _routed(master_addr: str, target: str) -> Choice:
    # Connecting a UDP socket sends nothing; it only asks the routing table
    # which local address would be the source.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, 9))
        except OSError as exc:
            raise InterfaceError(f"no route from this host to the master {master_addr} ({target}): {exc}") from None
        local = sock.getsockname()[0]
    for iface in interfaces():
        if iface.address == local:
            if not iface.up:
                raise InterfaceError(f"the route to {master_addr} ({target}) leaves from {iface.name}, which is down")
            return Choice(iface.name, f"routes to {master_addr} ({target}) from {local}")
    raise InterfaceError(
        f"the route to {master_addr} leaves from {local}, which no interface carries; "
        "name the interface explicitly (--interface NAME)"
    )


def outward_interface() -> Choice | None:
    """The interface other hosts reach this one by: the one holding a
    non-loopback address of this host's own name, else the one carrying the
    default route, else the only usable non-loopback interface."""
    usable = [i for i in interfaces() if i.usable and not i.loopback]
    by_addr = {i.address: i for i in usable}
    for addr in _own_name_addresses():
        if addr in by_addr:
            return Choice(by_addr[addr].name, f"{by_addr[addr].name} holds {addr}, this host's name's address")
    default = default_route_interface()
    if default is not None and default in {i.name for i in usable}:
        return Choice(default, f"{default} carries the default route")
    if len(usable) == 1:
        return Choice(usable[0].name, f"{usable[0].name} is the only interface up besides loopback")
    return None


def _own_name_addresses() -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except (socket.gaierror, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos if not ipaddress.ip_address(info[4][0]).is_loopback]


def default_route_interface(route_table: Path = Path("/proc/net/route")) -> str | None:
    """The interface of the IPv4 default route (destination 00000000), if any."""
    # /proc by hand, not psutil: psutil lists interfaces and their addresses
    # but not the routing table.
    try:
        lines = route_table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def route_interface(master_addr: str) -> str:
    """The name `auto` picks for `master_addr` (see choose())."""
    return choose(master_addr).name


def loopback_name() -> str:
    for iface in interfaces():
        if iface.loopback:
            return iface.name
    return "lo"


_CHOSEN: list[Choice] = []  # what `auto` picked in this process, for the log line


def last_choice() -> Choice | None:
    """What apply_interface('auto', ...) picked last in this process."""
    return _CHOSEN[-1] if _CHOSEN else None


def check_names(names: list[str]) -> None:
    have = interfaces()
    known = {iface.name for iface in have}
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
        chosen = choose(master_addr)
        _CHOSEN.append(chosen)
        value = chosen.name
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
