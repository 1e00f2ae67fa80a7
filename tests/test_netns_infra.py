"""The namespace test hosts themselves: distinct names, addresses and
interfaces, mutual reachability, nothing left behind."""

from __future__ import annotations

import subprocess

import pytest

from tests.infra import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def test_hosts_are_distinct_and_reach_each_other() -> None:
    with netns.Network(["na", "nb"], prefix="dktest", ifnames=["ens1", "ens2"]) as net:
        net.wait_reachable()
        seen = {}
        for host in net.hosts:
            out = host.run(["sh", "-c", "hostname; getent hosts nb; ip -o -4 addr show dev " + host.ifname])
            assert out.returncode == 0, out.stderr
            name, resolved, addr_line = out.stdout.splitlines()
            seen[name] = addr_line
            assert resolved.split()[0] == net["nb"].addr
            assert host.addr in addr_line
        assert set(seen) == {"na", "nb"}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "dktest-" not in listed
