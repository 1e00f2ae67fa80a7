"""An elastic job under `ddpkit launch ssh` on real hosts (network namespaces
with sshd, tests/infra), 3 nodes, min_nodes 2. At a known step (right after
the first checkpoint of the 3-node world, tests/helpers/elastic_gate.py)
node 2 is lost: its link cut (no reset: the others meet silence) or its
trainer SIGKILLed. The job must finish on the two others, resumed from that
checkpoint with world size 2, the summary naming node 2 as excluded, and end
with exactly the parameters of an uninterrupted 2-node run started from the
same checkpoint."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.launch import proctree
from tests.helpers.runs import ROOT, TINY, assert_bitwise_equal, final_model, run_ok, torchrun
from tests.infra import netns, sshd

_REASON = netns.available() or sshd.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
NODES = ["node1", "node2", "node3"]
LOST = 2  # the node taken away; node 0 holds the rendezvous store and must stay
# --dist-timeout: a collective with a host whose link is cut (no reset) ends
# only when it times out; the survivors restart then.
TRAIN = [*TINY, "--synthetic-size", "96", "--batch-size", "4", "--epochs", "2", "--no-eval", "--device", "cpu",
         "--backend", "gloo", "--lr", "0.05", "--base-batch", "8", "--seed", "0", "--checkpoint-every", "4",
         "--keep", "100", "--resume", "auto", "--dist-timeout", "60"]

Cluster = tuple[netns.Network, sshd.SshHosts]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("elastichosts")
    with netns.Network(["login", *NODES], prefix=f"dke{os.getpid() % 10000}") as net:
        net.wait_reachable()
        with sshd.SshHosts(net.hosts[1:], net.hosts[0], folder) as hosts:
            yield net, hosts


def write_job(folder: Path, ckpt: Path, gate: Path) -> Path:
    spec = {
        "name": "elastic", "nodes": 3, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 120},
        "elastic": {"min_nodes": 2, "max_restarts": 2},
        "command": {"python": sys.executable, "module": "tests.helpers.elastic_gate",
                    "args": [*TRAIN, "--checkpoint-dir", str(ckpt)]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                "ELASTIC_TEST_GATE_DIR": str(gate), "ELASTIC_TEST_GATE_WORLD": "3"},
        "ssh": {"workdir": str(folder), "log_dir": str(folder / "logs"), "grace_s": 3, "connect_timeout_s": 3,
                "alive_interval_s": 1, "alive_count": 3},
    }
    job = folder / "elastic.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def wait_for_gate(gate: Path, proc: subprocess.Popen[str], out: Path, timeout: float = 400) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        marks = [p.name for p in gate.iterdir() if ".tmp-" not in p.name and p.name != "go"]
        for step in {int(m.split(".")[0]) for m in marks}:
            if sum(m.startswith(f"{step}.rank") for m in marks) == 3:
                return step
        assert proc.poll() is None, "the launcher ended before the ranks reached the gate\n" + out.read_text()[-4000:]
        time.sleep(0.2)
    raise AssertionError("no 3-node world at the gate\n" + out.read_text()[-4000:])


def trainers_on(host: netns.Host) -> list[int]:
    """The torchrun agent on `host` and every process under it."""
    found = []
    for pid in host.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" in cmdline.split(b"\0"):  # the agent itself, not the node script naming it
            found += [pid, *proctree.descendants(pid)]
    return found


def job_processes(host: netns.Host, folder: Path) -> list[int]:
    out = []
    for pid in host.pids():
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                out.append(pid)
        except OSError:
            continue
    return out


@pytest.mark.parametrize("loss", ["link-cut", "trainer-killed"])
def test_the_job_finishes_on_the_two_that_remain(cluster: Cluster, tmp_path: Path, loss: str) -> None:
    net, hosts = cluster
    ckpt, gate, held = tmp_path / "ckpt", tmp_path / "gate", tmp_path / "held"
    gate.mkdir()
    job = write_job(tmp_path, ckpt, gate)
    hf = tmp_path / "hostfile"
    hf.write_text("".join(f"{net[n].addr}\n" for n in NODES))
    lost = net[NODES[LOST]]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    argv = [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(hf), *hosts.launcher_flags()]
    with out.open("w") as o, err.open("w") as e:
        proc = net["login"].popen(argv, cwd=str(tmp_path), stdout=o, stderr=e)
    try:
        step = wait_for_gate(gate, proc, out)
        shutil.copytree(ckpt, held)  # the checkpoint the survivors must resume from
        if loss == "link-cut":
            net.set_link(lost, up=False)
        else:
            for pid in trainers_on(lost):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        (gate / "go").write_text("")
        proc.wait(timeout=600)
    finally:
        proc.kill()
        net.set_link(lost, up=True)
        for pid in job_processes(lost, tmp_path):  # a cut-off host: nothing could reach it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    output, summary = out.read_text(), " ".join(err.read_text().split())
    assert proc.returncode == 0, summary[-3000:] + output[-4000:]
    reason = "host stopped answering" if loss == "link-cut" else "exit status 137"
    assert re.search(rf"every node finished but node {LOST} \({re.escape(lost.addr)}: {reason}.*?\): excluded "
                     r"after it failed; the job went on with 2 of 3 nodes", summary), summary
    code = "lost" if loss == "link-cut" else "137"
    assert f"node{LOST} │ {code} │ failed, excluded │ {lost.addr}" in summary, summary
    # the survivors re-formed the job, resumed from the held checkpoint, and said what changed
    assert f"ckpt-{step:08d}.pt at step {step}" in output, output[-4000:]
    assert re.search(r"elastic: restart \d of at most 2; world size 3 -> 2 \(the checkpoint was written by 3 "
                     r"ranks\)", output), output[-4000:]
    for name in NODES[:LOST]:
        assert job_processes(net[name], tmp_path) == [], f"job processes left on {name}"

    # an uninterrupted 2-node run from the held checkpoint ends at the same parameters, bit for bit
    for path in held.iterdir():
        if path.name.startswith("ckpt-") and path.name != f"ckpt-{step:08d}.pt":
            path.unlink()
    (held / "latest").write_text(f"ckpt-{step:08d}.pt\n")
    ref = tmp_path / "ref"
    ref.mkdir()
    run_ok(torchrun(ref, 2, 1, [*TRAIN, "--checkpoint-dir", str(held)], tag="ref"), timeout=300)
    assert_bitwise_equal(final_model(ckpt), final_model(held))
