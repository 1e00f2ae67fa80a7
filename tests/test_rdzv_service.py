"""`python -m ddpkit.rdzv_store`, the rendezvous store that compose and
Kubernetes run as a service of its own beside an elastic job's nodes: it
listens on its address only, answers the agents' store client, stops on
SIGTERM (what `docker compose down` and the kubelet send) with exit 0, and
says in one line why it cannot start on a taken port."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from tests.test_store_listen import free_port, listening_on


def start(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ddpkit.rdzv_store", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_service_answers_the_agents_client_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = start(port)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"ddpkit.rdzv_store: the rendezvous store listens on 127.0.0.1:{port}"
        assert listening_on(port) == [f"127.0.0.1:{port}"]
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                               wait_for_workers=False)
        client.set("rdzv/state", "round 1")
        assert client.get("rdzv/state") == b"round 1"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.strip() == "ddpkit.rdzv_store: stopped: by SIGTERM" and err == ""


def test_a_taken_port_is_one_line_and_exit_4() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = start(taken.getsockname()[1])
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ddpkit.rdzv_store: ") and "is another store on that port?" in err, err
