"""`ddpkit doctor` across two real hosts (network namespaces on a bridge)
whose interfaces have different names: auto finds each host's own; one
interface name forced on both fails on the host that lacks it, with a fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.shared.agreed import AGENT_MODULE
from tests.infra import netns
from tests.test_doctor_real import base_env

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]
ROOT = Path(__file__).resolve().parents[1]
PORT = 29533


def node_cmd(index: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", AGENT_MODULE, "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={index}", "--master-addr=dka", f"--master-port={PORT}", "--max-restarts=0",
            "-m", "ddpkit.doctor", "--json", "--disk-min=1KiB", "--shm-min=1KiB", "--connect-timeout=5",
            "--dist-timeout=60", *extra]


def start(net: netns.Network, env: dict[str, str], *extra: str) -> list[subprocess.Popen[str]]:
    return [host.popen(node_cmd(i, *extra), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i, host in enumerate(net.hosts)]


def test_two_hosts_auto_interface_and_a_wrong_name() -> None:
    with netns.Network(["dka", "dkb"], prefix="dkdoc", ifnames=["ens5", "enp7s0"]) as net:
        net.wait_reachable()
        procs = start(net, base_env(DDPKIT_INTERFACE="auto"))
        outs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
        doc = json.loads(outs[0][0])
        assert doc["verdict"] in ("PASS", "WARN") and doc["world_size"] == 2
        iface = {c["rank"]: c["detail"] for c in doc["checks"] if c["name"].startswith("interface")}
        assert iface[0].startswith("auto -> ens5") and iface[1].startswith("auto -> enp7s0")
        assert {c["host"] for c in doc["checks"] if c["name"] == "rendezvous"} == {"dka", "dkb"}

        # One name for every node, as a spec with `interface: ens5` would set it.
        procs = start(net, base_env(DDPKIT_INTERFACE="ens5", GLOO_SOCKET_IFNAME="ens5", NCCL_SOCKET_IFNAME="ens5"))
        try:
            out, err = procs[1].communicate(timeout=240)
        finally:
            net.kill_all()  # node 0 would wait for the missing rank until --dist-timeout
            for p in procs:
                p.communicate(timeout=60)
        assert procs[1].returncode != 0
        doc = json.loads(out)
        fail = [c for c in doc["checks"] if c["status"] == "FAIL" and c["name"].startswith("interface")]
        assert fail and fail[0]["host"] == "dkb" and "ens5" in fail[0]["detail"]
        assert "enp7s0=" in fail[0]["fix"]


@pytest.mark.full  # the same check: test_faults.py[auto-on-node0-resolving-to-loopback-works]
def test_auto_on_a_node0_that_maps_its_own_name_to_loopback() -> None:
    """Debian/Ubuntu write '127.0.1.1 <hostname>': on node 0 the master's
    name is loopback. auto must pin the interface the other node reaches it
    by, say why, and the two hosts must then meet."""
    with netns.Network(["dka", "dkb"], prefix="dkdeb", ifnames=["ens5", "enp7s0"]) as net:
        net.debian_own_name(net["dka"])
        net.wait_reachable()
        procs = start(net, base_env(DDPKIT_INTERFACE="auto"))
        try:
            outs = [p.communicate(timeout=240) for p in procs]
        finally:
            net.kill_all()
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
        doc = json.loads(outs[0][0])
        iface = {c["rank"]: c["detail"] for c in doc["checks"] if c["name"].startswith("interface")}
        assert iface[0] == "auto -> ens5 (dka -> 127.0.1.1 (loopback) here; ens5 is the only interface up besides loopback)"
        assert iface[1].startswith("auto -> enp7s0 (routes to dka (10.213.77.2)")
