"""The namespace test hosts themselves: distinct names, addresses and
interfaces, mutual reachability, nothing left behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.infra import netns, sshd

pytestmark = [pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())), pytest.mark.root]


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


@pytest.mark.skipif(sshd.available() is not None, reason=str(sshd.available()))
def test_ssh_sessions_source_the_tests_rc_files_not_the_machines(tmp_path: Path) -> None:
    """A session on a test host (a login shell and a plain command, as the
    launchers open them) sees the test's ~/.bashrc: the machine's own may run
    `pyenv init`, whose rehash lock, once left stale by a killed shell, made
    every session wait 60 s (CI, stop 23)."""
    with netns.Network(["login", "rc1"], prefix="dktrc") as net:
        net.wait_reachable()
        with sshd.SshHosts(net.hosts[1:], net.hosts[0], tmp_path) as hosts:
            ssh = ["ssh", "-F", str(hosts.ssh_config), net["rc1"].addr]
            for command in ("cat ~/.bashrc", "exec bash -lc 'cat ~/.bashrc'"):
                out = net["login"].run([*ssh, command], timeout=30)
                assert out.returncode == 0, out.stderr
                assert out.stdout == (tmp_path / "home_rc").read_text()
            out = net["login"].run([*ssh, "echo $PATH"], timeout=30)
            assert out.stdout.strip() == os.environ["PATH"]
    machines = Path("~/.bashrc").expanduser()
    assert not machines.is_file() or machines.read_text() != (tmp_path / "home_rc").read_text()
