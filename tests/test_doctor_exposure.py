"""`ddpkit doctor`'s master port exposure row: the addresses the port
listens at on the store's host, read from /proc/net/tcp{,6}, against the
host's other networks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ddpkit.doctor.exposure import check_exposure, listen_addresses
from ddpkit.doctor.network import Master
from ddpkit.doctor.results import Status
from ddpkit.netif import Interface

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
# 29500 = 0x733C; 10.0.0.1 little-endian = 0100000A; LISTEN is 0A, ESTABLISHED 01
TCP = HEADER + (
    "   0: 00000000:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
    "   1: 0100000A:733C 0200000A:D431 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n"
    "   2: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1\n")
TCP6 = HEADER + (
    "   0: 00000000000000000000000000000000:733C 00000000000000000000000000000000:0000 0A 0:0 0:0 0 0 0 4 1\n")
JOB, OTHER = Interface("eth0", "10.0.0.1"), Interface("docker0", "172.17.0.1")


def proc_net(tmp_path: Path, tcp: str = TCP, tcp6: str = TCP6) -> Path:
    (tmp_path / "tcp").write_text(tcp)
    (tmp_path / "tcp6").write_text(tcp6)
    return tmp_path


def test_listeners_are_read_from_both_tables_and_only_in_listen_state(tmp_path: Path) -> None:
    assert listen_addresses(29500, proc_net(tmp_path)) == ["0.0.0.0", "::"]
    assert listen_addresses(8080, proc_net(tmp_path)) == ["127.0.0.1"]
    assert listen_addresses(1, proc_net(tmp_path)) == []


def test_a_port_on_every_address_of_a_host_with_other_networks_is_a_warning(tmp_path: Path) -> None:
    row = check_exposure(Master("10.0.0.1", 29500, False), 0, "n0", [Interface("lo", "127.0.0.1"), JOB, OTHER],
                         proc_net(tmp_path))
    assert row.status is Status.WARN
    assert "besides the job's 10.0.0.1 (10.0.0.1) it answers on docker0=172.17.0.1" in row.detail
    assert "firewall" in row.fix and "master_port range" in row.fix


def test_a_port_bound_to_the_job_address_or_a_host_with_one_network_passes(tmp_path: Path) -> None:
    bound = TCP.replace("00000000:733C 00000000:0000 0A", "0100000A:733C 00000000:0000 0A")
    row = check_exposure(Master("10.0.0.1", 29500, False), 0, "n0", [JOB, OTHER], proc_net(tmp_path, bound, HEADER))
    assert row.status is Status.PASS and "listens at 10.0.0.1 only" in row.detail
    row = check_exposure(Master("10.0.0.1", 29500, False), 0, "n0", [JOB], proc_net(tmp_path))
    assert row.status is Status.PASS and "no network but the job's" in row.detail


def test_a_host_without_the_store_skips(tmp_path: Path) -> None:
    assert check_exposure(Master("10.0.0.1", 4242, False), 0, "n1", [JOB], proc_net(tmp_path)).status is Status.SKIP


@pytest.mark.parametrize(("family", "bind", "shown"), [
    (socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET, "0.0.0.0", "0.0.0.0"), (socket.AF_INET6, "::", "::")])
def test_this_hosts_own_listeners_are_decoded(family: socket.AddressFamily, bind: str, shown: str) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((bind, 0))
        sock.listen()
        assert shown in listen_addresses(sock.getsockname()[1])
