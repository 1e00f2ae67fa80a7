"""`python -m ddpkit.rdzv_store`, the rendezvous store that compose and
Kubernetes run as a service of its own beside an elastic job's nodes: it
listens on its address only, answers the agents' store client, stops on
SIGTERM (what `docker compose down` and the kubelet send) with exit 0, and
says in one line why it cannot start on a taken port; given the job's
rendezvous id, it ends by itself once that rendezvous has closed."""

from __future__ import annotations

import base64
import os
import pickle
import signal
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ddpkit.rdzv_store import RDZV_STATE_KEY, Watch, ended, hosted_store, rendezvous_state
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


@pytest.mark.slow
def test_the_service_ends_by_itself_once_the_jobs_rendezvous_closed() -> None:
    """A real one-node elastic run of ddpkit's agent against the service (is_host=0), both with the
    same run key: once the agent has left (it closes the rendezvous), the service exits 0 and says why."""
    port = free_port()
    env = {**os.environ, "DDPKIT_RUN_KEY": "9f" * 16}
    store = subprocess.Popen([sys.executable, "-m", "ddpkit.rdzv_store", "--host", "127.0.0.1", "--port", str(port),
                              "--rdzv-id", "svc-test", "--linger-s", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert store.stdout is not None and "listens on" in store.stdout.readline()
        agent = subprocess.run([sys.executable, "-m", "ddpkit.agent", "--nnodes=1", "--nproc-per-node=1",
                                "--rdzv-backend=ddpkit", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=svc-test",
                                "--rdzv-conf=is_host=0", "--max-restarts=0", "-m", "platform"],
                               capture_output=True, text=True, env=env, timeout=120)
        assert agent.returncode == 0, agent.stderr[-3000:]
        out, err = store.communicate(timeout=60)
    finally:
        if store.poll() is None:
            store.kill()
            store.wait()
    assert store.returncode == 0 and out.strip() == "ddpkit.rdzv_store: stopped: the job's rendezvous closed", err


def _state(closed: bool, beat_s_ago: float | None) -> SimpleNamespace:
    beats = {} if beat_s_ago is None else {"node": datetime.now(timezone.utc) - timedelta(seconds=beat_s_ago)}
    return SimpleNamespace(closed=closed, last_heartbeats=beats)


def test_when_the_service_may_stop() -> None:
    watch = Watch("run", linger_s=60, idle_s=900)
    assert ended(None, watch, None, 0.0) == ("", None)  # no rendezvous yet: the job has not started
    assert ended(_state(False, 5), watch, None, 0.0) == ("", None)  # agents keep it alive
    assert ended(_state(True, 5), watch, None, 100.0) == ("", 100.0)  # closed: it lingers for late agents
    assert ended(_state(True, 5), watch, 100.0, 159.0) == ("", 100.0)
    assert ended(_state(True, 5), watch, 100.0, 160.0) == ("the job's rendezvous closed", 100.0)
    assert ended(_state(False, 901), watch, None, 0.0) == ("no agent's keep-alive for 900 s", None)


def test_only_torchs_state_classes_are_unpickled_from_the_store() -> None:
    """The store takes writes from any client: a value naming another class is no state, and never built."""
    port = free_port()
    with hosted_store("127.0.0.1", port) as store:
        store.set(RDZV_STATE_KEY + "run", base64.b64encode(pickle.dumps(SimpleNamespace(closed=True))))
        assert rendezvous_state(store, "run") is None
        store.set(RDZV_STATE_KEY + "run", b"not base64 at all!")
        assert rendezvous_state(store, "run") is None
        store.set(RDZV_STATE_KEY + "run", base64.b64encode(pickle.dumps(SimpleNamespace())[:9]))  # cut short
        assert rendezvous_state(store, "run") is None
        assert rendezvous_state(store, "other") is None
