"""Hostfiles as DeepSpeed and MPI write them: `[user@]host[:port] [slots=N]`.

Line position is the node rank (docs/CONTRACT.md, the SSH row of "The rank contract"), so
the order of the file is kept and a duplicate host is an error: one host
carrying two node ranks would double-book its GPUs and its master port.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...spec import JobSpec
from ...spec.yamlfile import SpecError

# A host token: optional user@, a name/IPv4 or [IPv6], optional :port.
_HOST = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]*)@)?"
    r"(?:\[(?P<v6>[0-9A-Fa-f:.%a-z0-9]+)\]|(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*))"
    r"(?::(?P<port>[0-9]{1,5}))?$"
)
_SLOTS = re.compile(r"^slots=(?P<n>[0-9]+)$")


@dataclass(frozen=True)
class HostEntry:
    """One node: where to reach it and where it came from (for messages)."""

    host: str
    user: str | None = None
    port: int | None = None
    slots: int | None = None
    origin: str = "spec"

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.host, self.port)

    def __str__(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        shown = f"{self.user}@{shown}" if self.user else shown
        return f"{shown}:{self.port}" if self.port else shown


def parse_host(token: str, origin: str) -> HostEntry:
    match = _HOST.match(token)
    if not match:
        raise SpecError([f"{origin}: {token!r} is not a host; write [user@]host[:port], e.g. ubuntu@gpu1:2222"])
    port = int(match["port"]) if match["port"] else None
    if port is not None and not 1 <= port <= 65535:
        raise SpecError([f"{origin}: port {port} is out of range; use 1-65535"])
    return HostEntry(host=match["v6"] or match["name"], user=match["user"], port=port, origin=origin)


def parse_line(line: str, origin: str) -> HostEntry | None:
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    token, *options = text.split()
    entry = parse_host(token, origin)
    slots = None
    for option in options:
        match = _SLOTS.match(option)
        if not match:
            raise SpecError([f"{origin}: unknown option {option!r}; the only option is slots=N"])
        slots = int(match["n"])
    return HostEntry(entry.host, entry.user, entry.port, slots, origin)


def parse_hostfile(text: str, source: str = "hostfile") -> list[HostEntry]:
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry = parse_line(line, f"{source}:{number}")
        if entry is not None:
            entries.append(entry)
    return entries


def check_hosts(entries: list[HostEntry], spec: JobSpec) -> list[HostEntry]:
    """Every problem at once, each naming where it is and how to fix it."""
    problems = []
    if not entries:
        problems.append("hosts: none given; pass --hostfile FILE or set ssh.hosts in the job spec")
    seen: dict[tuple[str, int | None], HostEntry] = {}
    for entry in entries:
        if entry.key in seen:
            problems.append(
                f"{entry.origin}: {entry} is listed twice (first at {seen[entry.key].origin}); "
                "each node needs its own host, remove one line"
            )
        seen.setdefault(entry.key, entry)
        if entry.slots is not None and entry.slots != spec.nproc_per_node:
            problems.append(
                f"{entry.origin}: slots={entry.slots} but nproc_per_node={spec.nproc_per_node}; "
                f"write slots={spec.nproc_per_node} or pass --nproc-per-node {entry.slots}"
            )
    if entries and len(entries) != spec.nodes:
        problems.append(
            f"nodes: the job has nodes={spec.nodes} but {len(entries)} hosts are listed; "
            f"pass --nodes {len(entries)} or list {spec.nodes} hosts"
        )
    if problems:
        raise SpecError(problems)
    return entries


def load_hosts(spec: JobSpec, hostfile: Path | None) -> list[HostEntry]:
    """Hosts in node-rank order, from --hostfile or else from ssh.hosts."""
    if hostfile is not None:
        try:
            text = hostfile.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecError([f"--hostfile {hostfile}: cannot read it ({exc.strerror}); pass an existing file"]) from None
        return check_hosts(parse_hostfile(text, str(hostfile)), spec)
    entries = [parse_host(h, f"ssh.hosts[{i}]") for i, h in enumerate(spec.ssh.hosts)]
    return check_hosts(entries, spec)
