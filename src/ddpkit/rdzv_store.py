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
  ddpkit.rdzv_store --port PORT`: no GPU, a few MB, restarted by its
  controller. A restarted store is an empty one: the agents fail on their
  next read, their nodes are restarted, meet in it again and resume from
  the last checkpoint.

The store listens on one address only (a pre-bound socket handed to
TCPStore), not on every address of the host.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from .exitcodes import ExitCode, exit_on
from .listening import listen_fd

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


def serve(host: str, port: int) -> int:
    """Hosts the store on host:port until SIGTERM or SIGINT (blocked and
    waited for, so that as a container's PID 1 it still stops on them);
    the exit code."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before the store's threads start: they inherit it
    try:
        with hosted_store(host, port):
            print(f"ddpkit.rdzv_store: the rendezvous store listens on {host}:{port}", flush=True)
            got = signal.sigwait(STOP_SIGNALS)
    except OSError as exc:
        return exit_on("ddpkit.rdzv_store", f"{exc}; is another store on that port?", ExitCode.STARTUP)
    print(f"ddpkit.rdzv_store: stopped by {signal.Signals(got).name}", flush=True)
    return int(ExitCode.OK)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpkit.rdzv_store",
                                     description="Host an elastic job's rendezvous store until stopped.")
    parser.add_argument("--port", type=int, required=True, help="the rendezvous port the nodes' agents name")
    parser.add_argument("--host", default=None,
                        help="the address to listen on (default: this host's name, the one the nodes reach)")
    args = parser.parse_args(argv)
    return serve(args.host or socket.gethostname(), args.port)


if __name__ == "__main__":
    sys.exit(main())
