"""The rendezvous store of an elastic job, outside every training node.

torchrun's c10d rendezvous keeps its state in a TCPStore that one agent
hosts; the others are its clients. When that agent's node is lost, the
store goes with it and every other agent fails on its next read: one node
(node 0) must never fail. Here the store lives where no training runs, and
every agent is a client (`is_host=0` in its --rdzv-conf): any node may then
go, node 0 too, and the others meet again in the same store.

- A launcher that outlives every node (`launch local`, whose loss ends the
  run anyway) hosts it itself; `launch ssh` too, where every node reaches
  the launcher (launch/ssh/storesite.py).
- Where no launcher of ddpkit's stays (compose, Kubernetes), the rendered
  files run it as a service of its own beside the nodes, `python -m
  ddpkit.rdzv_store --port PORT --rdzv-id ID`: no GPU, restarted by its
  controller if it fails. A restarted store is an empty one: the agents fail
  on their next read, their nodes are restarted, meet in it again and resume
  from the last checkpoint. It ends by itself, exit 0, once the job has (its
  rendezvous closed, or no agent's keep-alive for a long while), so nothing
  of the job is left running.

The store listens on one address only (a pre-bound socket handed to
TCPStore), not on every address of the host.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from .rendezvous import runkey
from .rendezvous.listening import listen_fd
from .rendezvous.members import Membership
from .shared.exitcodes import ExitCode, exit_on

if TYPE_CHECKING:
    import torch.distributed as dist


def listener(host: str, port: int) -> int:
    """A socket listening on host:port only, for hosted_store to own later;
    OSError when the port cannot be taken."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return listen_fd(family, address)


@contextmanager
def hosted_store(host: str, port: int, fd: int | None = None) -> Iterator[dist.TCPStore]:
    """A TCPStore server on host:port for the whole block, on `fd` when the
    caller opened the listener already (listener); OSError when the port
    cannot be taken."""
    import torch.distributed as dist

    fd = listener(host, port) if fd is None else fd
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30), master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        os.close(fd)
        raise OSError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from None
    yield store


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
RDZV_STATE_KEY = "torch.rendezvous."  # + the run id: torch's c10d backend keeps its rendezvous state there
# (ddpkit's handler keeps its membership beside it: rdzv_members.prefix)
POLL_S = 2.0
# What torch's rendezvous state is made of: the only classes its unpickling may
# build (the state is in a store that other clients can write to).
STATE_CLASSES = {("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
                 ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
                 ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta")}


@dataclass(frozen=True)
class Watch:
    """When a service's store ends by itself: once the job's rendezvous has
    closed (the job ended: its agents close it as they leave) and `linger_s`
    more have passed (a late agent still reads it), or once every agent has
    been silent for `idle_s` (no keep-alive: the job is gone)."""

    run_id: str  # as the agents name it (runkey.rdzv_run_id of the rendered id)
    linger_s: float
    idle_s: float


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in STATE_CLASSES:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")
        return super().find_class(module, name)


def rendezvous_state(store: dist.Store, run_id: str) -> Any | None:
    """torch's c10d rendezvous state for `run_id` in `store`; None where there
    is none yet or it is not one."""
    key = RDZV_STATE_KEY + run_id
    if not store.check([key]):
        return None
    try:
        return _StateUnpickler(io.BytesIO(base64.b64decode(bytes(store.get(key)), validate=True))).load()
    except Exception:  # any client may have written these bytes: whatever fails to load is no state
        return None  # torch's null sentinel before the first round, or not torch's state


def job_state(store: dist.Store, run_id: str) -> Any | None:
    """The job's rendezvous for the watch: ddpkit's membership (rdzv_members.py, `--rdzv-backend=ddpkit`),
    else torch's c10d state (`elastic.rendezvous: torchrun`); None where neither has begun."""
    members = Membership(store, run_id).summary()
    return members if members is not None else rendezvous_state(store, run_id)


def ended(state: Any | None, watch: Watch, closed_at: float | None, now: float) -> tuple[str, float | None]:
    """Why the store may stop now ('' while it may not), and since when the rendezvous is closed."""
    if state is None:
        return "", None
    if getattr(state, "closed", False):
        closed_at = now if closed_at is None else closed_at
        return ("the job's rendezvous closed" if now - closed_at >= watch.linger_s else ""), closed_at
    beats = [t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t for t in getattr(state, "last_heartbeats", {}).values()]
    if beats and datetime.now(timezone.utc) - max(beats) > timedelta(seconds=watch.idle_s):
        return f"no agent's keep-alive for {watch.idle_s:.0f} s", None
    return "", None


def serve(host: str, port: int, watch: Watch | None = None) -> int:
    """Hosts the store on host:port until SIGTERM or SIGINT (blocked and
    waited for, so that as a container's PID 1 it still stops on them), or
    until `watch` says the job has ended; the exit code."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before the store's threads start: they inherit it
    try:
        with hosted_store(host, port) as store:
            print(f"ddpkit.rdzv_store: the rendezvous store listens on {host}:{port}", flush=True)
            why = _until_stopped(store, watch)
    except OSError as exc:
        return exit_on("ddpkit.rdzv_store", f"{exc}; is another store on that port?", ExitCode.STARTUP)
    print(f"ddpkit.rdzv_store: stopped: {why}", flush=True)
    return int(ExitCode.OK)


def _until_stopped(store: dist.Store, watch: Watch | None) -> str:
    if watch is None:
        return f"by {signal.Signals(signal.sigwait(STOP_SIGNALS)).name}"
    closed_at: float | None = None
    while True:
        got = signal.sigtimedwait(STOP_SIGNALS, POLL_S)
        if got is not None:
            return f"by {signal.Signals(got.si_signo).name}"
        why, closed_at = ended(job_state(store, watch.run_id), watch, closed_at, time.monotonic())
        if why:
            return why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpkit.rdzv_store",
                                     description="Host an elastic job's rendezvous store until stopped, or until "
                                                 "the job's rendezvous has closed (--rdzv-id).")
    parser.add_argument("--port", type=int, required=True, help="the rendezvous port the nodes' agents name")
    parser.add_argument("--host", default=None,
                        help="the address to listen on (default: this host's name, the one the nodes reach)")
    parser.add_argument("--rdzv-id", default=None,
                        help="the job's rendered rendezvous id: stop once that rendezvous has closed (tagged with "
                             "the run key, DDPKIT_RUN_KEY, as the agents tag it)")
    parser.add_argument("--linger-s", type=float, default=60.0, help="how long to stay once it has closed")
    parser.add_argument("--idle-s", type=float, default=900.0,
                        help="stop once no agent has sent a keep-alive for this long")
    args = parser.parse_args(argv)
    watch = None if args.rdzv_id is None else Watch(runkey.rdzv_run_id(args.rdzv_id), args.linger_s, args.idle_s)
    return serve(args.host or socket.gethostname(), args.port, watch)


if __name__ == "__main__":
    sys.exit(main())
