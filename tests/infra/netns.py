"""Test hosts as Linux network namespaces joined by a bridge.

Each host is a real network stack with its own address, interface name,
hostname and /etc/hosts, so multi-node code paths (rendezvous, interface
selection, sshd, slurmd) run as they would across machines.

Pitfalls handled here:
- the bridge lives in its own namespace: a Docker daemon in the root namespace
  sets the FORWARD policy to DROP, which would cut bridged traffic there;
- `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts, which is
  how every host resolves the others by name;
- hostnames come from a fresh UTS namespace per command (`unshare --uts`), so
  `hostname` and socket.gethostname() differ per host;
- `ip netns exec` remounts /sys without /sys/fs/cgroup; commands that need it
  (slurmd) pass `cgroup=True` to get the cgroup tree bound back.

Every network made here is private to the test (its own bridge namespace, no
route to the root namespace), so its subnet cannot collide with anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETNS_ETC = Path("/etc/netns")
# The root namespace's cgroup tree, bound here once so that commands inside a
# namespace (where /sys was remounted) can bind it back.
CGROUP_STASH = Path("/run/ddpkit-test-cgroup")

# Runs inside the host's namespaces: set the hostname, optionally restore the
# cgroup tree, then become the command. "$0" is the hostname.
_WRAPPER = 'hostname "$0" && {cgroup}exec "$@"'
_CGROUP = f"mount --rbind {CGROUP_STASH} /sys/fs/cgroup && "


def available() -> str | None:
    """None when namespaces can be made here, else the reason to skip."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    ifname: str

    def argv(self, cmd: list[str], *, cgroup: bool = False) -> list[str]:
        """`cmd` as run on this host."""
        wrapper = _WRAPPER.format(cgroup=_CGROUP if cgroup else "")
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", wrapper, self.name, *cmd]

    def run(self, cmd: list[str], *, cgroup: bool = False, check: bool = False,
            timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.argv(cmd, cgroup=cgroup), check=check, text=True, timeout=timeout, **kwargs)

    def popen(self, cmd: list[str], *, cgroup: bool = False, **kwargs: Any) -> subprocess.Popen[str]:
        kwargs.setdefault("text", True)
        return subprocess.Popen(self.argv(cmd, cgroup=cgroup), **kwargs)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]


@dataclass
class Network:
    """`with Network(["node1", "node2"]) as net:` -> net.hosts, net["node1"].

    `ifnames` gives each host's interface name (default eth0 everywhere);
    `prefix` keeps concurrent networks' namespace names apart."""

    names: list[str]
    prefix: str = field(default_factory=lambda: f"dk{os.getpid() % 100000}")
    subnet: str = "10.213.77"
    ifnames: list[str] | None = None
    hosts: list[Host] = field(default_factory=list, init=False)

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def __getitem__(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def __enter__(self) -> Network:
        if len(self.names) > 250:
            raise ValueError("one /24 holds at most 250 test hosts")
        self._teardown_namespaces()
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        try:
            for index, name in enumerate(self.names):
                self.hosts.append(self._add_host(index, name))
            self._write_hosts_files()
            self._stash_cgroup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _add_host(self, index: int, name: str) -> Host:
        ifname = self.ifnames[index] if self.ifnames else "eth0"
        host = Host(name=name, ns=f"{self.prefix}-{name}", addr=f"{self.subnet}.{index + 2}", ifname=ifname)
        _ip("netns", "add", host.ns)
        peer = f"v{index}"
        _ip("-n", self.bridge_ns, "link", "add", peer, "type", "veth", "peer", "name", ifname, "netns", host.ns)
        _ip("-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", ifname)
        _ip("-n", host.ns, "link", "set", ifname, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        return host

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1\tlocalhost", *(f"{h.addr}\t{h.name}" for h in self.hosts)]
        for host in self.hosts:
            folder = NETNS_ETC / host.ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def hosts_lines(self, host: Host) -> list[str]:
        """The /etc/hosts lines `host` sees now."""
        return (NETNS_ETC / host.ns / "hosts").read_text().splitlines()

    def set_hosts_lines(self, host: Host, lines: list[str]) -> None:
        """Give `host` its own /etc/hosts (read by every later command there)."""
        target = NETNS_ETC / host.ns / "hosts"
        tmp = target.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, target)

    def name_v4_mapped(self) -> None:
        """Every host's /etc/hosts also names each IPv4 address in its
        IPv4-mapped IPv6 form (`::ffff:10.0.0.2`). torch's c10d client connects
        to an IPv4 address as a mapped one and looks up its name; the hosts
        file answers only the plain form, so the lookup goes on to DNS, which
        no namespace reaches (EAI_AGAIN), and c10d warns `The hostname of the
        client socket cannot be retrieved`. A cluster with a working DNS
        answers it (a name, or none: no warning either way)."""
        for host in self.hosts:
            lines = [line for line in self.hosts_lines(host) if not line.startswith("::ffff:")]
            mapped = [f"::ffff:{line}" for line in lines if line.split("\t")[0].count(".") == 3]
            self.set_hosts_lines(host, [*lines, *mapped])

    def debian_own_name(self, host: Host) -> None:
        """`host` resolves its own name to 127.0.1.1, as Debian/Ubuntu's
        installer writes /etc/hosts; the others still see its real address."""
        others = [line for line in self.hosts_lines(host) if not line.endswith(f"\t{host.name}")]
        self.set_hosts_lines(host, [*others, f"127.0.1.1\t{host.name}"])

    def set_link(self, host: Host, up: bool) -> None:
        """`ip link set IFACE up|down` inside `host`: down loses the host
        without a reset; its peers see silence."""
        _ip("-n", host.ns, "link", "set", host.ifname, "up" if up else "down")

    @staticmethod
    def _stash_cgroup() -> None:
        if CGROUP_STASH.is_dir() and os.path.ismount(CGROUP_STASH):
            return
        CGROUP_STASH.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--rbind", "/sys/fs/cgroup", str(CGROUP_STASH)], check=False, capture_output=True)

    def wait_reachable(self, timeout: float = 10.0) -> None:
        """Block until host 0 reaches every other host. A TCP connect to a
        closed port answers 'refused' only when the peer is reachable."""
        deadline = time.monotonic() + timeout
        probe = "import socket,sys; s=socket.socket(); s.settimeout(1); sys.exit(s.connect_ex((sys.argv[1], 9)) != 111)"
        for host in self.hosts[1:]:
            while self.hosts[0].run([sys.executable, "-c", probe, host.addr]).returncode != 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{host.name} ({host.addr}) unreachable from {self.hosts[0].name}")
                time.sleep(0.1)

    def kill_all(self) -> None:
        """SIGKILL every process left in this network's host namespaces."""
        for host in self.hosts:
            for pid in host.pids():
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    def _teardown_namespaces(self) -> None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        mine = [line.split()[0] for line in listed.splitlines() if line.startswith(f"{self.prefix}-")]
        for ns in mine:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        self._teardown_namespaces()
        self.hosts.clear()
