"""Network checks before joining: the named interface exists and has an
address; the master address resolves and its port answers.

Ordering of the port check (why not "telnet master port" everywhere):
the rendezvous port is opened by whoever hosts the store. Under torchrun
the agent on node 0 opens it before any worker starts
(TORCHELASTIC_USE_AGENT_STORE=True), so every worker, rank 0 included, can
probe it. Under srun, mpirun, a PyTorchJob pod or a manual start, rank 0
opens it inside init_process_group: rank 0 has nothing to probe yet, and the
other ranks must retry until it is up. So: every process that does not host
the store probes with retries up to --connect-timeout; a process that hosts
it skips the probe and the rendezvous itself proves the port (every rank
got through it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..host import netif
from ..train.startup import netlocal, netproblem
from .results import Check, Status

SECTION = "network"


@dataclass(frozen=True)
class Master:
    addr: str | None
    port: int | None
    hosts_store: bool  # this process opens the port itself (rank 0 without an agent store)


def interface_names(cli_choice: str, env: dict[str, str]) -> list[tuple[str, str]]:
    """(where it came from, value) for every interface setting in force.
    The environment variables win over the flag: that is what NCCL and Gloo read."""
    return [("--interface / DDPKIT_INTERFACE" if src == "--interface" else src, value)
            for src, value in netlocal.interface_settings(cli_choice, env)]


def check_interface(source: str, value: str, master_addr: str | None, rank: int, host: str,
                    spans_hosts: bool = False) -> Check:
    """The same checks `ddpkit train` runs before joining (netcheck), as a row."""
    def row(status: Status, detail: str, fix: str = "") -> Check:
        return Check(SECTION, f"interface ({source})", status, detail, fix, rank, host, status is Status.FAIL)

    if value == "auto":
        if master_addr is None:
            return row(Status.SKIP, "auto, single process: no peers to reach")
        picked = netlocal.auto_choice(master_addr)
        if isinstance(picked, netproblem.Problem):
            return row(Status.FAIL, picked.cause, picked.fix)
        return row(Status.PASS, f"auto -> {picked.name} ({picked.reason})")
    problem = netlocal.interface_problem(source, value, spans_hosts)
    if problem is not None:
        return row(Status.FAIL, problem.cause, problem.fix)
    if value.startswith("^"):
        return row(Status.PASS, f"{value!r} excludes interfaces (NCCL syntax)")
    return row(Status.PASS, ", ".join(f"{n} {netif.ipv4_address(n)}" for n in netlocal.names_in(value)))


def check_resolves(master: Master, rank: int, host: str) -> Check:
    if master.addr is None:
        return Check(SECTION, "master resolves", Status.SKIP, "single process: no master", rank=rank, host=host)
    problem = netlocal.resolve_problem(master.addr)
    if problem is not None:
        return Check(SECTION, "master resolves", Status.FAIL, problem.cause, problem.fix, rank, host, True)
    ip = netif.resolve_ipv4(master.addr)
    return Check(SECTION, "master resolves", Status.PASS, f"{master.addr} -> {ip}", rank=rank, host=host)


def check_port(master: Master, timeout_s: float, rank: int, host: str) -> Check:
    name = "master port"
    if master.addr is None or master.port is None:
        return Check(SECTION, name, Status.SKIP, "single process: no rendezvous", rank=rank, host=host)
    where = f"{master.addr}:{master.port}"
    if master.hosts_store:
        busy = netlocal.port_in_use_problem(master.port)
        if busy is not None:
            return Check(SECTION, name, Status.FAIL, busy.cause, busy.fix, rank, host, True)
        return Check(SECTION, name, Status.SKIP,
                     f"this process opens {where} itself and it is free; the rendezvous below proves it",
                     rank=rank, host=host)
    ok, why, took = netlocal.port_answers(master.addr, master.port, timeout_s)
    if ok:
        return Check(SECTION, name, Status.PASS, f"{where} answered in {took * 1000:.0f} ms", rank=rank, host=host)
    return Check(SECTION, name, Status.FAIL, f"{where} did not answer within {timeout_s:g} s ({why})",
                 f"check that node 0 runs the job and listens on {master.port}, that a firewall or security "
                 f"group allows TCP {master.port} between nodes, and that MASTER_ADDR names node 0",
                 rank, host, True)


def hosts_store(rank: int, launcher: str, env: dict[str, str]) -> bool:
    """Does this process open the rendezvous port itself?"""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return False  # the torchrun agent already holds it
    return rank == 0 and launcher not in ("spawn", "single")
