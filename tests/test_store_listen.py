"""The store ddpkit's rank 0 opens itself (srun mode, mpirun, a manual
start: train/startup/arrival.py) listens at the address MASTER_ADDR names, not on
every address of the host; and falls back to every address where binding
one would cut off peers."""

from __future__ import annotations

import socket
import subprocess

import pytest

from ddpkit.train.startup import arrival
from ddpkit.train.startup.arrival import job_listener
from ddpkit.train.startup.netproblem import Peers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening_on(port: int) -> list[str]:
    """The local addresses that listen on `port` (ss), e.g. ['127.0.0.1:29500'] or ['*:29500']."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines()]


def test_the_listener_is_bound_to_the_master_address_only() -> None:
    port = free_port()
    fd = job_listener("127.0.0.1", port, spans_hosts=False)
    assert fd is not None
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)
        assert listening_on(port) == [f"127.0.0.1:{port}"]


@pytest.mark.parametrize(("addr", "spans_hosts", "why"), [
    ("198.51.100.7", False, "not an address of this host (TEST-NET-2): a NAT or a Service IP"),
    ("127.0.0.1", True, "loopback in a job across hosts: the others never reach it"),
    ("no-such-host.invalid", False, "a name that does not resolve here"),
])
def test_no_listener_where_binding_one_address_would_cut_peers_off(addr: str, spans_hosts: bool, why: str) -> None:
    assert job_listener(addr, free_port(), spans_hosts) is None, why


def test_a_taken_port_is_still_refused_as_taken() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(OSError):
            job_listener("127.0.0.1", holder.getsockname()[1], spans_hosts=False)


def test_rank_0s_store_listens_at_the_master_address_and_answers_there() -> None:
    import torch.distributed as dist

    port = free_port()
    peers = Peers(rank=0, world_size=1, spans_hosts=False, on_master_node=True, master_addr="127.0.0.1",
                  master_port=port, hosts_store=True, joins_store=True)
    store = arrival._create_store(peers, window=5)
    try:
        assert listening_on(port) == [f"127.0.0.1:{port}"]  # torch alone listens on '*'
        store.set("k", "v")
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        assert client.get("k") == b"v"
    finally:
        del store


@pytest.mark.slow
def test_a_keyed_manual_job_forms_its_group_through_the_keyed_store() -> None:
    """With a run key the process group's own keys are under the key's
    prefix (runkey.group_prefix): every rank wraps the store alike and the
    group forms."""
    from ddpkit.rendezvous import runkey
    from tests.test_startup import free_port as startup_port
    from tests.test_startup import report_lines, run_ranks

    url = f"tcp://127.0.0.1:{startup_port()}"
    results = run_ranks([["--init-method", url, "--rank", str(r), "--world-size", "2"] for r in (0, 1)],
                        env={runkey.ENV: runkey.new_key()})
    for res in results:
        assert res.returncode == 0, res.stderr
        assert runkey.ENV not in res.stderr  # a keyed job says nothing about an unset key
    assert sorted({**report_lines(results[0].stdout), **report_lines(results[1].stdout)}) == [0, 1]
