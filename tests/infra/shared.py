"""Infrastructure built once per xdist worker and lent to every module that
asks for the same shape (issue 25 item 2), with isolation between tests
restored here instead of by a new cluster.

`slurm_pool.lease(nodes=N)` hands a module the worker's N-node SlurmCluster
(built on first use); `ssh_pool.lease()` the worker's sshd hosts (login +
node1..node3, node3's NIC named ens5). Modules keep their own fixture names:
their module-scoped fixture wraps the lease.

Isolation, restored after every test (`restore_after_each_test`, autouse in
tests/conftest.py) and checked again when a module gives its lease back:
- Slurm: the jobs the test submitted are cancelled and gone from squeue;
  a node whose slurmd a test killed gets it back and is resumed; every node
  idle again (with jobs of the module's own fixtures still running, in use).
  Between modules also: no reservation, the partition as built, no stray
  process in the hosts.
- sshd hosts: every process the test left in the hosts is killed and gone;
  a dead sshd is started again; links up; /etc/hosts, known_hosts and
  ssh_config as built.
- the environment: tests/conftest.py's `_environment_restored`.
What cannot be restored fails the test (or the module) loudly and the piece
is torn down, so the next module gets a new one rather than a dirty one.

Measured (2 cores, idle): a 2- or 3-node SlurmCluster starts in 1.4-1.8 s
and stops in 0.1-0.3 s; a 4-host sshd set 0.3-1.1 s up, 0.1-0.3 s down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from tests.infra import netns, slurm_cluster, sshd
from tests.infra.slurm_cluster import SlurmCluster

RESTORE_S = 60.0  # what restoring may take before it counts as impossible (KillWait is 5 s)
SSH_NODES = ["node1", "node2", "node3"]
SSH_IFNAMES = ["eth0", "eth0", "eth0", "ens5"]  # login, node1..3: node3 names its NIC differently


class IsolationError(RuntimeError):
    """Shared infrastructure could not be brought back to its clean state."""


class _Lent(Protocol):
    def snapshot(self) -> object: ...
    def restore(self, kept: object) -> None: ...


# What is lent out now in this worker, restored after each test.
_LENT: list[_Lent] = []


def _wait(predicate: Callable[[], bool], what: str, timeout: float = RESTORE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise IsolationError(f"not restored within {timeout:.0f} s: {what}")
        time.sleep(0.2)


def _pids_in(hosts: list[netns.Host]) -> set[int]:
    """Every process in `hosts`' network namespaces: `ip netns pids` for
    all of them in one pass over /proc (it ran once per host, per test)."""
    inodes = set()
    for host in hosts:
        try:
            inodes.add(os.stat(f"/run/netns/{host.ns}").st_ino)
        except FileNotFoundError:
            continue
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/net").st_ino in inodes:
                    found.add(int(entry.name))
            except OSError:
                continue  # gone, or a kernel thread
    return found


def _kill_all_but(hosts: list[netns.Host], keep: set[int], what: str) -> None:
    """SIGKILL every process in `hosts` but `keep`, and wait until they are gone."""
    def strays() -> list[int]:
        return sorted(_pids_in(hosts) - keep)
    for pid in strays():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait(lambda: not strays(), f"processes left in the {what} hosts gone: {strays()}", timeout=15)


# ---- Slurm -------------------------------------------------------------------


@dataclass
class _SlurmLease:
    cluster: SlurmCluster
    partition: str  # `scontrol show partition -o` as built

    def _jobs(self) -> set[str]:
        out = self.cluster.run(["squeue", "-h", "-o", "%i"])
        if out.returncode != 0:
            raise IsolationError(f"squeue failed on the shared cluster: {out.stderr.strip()}")
        return set(out.stdout.split())

    def _nodes(self) -> dict[str, str]:
        out = self.cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
        return dict(zip(out[::2], out[1::2]))

    def snapshot(self) -> set[str]:
        """The jobs already queued (a module fixture's): the test's are the others."""
        return self._jobs()

    def restore(self, kept: object) -> None:
        assert isinstance(kept, set)
        left = self._jobs() - kept
        if left:
            self.cluster.run(["scancel", *sorted(left)])
            _wait(lambda: not (self._jobs() & left), f"jobs {sorted(left)} cancelled and out of squeue")
        self._repair_nodes(busy_ok=bool(kept))

    def _repair_nodes(self, busy_ok: bool) -> None:
        """Every node idle (or in use by the jobs kept); a node a test took
        down gets its slurmd back and is resumed."""
        fine = {"idle", "mixed", "allocated"} if busy_ok else {"idle"}
        broken = sorted(n for n, state in self._nodes().items() if state not in fine)
        if not broken:
            return
        self.cluster.restart_dead_slurmds()
        for name in broken:
            if self._nodes().get(name, "").startswith(("down", "drain", "fail")):
                self.cluster.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"])
        _wait(lambda: all(self._nodes().get(n) in fine for n in broken), f"nodes {broken} back ({self._nodes()})")

    def give_back(self) -> None:
        """Between modules: nothing queued, every node idle, no reservation,
        the partition as built, no process but the daemons in the hosts."""
        self.restore(set())
        reservations = self.cluster.run(["scontrol", "show", "reservation", "-o"]).stdout
        for line in reservations.splitlines():
            if line.startswith("ReservationName="):
                name = line.split()[0].split("=", 1)[1]
                self.cluster.run(["scontrol", "delete", f"ReservationName={name}"])
        if self._partition() != self.partition:
            self.cluster.run(["scontrol", "reconfigure"])
            _wait(lambda: self._partition() == self.partition, "the partition as built", timeout=15)
        assert self.cluster.net is not None
        _kill_all_but(self.cluster.net.hosts, self.cluster.daemon_pids(), "Slurm")

    def _partition(self) -> str:
        return self.cluster.run(["scontrol", "show", "partition", "-o"]).stdout.strip()


@dataclass
class SlurmPool:
    """One SlurmCluster per node count, for this worker."""

    root: Path
    clusters: dict[int, _SlurmLease] = field(default_factory=dict)
    built: int = 0

    def _get(self, nodes: int) -> _SlurmLease:
        if nodes not in self.clusters:
            prefix = f"sp{nodes}{os.getpid() % 100000}"
            cluster = SlurmCluster(self.root / f"slurm-{nodes}", nodes=nodes, prefix=prefix).__enter__()
            partition = cluster.run(["scontrol", "show", "partition", "-o"]).stdout.strip()
            self.clusters[nodes] = _SlurmLease(cluster, partition)
            self.built += 1
        return self.clusters[nodes]

    @contextmanager
    def lease(self, nodes: int = 2) -> Iterator[SlurmCluster]:
        """The worker's `nodes`-node cluster, clean, for one module."""
        reason = slurm_cluster.available()
        if reason:
            pytest.skip(reason)
        lease = self._get(nodes)
        _LENT.append(lease)
        try:
            yield lease.cluster
        finally:
            _LENT.remove(lease)
            try:
                lease.give_back()
            except BaseException:
                self.discard(nodes)
                raise

    def discard(self, nodes: int) -> None:
        lease = self.clusters.pop(nodes, None)
        if lease is not None:
            lease.cluster.__exit__(None, None, None)

    def close(self) -> None:
        for nodes in list(self.clusters):
            self.discard(nodes)


# ---- sshd hosts --------------------------------------------------------------


@dataclass
class _SshLease:
    net: netns.Network
    hosts: sshd.SshHosts

    def _daemons(self) -> set[int]:
        return {p.pid for p in self.hosts.procs if p.poll() is None}

    def snapshot(self) -> set[int]:
        return _pids_in(self.net.hosts)

    def restore(self, kept: object) -> None:
        assert isinstance(kept, set)
        _kill_all_but(self.net.hosts, kept | self._daemons(), "sshd")
        ups = "; ".join(f"ip -n {h.ns} link set {h.ifname} up" for h in self.net.hosts)
        links = subprocess.run(["sh", "-ec", ups], capture_output=True, text=True, check=False)
        if links.returncode != 0:
            raise IsolationError(f"links of the sshd hosts not up again: {links.stderr.strip()}")
        self.net._write_hosts_files()
        self.hosts.write_known_hosts()
        self.hosts.write_ssh_config()
        dead = [h for h, p in zip(self.hosts.hosts, self.hosts.procs) if p.poll() is not None]
        for host in dead:
            self.hosts.restart(host)  # waits until it listens

    def close(self) -> None:
        self.hosts.__exit__()
        self.net.__exit__()


@dataclass
class SshPool:
    """One set of sshd hosts for this worker: login + node1..node3."""

    root: Path
    lease_: _SshLease | None = None
    built: int = 0

    @contextmanager
    def lease(self) -> Iterator[tuple[netns.Network, sshd.SshHosts]]:
        reason = netns.available() or sshd.available()
        if reason:
            pytest.skip(reason)
        if self.lease_ is None:
            self.lease_ = self._build()
        lease = self.lease_
        _LENT.append(lease)
        try:
            yield lease.net, lease.hosts
        finally:
            _LENT.remove(lease)
            try:
                lease.restore(set())
            except BaseException:
                self.close()
                raise

    def _build(self) -> _SshLease:
        net = netns.Network(["login", *SSH_NODES], prefix=f"dkp{os.getpid() % 10000}", ifnames=SSH_IFNAMES)
        net.__enter__()
        try:
            net.wait_reachable()
            folder = self.root / "sshhosts"
            folder.mkdir(exist_ok=True)
            hosts = sshd.SshHosts(net.hosts[1:], net.hosts[0], folder).__enter__()
        except BaseException:
            net.__exit__()
            raise
        self.built += 1
        return _SshLease(net, hosts)

    def close(self) -> None:
        if self.lease_ is not None:
            lease, self.lease_ = self.lease_, None
            lease.close()


# ---- fixtures (tests/conftest.py imports them) -----------------------------------


@pytest.fixture(scope="session")
def slurm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmPool]:
    """This worker's Slurm clusters, one per node count (session scope is
    per worker under xdist)."""
    pool = SlurmPool(tmp_path_factory.mktemp("shared-slurm"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def ssh_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshPool]:
    """This worker's sshd hosts."""
    pool = SshPool(tmp_path_factory.mktemp("shared-sshd"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(autouse=True)
def restore_after_each_test() -> Iterator[None]:
    """What a test did to lent infrastructure, undone after it (module
    fixtures were set up first, so what they started is kept)."""
    kept = [(lent, lent.snapshot()) for lent in _LENT]
    yield
    for lent, snapshot in kept:
        lent.restore(snapshot)

