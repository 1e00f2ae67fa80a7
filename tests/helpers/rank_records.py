"""Read the rank report's machine-readable records back out of a job's
output, and compare them with what the job spec promises.

`ddpkit train --rank-report-json -` makes rank 0 print one JSON line per
process (kind `rank_report`), whatever prefix a launcher, srun or docker
compose puts in front; `records(text)` finds them. `differences(...)` lists
every field where a target's processes differ from the promise of the spec
(docs/TESTING.md), as rows of a target/field/expected/got table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MARK = '{"kind": "rank_report"'

# Compared field by field with the spec's promise: everything the issue lists
# except host names, addresses, pids and the launcher (host-specific by nature;
# their relations are checked instead: one host per node, node 0 hosts the master).
COMPARED = ("rank", "local_rank", "node_rank", "world_size", "master_port", "backend", "device",
            "interface", "nccl_socket_ifname", "gloo_socket_ifname", "env")


@dataclass(frozen=True)
class Promise:
    """What every process of the job must report, derived from the spec."""

    nodes: int
    nproc_per_node: int
    master_port: int
    backend: str
    device: str
    interface: str
    env: dict[str, str | None]

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def expected(self, rank: int) -> dict[str, Any]:
        """Process `rank`'s compared fields: rank = node_rank x nproc + local_rank."""
        return {"rank": rank, "local_rank": rank % self.nproc_per_node, "node_rank": rank // self.nproc_per_node,
                "world_size": self.world_size, "master_port": self.master_port, "backend": self.backend,
                "device": self.device, "interface": self.interface, "nccl_socket_ifname": self.interface,
                "gloo_socket_ifname": self.interface, "env": dict(self.env)}


@dataclass(frozen=True)
class Difference:
    target: str
    field: str
    expected: str
    got: str


def records(text: str) -> list[dict[str, Any]]:
    """Every rank_report record printed in `text`, in rank order."""
    decoder = json.JSONDecoder()
    found = []
    for line in text.splitlines():
        at = line.find(MARK)
        if at >= 0:
            found.append(decoder.raw_decode(line[at:])[0])
    return sorted(found, key=lambda r: int(r["rank"]))


def _text(value: object) -> str:
    return json.dumps(value, ensure_ascii=True, sort_keys=True) if not isinstance(value, str) else repr(value)


def differences(target: str, got: list[dict[str, Any]], promise: Promise) -> list[Difference]:
    """Every way `got` (one target's records) breaks the promise."""
    out: list[Difference] = []
    ranks = [int(r["rank"]) for r in got]
    if ranks != list(range(promise.world_size)):
        out.append(Difference(target, "ranks reported", _text(list(range(promise.world_size))), _text(ranks)))
    for record in got:
        want = promise.expected(int(record["rank"]))
        for name in COMPARED:
            if record.get(name) != want[name]:
                out.append(Difference(target, f"rank {record['rank']} {name}", _text(want[name]),
                                      _text(record.get(name))))
    out += _placement(target, got)
    return out


def _placement(target: str, got: list[dict[str, Any]]) -> list[Difference]:
    """The host-specific fields, by their relations: the processes of one node
    share a host, nodes have distinct hosts, and node 0's host is the master."""
    out: list[Difference] = []
    hosts: dict[int, set[str]] = {}
    for r in got:
        hosts.setdefault(int(r["node_rank"]), set()).add(r["host"])
    for node, names in sorted(hosts.items()):
        if len(names) != 1:
            out.append(Difference(target, f"node {node} host", "one host", _text(sorted(names))))
    if len({min(names) for names in hosts.values()}) != len(hosts):
        out.append(Difference(target, "hosts", "a distinct host per node", _text(sorted(map(sorted, hosts.values())))))
    masters = {r["master_addr"] for r in got}
    if len(masters) != 1:
        out.append(Difference(target, "master_addr", "one master for every process", _text(sorted(masters))))
        return out
    master = masters.pop()
    node0 = [r for r in got if int(r["node_rank"]) == 0]
    names = {n for r in node0 for n in (r["host"], r["host"].split(".")[0], r["address"])}
    if master not in names and master.split(".")[0] not in names:
        out.append(Difference(target, "master_addr", f"node 0's host or address {sorted(names)}", _text(master)))
    return out


def table(rows: Iterable[Difference]) -> str:
    """The differences as a fixed-width target/field/expected/got table."""
    cells = [("target", "field", "expected", "got"), *((d.target, d.field, d.expected, d.got) for d in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(4)).rstrip() for c in cells)
