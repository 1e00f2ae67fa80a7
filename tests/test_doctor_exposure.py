"""`ddpkit doctor`'s master port exposure row: the addresses the port
listens at on the store's host, read from this network namespace's sockets,
against the host's other networks."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from ddpkit.doctor.exposure import check_exposure, listen_addresses
from ddpkit.doctor.network import Master
from ddpkit.doctor.results import Status
from ddpkit.host.netif import Interface

JOB, OTHER = Interface("eth0", "10.0.0.1"), Interface("docker0", "172.17.0.1")


def listening(port: int, *addresses: str) -> Callable[[int], list[str]]:
    """This host's listeners as the row sees them: `addresses` on `port`, nothing elsewhere."""
    return lambda asked: sorted(addresses) if asked == port else []


def test_a_port_on_every_address_of_a_host_with_other_networks_is_a_warning() -> None:
    row = check_exposure(Master("10.0.0.1", 29500, False), 0, "n0", [Interface("lo", "127.0.0.1"), JOB, OTHER],
                         listening(29500, "0.0.0.0", "::"))
    assert row.status is Status.WARN
    assert "listens on every address (0.0.0.0, ::)" in row.detail
    assert "besides the job's 10.0.0.1 (10.0.0.1) it answers on docker0=172.17.0.1" in row.detail
    assert "firewall" in row.fix and "master_port range" in row.fix


def test_a_port_bound_to_the_job_address_or_a_host_with_one_network_passes() -> None:
    row = check_exposure(Master("10.0.0.1", 29500, False), 0, "n0", [JOB, OTHER], listening(29500, "10.0.0.1"))
    assert row.status is Status.PASS and "listens at 10.0.0.1 only" in row.detail
    row = check_exposure(Master("10.0.0.1", 29500, False), 0, "n0", [JOB], listening(29500, "0.0.0.0", "::"))
    assert row.status is Status.PASS and "no network but the job's" in row.detail


def test_a_host_without_the_store_skips() -> None:
    row = check_exposure(Master("10.0.0.1", 4242, False), 0, "n1", [JOB], listening(29500, "0.0.0.0"))
    assert row.status is Status.SKIP


@pytest.mark.parametrize(("family", "bind", "shown"), [
    (socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET, "0.0.0.0", "0.0.0.0"), (socket.AF_INET6, "::", "::")])
def test_this_hosts_own_listeners_are_found(family: socket.AddressFamily, bind: str, shown: str) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((bind, 0))
        sock.listen()
        assert listen_addresses(sock.getsockname()[1]) == [shown]


def test_a_connected_socket_is_not_a_listener() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert listen_addresses(client.getsockname()[1]) == []
            assert listen_addresses(server.getsockname()[1]) == ["127.0.0.1"]
