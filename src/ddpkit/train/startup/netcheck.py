"""Network checks that run before a process joins any process group, shared
by `ddpkit train` and `ddpkit doctor`.

Each check answers with a Problem: one line of cause and one of fix. Without
these, a wrong interface name ends in gloo's traceback, a master that nobody
can reach or a rank that never starts ends only at the 30-minute rendezvous
timeout, and a port already taken ends in a raw DistNetworkError.

    store = before_join(Peers.from_launch(info), dist_timeout_s)   # train
    problems = interface_problems(choice, env, spans_hosts)        # doctor

The arrival check (which ranks never came) needs the rendezvous store: when
this process hosts it (rank 0 under srun, mpirun, a pod or a manual start),
rank 0 opens the TCPStore itself, every rank checks in under its own key, and
rank 0 names the ranks that did not check in within the window. The same
store then carries the process group, so the port is opened once. Under
torchrun the agent holds the store and has already met its peers: only the
local checks run.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ... import netif, runkey
from ...envnames import DDPKIT_RENDEZVOUS_WINDOW, SOCKET_IFNAMES
from ...exitcodes import ExitCode
from .launchinfo import LaunchInfo, StartupError

if TYPE_CHECKING:
    import torch.distributed as dist

WINDOW_VAR = DDPKIT_RENDEZVOUS_WINDOW
# A non-master retries the master's port this long; rank 0 waits this long
# after the last arrival. A fault must end the job within 30 s, torch's
# import included. Launchers whose nodes start minutes apart (pods pulling
# images) raise it through DDPKIT_RENDEZVOUS_WINDOW.
DEFAULT_WINDOW_S = 10.0
RETRY_S = 0.2
STORE_REPLY_S = 10.0
ACK_WAIT_S = 3.0  # how long rank 0 keeps the store up so arrived ranks read its verdict


def _key(name: str) -> str:
    """A check-in key under the run's control prefix (runkey.py): a stranger's
    forged arrival or verdict lands where no rank reads."""
    return f"{runkey.control_prefix()}netcheck/{name}"


@dataclass(frozen=True)
class Problem:
    check: str
    cause: str
    fix: str

    def line(self) -> str:
        return f"{self.cause}; fix: {self.fix}"


class NetCheckError(StartupError):
    """A pre-join network check failed: the job cannot form its group."""

    exit_code = ExitCode.STARTUP

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.line())
        self.problem = problem


@dataclass(frozen=True)
class Peers:
    """What the checks need to know about this process's place in the job."""

    rank: int
    world_size: int
    spans_hosts: bool       # the job has processes on other hosts
    on_master_node: bool    # this process runs on node 0 (the master's host)
    master_addr: str | None
    master_port: int | None
    hosts_store: bool       # this process opens the rendezvous port itself
    joins_store: bool       # this process meets its peers through a TCP store we may open

    @classmethod
    def from_launch(cls, info: LaunchInfo, env: Mapping[str, str] = os.environ) -> Peers:
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        tcp = info.init_method.startswith(("env://", "tcp://")) and info.master_port is not None
        joins = tcp and not agent_store and info.launcher not in ("single", "spawn")
        node0 = info.node_rank == 0 if info.node_rank is not None else info.rank == 0
        # A master named as loopback (127.0.0.1, localhost) means one machine,
        # and a manual start that was not told its node does not know its hosts.
        local = info.master_addr is None or netif.is_local_name(info.master_addr)
        spans = info.world_size > info.local_world_size and info.node_rank is not None and not local
        return cls(info.rank, info.world_size, spans, node0, info.master_addr,
                   info.master_port, joins and info.rank == 0, joins)


def window_s(env: Mapping[str, str] = os.environ) -> float:
    raw = env.get(WINDOW_VAR, "")
    try:
        return float(raw) if raw else DEFAULT_WINDOW_S
    except ValueError:
        raise NetCheckError(Problem("rendezvous", f"{WINDOW_VAR}={raw!r} is not a number of seconds",
                                    f"unset {WINDOW_VAR} or give seconds, e.g. 120")) from None


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


# ---- arrival -----------------------------------------------------------------------

@contextmanager
def _watchdog(seconds: float, problem: Problem) -> Iterator[None]:
    """End this process with `problem` if the block takes longer than
    `seconds`. TCPStore's client waits without limit for the store's reply
    when whatever accepted the connection never answers (a port held by
    another program): no exception reaches us, so a timer must end it."""
    def fire() -> None:
        print(f"ddpkit train: {problem.line()}", file=sys.stderr, flush=True)
        os._exit(ExitCode.STARTUP)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _silent_store(peers: Peers, window: float) -> Problem:
    where = f"{peers.master_addr}:{peers.master_port}"
    return Problem("rendezvous", f"{where} accepted the connection but no rendezvous store answered within "
                   f"{window:.0f} s: another program holds the port, or rank 0 stopped",
                   f"see rank 0's log; if something else listens on {peers.master_port} there, choose another "
                   "port (network.master_port in the job spec, or MASTER_PORT)")


def _open_store(peers: Peers, window: float) -> dist.TCPStore:
    assert peers.master_addr is not None and peers.master_port is not None
    if peers.hosts_store:
        return _create_store(peers, window)
    # A store that accepted the connection answers in milliseconds: give it
    # STORE_REPLY_S, not the whole window, so the job still ends within 30 s.
    with _watchdog(min(window, STORE_REPLY_S), _silent_store(peers, min(window, STORE_REPLY_S))):
        return _create_store(peers, window)


def job_listener(master_addr: str, port: int, spans_hosts: bool) -> int | None:
    """A socket listening on `port` at the one address `master_addr` names,
    when that address is this host's: the store then answers on the job's
    network only, not on every address of the host. Its file descriptor, for
    TCPStore(master_listen_fd=). None, and the store listens everywhere as
    torch's does, when the name gives several addresses (a peer may connect
    to any), an address that is not this host's (a NAT, a Service IP), or a
    loopback address in a job across hosts (Debian names its own host
    127.0.1.1, which the other hosts never reach)."""
    try:
        infos = socket.getaddrinfo(master_addr, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    if len({info[4][0] for info in infos}) != 1:
        return None
    family, _, _, _, sockaddr = infos[0]
    if spans_hosts and ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback:
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            return None
        raise  # the port is taken: the caller says so
    return sock.detach()


def _create_store(peers: Peers, window: float) -> dist.TCPStore:
    import torch.distributed as dist

    assert peers.master_addr is not None and peers.master_port is not None
    try:
        fd = job_listener(peers.master_addr, peers.master_port, peers.spans_hosts) if peers.hosts_store else None
        return dist.TCPStore(peers.master_addr, peers.master_port, peers.world_size, is_master=peers.hosts_store,
                             timeout=datetime.timedelta(seconds=window), wait_for_workers=False,
                             master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if peers.hosts_store:
            raise NetCheckError(port_in_use_problem(peers.master_port) or Problem(
                "master port", f"cannot open the rendezvous store on port {peers.master_port}: {first}",
                "choose another port (network.master_port, or MASTER_PORT)")) from None
        raise NetCheckError(unreachable_problem(peers.master_addr, peers.master_port, first, window)) from None


def _missing_ranks(store: dist.TCPStore, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([_key(f"arrived/{r}")])]


def _await_arrivals(store: dist.TCPStore, peers: Peers, window: float) -> None:
    """Rank 0: wait for every rank's check-in; name the ones that never came.
    The window restarts with each arrival, so a large job whose ranks keep
    trickling in (a slow shared filesystem) is not a false alarm; a rank
    that never comes ends the wait `window` seconds after the last arrival."""
    arrived = int(store.add(_key("count"), 0))
    deadline = time.monotonic() + window
    while arrived < peers.world_size and time.monotonic() < deadline:
        time.sleep(RETRY_S)
        now = int(store.add(_key("count"), 0))
        if now > arrived:
            arrived, deadline = now, time.monotonic() + window
    missing = _missing_ranks(store, peers.world_size)
    if not missing:
        store.set(_key("verdict"), "ok")
        return
    shown = ", ".join(map(str, missing[:32])) + (f" and {len(missing) - 32} more" if len(missing) > 32 else "")
    problem = Problem("rendezvous", f"rendezvous at {peers.master_addr}:{peers.master_port} timed out, "
                      f"{window:.0f} s after the last arrival: {len(missing)} of {peers.world_size} ranks never arrived "
                      f"(ranks {shown})",
                      "check that the nodes running those ranks started (the scheduler's log for them) and that "
                      f"they reach {peers.master_addr}:{peers.master_port} (firewall, MASTER_ADDR, interface); "
                      f"if nodes start slowly, raise {WINDOW_VAR}")
    store.set(_key("verdict"), problem.cause)
    _wait_acks(store, peers.world_size - len(missing))
    raise NetCheckError(problem)


def _wait_acks(store: dist.TCPStore, arrived: int) -> None:
    # The ranks that did arrive read the verdict before this process (and the store) goes.
    deadline = time.monotonic() + ACK_WAIT_S
    while int(store.add(_key("acks"), 0)) < arrived - 1 and time.monotonic() < deadline:
        time.sleep(RETRY_S)


def _check_in(store: dist.TCPStore, peers: Peers, verdict_s: float) -> None:
    """Any rank but 0: announce this rank, then wait for rank 0's verdict
    (rank 0 stopping drops the connection: that ends the wait at once)."""
    store.set(_key(f"arrived/{peers.rank}"), socket.gethostname())
    store.add(_key("count"), 1)
    if peers.hosts_store:
        return
    try:
        store.wait([_key("verdict")], datetime.timedelta(seconds=verdict_s))
        verdict = store.get(_key("verdict")).decode()
    except RuntimeError as exc:
        raise NetCheckError(Problem("rendezvous", f"rank 0 at {peers.master_addr}:{peers.master_port} gave no "
                                    f"verdict on the arrivals ({str(exc).splitlines()[0] if str(exc) else exc!r})",
                                    "see rank 0's log: it names the ranks that never arrived")) from None
    store.add(_key("acks"), 1)
    if verdict != "ok":
        raise NetCheckError(Problem("rendezvous", f"rank 0 stopped the job: {verdict}",
                                    "see rank 0's log for the fix"))


def arrival(peers: Peers, window: float, dist_timeout_s: float) -> dist.TCPStore:
    """Open (rank 0) or join the rendezvous store, and make sure every rank
    arrived within the window. The store is returned for the process group."""
    store = _open_store(peers, window)
    _check_in(store, peers, dist_timeout_s)
    if peers.hosts_store:
        _await_arrivals(store, peers, window)
    store.set_timeout(datetime.timedelta(seconds=dist_timeout_s))
    return store


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


def before_join(info: LaunchInfo, choice: str, dist_timeout_s: float,
                env: Mapping[str, str] = os.environ) -> dist.TCPStore | None:
    """Run every check for this process; raise NetCheckError on the first
    problem. Returns the rendezvous store for init_process_group(store=...)
    when this process meets its peers through one we open, else None."""
    peers = Peers.from_launch(info, env)
    problems = local_problems(peers, choice, env)
    if problems:
        raise NetCheckError(problems[0])
    _say_interface(info, choice, env)
    if not peers.joins_store:
        return None
    assert peers.master_addr is not None and peers.master_port is not None
    window = window_s(env)
    if not peers.hosts_store:
        unreachable = connect_problem(peers.master_addr, peers.master_port, window)
        if unreachable is not None:
            raise NetCheckError(unreachable)
    return arrival(peers, window, dist_timeout_s)


def _say_interface(info: LaunchInfo, choice: str, env: Mapping[str, str]) -> None:
    """One log line per node: which interface the job will use, and why."""
    if info.local_rank != 0 or info.master_addr is None:
        return
    settings = interface_settings(choice, env)
    source, value = settings[-1]  # Gloo's variable when set: this job's transport on CPU
    if value == "auto":
        picked = auto_choice(info.master_addr)
        value, why = (picked.name, picked.reason) if isinstance(picked, netif.Choice) else ("?", picked.cause)
    else:
        why = f"from {source}"
    node = "" if info.node_rank is None else f"node {info.node_rank} "
    print(f"ddpkit: {node}host {socket.gethostname()} interface {value} ({why})", file=sys.stderr, flush=True)
