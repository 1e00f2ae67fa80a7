"""The arrival check: every rank checks in on the rendezvous store (rank 0
opens it when this process hosts it), and rank 0 names the ranks that never
came within the window. The same store then carries the process group, so
the port is opened once.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ... import records
from ...agent import nodefailure
from ...rendezvous import runkey
from ...rendezvous.listening import listen_fd
from ...shared.exitcodes import ExitCode
from .netlocal import port_in_use_problem, unreachable_problem
from .netproblem import ACK_WAIT_S, RETRY_S, STORE_REPLY_S, WINDOW_VAR, NetCheckError, Peers, Problem

if TYPE_CHECKING:
    import torch.distributed as dist


def _key(name: str) -> str:
    """A check-in key under the run's control prefix (runkey.py): a stranger's
    forged arrival or verdict lands where no rank reads."""
    return f"{runkey.control_prefix()}netcheck/{name}"


@contextmanager
def _watchdog(seconds: float, problem: Problem) -> Iterator[None]:
    """End this process with `problem` if the block takes longer than
    `seconds`. TCPStore's client waits without limit for the store's reply
    when whatever accepted the connection never answers (a port held by
    another program): no exception reaches us, so a timer must end it."""
    def fire() -> None:
        cause = records.Cause("ddpkit train", problem.line(), ExitCode.STARTUP)
        records.emit(cause)
        print(cause.line, file=sys.stderr, flush=True)
        nodefailure.exit_now(ExitCode.STARTUP)  # the node's failure file first, in an srun task

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
    try:
        return listen_fd(family, sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            return None
        raise  # the port is taken: the caller says so


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
