"""An elastic job under `ddpkit launch ssh` on real hosts (network namespaces
with sshd, tests/infra), 3 nodes, min_nodes 2. At a known step (right after
the first checkpoint of the 3-node world, tests/helpers/elastic_gate.py)
node 2 is lost.

- Left out (max_node_failures 1), with the settings a user gets by default
  (watchdog.loss_s 10 s, the collective timeout 30 minutes, the derived
  rendezvous timeouts): its link cut (no reset: the others meet silence), or
  its trainer SIGKILLed (a frozen node goes as a cut one; tests/test_chaos.py
  freezes one on these hosts). The job must finish on the two others, resumed
  from that checkpoint with world size 2, the summary naming node 2 as
  excluded, and end with exactly the parameters of an uninterrupted 2-node
  run started from the same checkpoint. A silent node must be found by its heartbeats:
  the `lost` metrics record says so, and the time from its silence to the
  others' first step is far below any collective timeout.
- Node 0 lost (its agent and workers SIGKILLed, rank 0 among them): the
  launcher hosts the rendezvous store, so the two others finish as above,
  and the user's last line says node 0 was excluded.
- A static job (no elastic) whose node 2 is cut off stops within loss_s plus
  teardown, exit 14, naming node 2, nothing of it left on the other hosts.
- Back in time (max_node_failures 2): the host goes down (every process in
  it killed, sshd too) and comes back (sshd started again) once the two
  others train on with world size 2. ddpkit restarts node 2's agent, which
  joins at the next rendezvous: the job ends with world size 3 and exactly
  the parameters of an uninterrupted 3-node run from the 2-node checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.launch.supervise import proctree
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.elastic_gate import LAST_CALL_S, agents_and_workers, held_step, release
from tests.helpers.runs import ROOT, TINY, assert_bitwise_equal, final_model, run_ok, torchrun
from tests.infra import netns, sshd
from tests.infra.shared import SSH_NODES, SshPool

_REASON = netns.available() or sshd.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
NODES = ["node1", "node2", "node3"]
LOST = 2  # the node taken away (node 0: its own test)
# No lowered --dist-timeout: a silent node is found by its heartbeats
# (watchdog.loss_s), not by a collective timing out.
TRAIN = [*TINY, "--synthetic-size", "96", "--batch-size", "4", "--epochs", "2", "--no-eval", "--device", "cpu",
         "--backend", "gloo", "--lr", "0.05", "--base-batch", "8", "--seed", "0", "--checkpoint-every", "4",
         "--keep", "100", "--resume", "auto", "--log-every", "1"]
LOSS_S = 10  # watchdog.loss_s's default

Cluster = tuple[netns.Network, sshd.SshHosts]


@pytest.fixture(scope="module")
def cluster(ssh_pool: SshPool) -> Iterator[Cluster]:
    # the worker's sshd hosts (tests/infra/shared.py); a test cuts node3's
    # link or kills all its processes: the pool's restore undoes both
    assert NODES == SSH_NODES
    with ssh_pool.lease() as hosts:
        yield hosts


def write_job(folder: Path, ckpt: Path, gate: Path, max_node_failures: int, held_worlds: str,
              last_call_s: int | None = LAST_CALL_S, elastic: bool = True, quick_keepalive: bool = True) -> Path:
    """last_call_s None: the one derived from watchdog.loss_s (rdzv_timing.py).
    quick_keepalive False: launch ssh's default keepalive (5 s x 3), so that
    the job's own heartbeats (10 s) notice a cut-off host first."""
    spec = {
        "name": "elastic", "nodes": 3, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 120},
        "command": {"python": sys.executable, "module": "tests.helpers.elastic_gate",
                    "args": [*TRAIN, "--checkpoint-dir", str(ckpt), "--metrics", str(folder / "metrics.jsonl")]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                "ELASTIC_TEST_GATE_DIR": str(gate), "ELASTIC_TEST_GATE_WORLD": held_worlds},
        "ssh": {"workdir": str(folder), "log_dir": str(folder / "logs"), "grace_s": 3, "connect_timeout_s": 3,
                **({"alive_interval_s": 1, "alive_count": 3} if quick_keepalive else {})},
    }
    if elastic:
        spec["elastic"] = {"min_nodes": 2, "max_restarts": 2, "max_node_failures": max_node_failures,
                           **({"last_call_s": last_call_s} if last_call_s else {})}
    job = folder / "elastic.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def ended(proc: subprocess.Popen[str], out: Path) -> str | None:
    return None if proc.poll() is None else out.read_text()[-4000:]


def launch(net: netns.Network, hosts: sshd.SshHosts, folder: Path, job: Path) -> subprocess.Popen[str]:
    hf = folder / "hostfile"
    hf.write_text("".join(f"{net[n].addr}\n" for n in NODES))
    argv = [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(hf), *hosts.launcher_flags()]
    with (folder / "launcher.out").open("w") as o, (folder / "launcher.err").open("w") as e:
        return net["login"].popen(argv, cwd=str(folder), stdout=o, stderr=e)



def same_as_uninterrupted(folder: Path, ckpt: Path, held: Path, step: int, nodes: int) -> None:
    """An uninterrupted `nodes`-node run from the held checkpoint at `step`
    ends at the job's parameters, bit for bit."""
    for path in held.iterdir():
        if path.name.startswith("ckpt-") and path.name != f"ckpt-{step:08d}.pt":
            path.unlink()
    (held / "latest").write_text(f"ckpt-{step:08d}.pt\n")
    ref = folder / "ref"
    ref.mkdir()
    run_ok(torchrun(ref, nodes, 1, [*TRAIN, "--checkpoint-dir", str(held)], tag="ref"), timeout=300)
    assert_bitwise_equal(final_model(ckpt), final_model(held))


def job_processes(host: netns.Host, folder: Path) -> list[int]:
    out = []
    for pid in host.pids():
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                out.append(pid)
        except OSError:
            continue
    return out


def records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def recovered_by_heartbeat(folder: Path, lost_addr: str) -> float:
    """The `lost` record names node 2 and says its heartbeats showed it; no
    stall was declared. Returns the seconds from the node's silence to the
    others' first step after their resume."""
    recs = records(folder)
    [lost] = [r for r in recs if r["kind"] == "lost"]
    assert lost["noticed_by"] == "heartbeat" and lost["action"] == "re-form" and lost["loss_s"] == LOSS_S, lost
    assert {r["node"] for r in lost["lost"]} == {LOST}, lost
    assert not [r for r in recs if r["kind"] == "stall"], recs
    silent_at = lost["time"] - max(r["silent_s"] for r in lost["lost"])
    at = recs.index(lost)
    resume = next(i for i in range(at, len(recs)) if recs[i]["kind"] == "resume")
    first = next(r for r in recs[resume:] if r["kind"] == "train")
    return float(first["time"] - silent_at)


@pytest.mark.full  # a node lost on these hosts: node 0 below and the node that rejoins; two that remain: test_elastic_compose.py
@pytest.mark.parametrize("loss", ["link-cut", "trainer-killed"])
def test_the_job_finishes_on_the_two_that_remain(cluster: Cluster, tmp_path: Path, loss: str) -> None:
    net, hosts = cluster
    ckpt, gate, held = tmp_path / "ckpt", tmp_path / "gate", tmp_path / "held"
    gate.mkdir()
    # The derived last call (5 s) can miss a node that starts later on a busy machine: the first
    # world is then 2 nodes, which the late one joins at the next round. Held at its first checkpoint
    # (w2), that world cannot end the short job before the 3-node one forms.
    job = write_job(tmp_path, ckpt, gate, max_node_failures=1, held_worlds="2,3", last_call_s=None)
    lost = net[NODES[LOST]]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    proc = launch(net, hosts, tmp_path, job)
    try:
        step = held_step(gate, 3, lambda: ended(proc, out))
        release(gate, 2)  # the survivors' world, after the loss, runs freely
        shutil.copytree(ckpt, held)  # the checkpoint the survivors must resume from
        if loss == "link-cut":
            net.set_link(lost, up=False)
        else:
            proctree.signal_all(agents_and_workers(lost.pids()), signal.SIGKILL)
        release(gate, 3)
        proc.wait(timeout=600)
    finally:
        proc.kill()
        net.set_link(lost, up=True)
        proctree.signal_all(job_processes(lost, tmp_path), signal.SIGKILL)  # a cut-off host: nothing could reach it
    output, summary = out.read_text(), " ".join(err.read_text().split())
    assert proc.returncode == 0, summary[-3000:] + output[-4000:]
    silent = loss != "trainer-killed"
    reason = "no heartbeat for \\d+s, noticed by the job's heartbeats" if silent else "exit status 137"
    assert re.search(rf"every node finished but node {LOST} \({re.escape(lost.addr)}: {reason}.*?\): excluded "
                     r"after it failed; the job went on with 2 of 3 nodes", summary), summary
    code = {"link-cut": "none", "trainer-killed": "137"}[loss]
    assert re.search(f"node{LOST} │ {code} │ failed, excluded │ {re.escape(lost.addr)}", summary), summary
    # the survivors re-formed the job, resumed from the held checkpoint, and said what changed
    assert f"ckpt-{step:08d}.pt at step {step}" in output, output[-4000:]
    assert re.search(r"elastic: restart \d of at most 2; world size 3 -> 2 \(the checkpoint was written by 3 "
                     r"ranks\)", output), output[-4000:]
    for name in NODES[:LOST]:
        assert job_processes(net[name], tmp_path) == [], f"job processes left on {name}"
    if silent:
        took = recovered_by_heartbeat(tmp_path, lost.addr)
        print(f"{loss}: {took:.1f}s from node {LOST}'s silence to the others' first step")
        # far below the collective timeout (30 min): loss_s, a last call, a new worker's start, a loaded box
        assert took < LOSS_S + 290, took
        assert re.search(r"recovery: the others trained again \d+s after the node went silent \(world size 3 -> 2\)",
                         summary), summary
        assert "stalled" not in summary, summary

    same_as_uninterrupted(tmp_path, ckpt, held, step, nodes=2)


def test_node_0_lost_the_launcher_holds_the_store_and_the_others_finish(cluster: Cluster, tmp_path: Path) -> None:
    net, hosts = cluster
    ckpt, gate, held = tmp_path / "ckpt", tmp_path / "gate", tmp_path / "held"
    gate.mkdir()
    job = write_job(tmp_path, ckpt, gate, max_node_failures=1, held_worlds="3")
    node0 = net[NODES[0]]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    proc = launch(net, hosts, tmp_path, job)
    try:
        step = held_step(gate, 3, lambda: ended(proc, out))
        shutil.copytree(ckpt, held)
        proctree.signal_all(agents_and_workers(node0.pids()), signal.SIGKILL)  # rank 0 goes with them
        release(gate, 3)
        proc.wait(timeout=600)
    finally:
        proc.kill()
        proctree.signal_all(job_processes(node0, tmp_path), signal.SIGKILL)
    output, errors = out.read_text(), err.read_text()
    summary = " ".join(errors.split())
    assert proc.returncode == 0, summary[-3000:] + output[-4000:]
    login = net["login"].addr
    assert f"rendezvous store on this launcher, {login}:" in summary and "hosts the rendezvous store" not in summary
    assert f"ckpt-{step:08d}.pt at step {step}" in output, output[-4000:]
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in output, output[-4000:]
    assert f"node0 │ 137 │ failed, excluded │ {node0.addr}" in summary, summary
    last = errors.strip().splitlines()[-1]
    assert re.fullmatch(rf"launch ssh: every node finished but node 0 \({re.escape(node0.addr)}: exit status 137\): "
                        r"excluded after it failed; the job went on with 2 of 3 nodes.*", last), last
    for name in NODES[1:]:
        assert job_processes(net[name], tmp_path) == [], f"job processes left on {name}"
    same_as_uninterrupted(tmp_path, ckpt, held, step, nodes=2)


@pytest.mark.full  # a static job's host cut off: test_launch_ssh.py's host that stops answering
def test_a_static_job_stops_when_a_node_is_cut_off_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    net, hosts = cluster
    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    job = write_job(tmp_path, ckpt, gate, max_node_failures=1, held_worlds="3", elastic=False, quick_keepalive=False)
    lost = net[NODES[LOST]]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    proc = launch(net, hosts, tmp_path, job)
    try:
        held_step(gate, 3, lambda: ended(proc, out))
        net.set_link(lost, up=False)
        cut = time.monotonic()
        release(gate, 3)
        proc.wait(timeout=300)
        took = time.monotonic() - cut
    finally:
        proc.kill()
        net.set_link(lost, up=True)
        proctree.signal_all(job_processes(lost, tmp_path), signal.SIGKILL)  # a cut-off host: nothing could reach it
    output, summary = out.read_text(), " ".join(err.read_text().split())
    assert proc.returncode == ExitCode.NODE_LOST, summary[-3000:] + output[-4000:]
    assert re.search(rf"node {LOST} \({re.escape(lost.addr)}\) failed first: no heartbeat for \d+s, noticed by the "
                     "job's heartbeats", summary), summary
    assert re.search(f"node{LOST} │ [^│]+ │ lost │ {re.escape(lost.addr)}", summary), summary
    assert "ddpkit watchdog: LOST rank" in output and f"node {LOST}" in output, output[-4000:]
    [record] = [r for r in records(tmp_path) if r["kind"] == "lost"]
    assert record["action"] == "stop" and {r["node"] for r in record["lost"]} == {LOST}, record
    # loss_s, then the teardown: the others stopped at once, the cut-off host given up on after the ssh timeouts
    assert took < LOSS_S + 170, f"{took:.0f}s from the cut to the launcher's exit\n{summary[-3000:]}"
    for name in NODES[:LOST]:
        assert job_processes(net[name], tmp_path) == [], f"job processes left on {name}"


@pytest.mark.full  # a node's return in the supervisor: test_supervisor_rejoin.py; a lost node on these hosts: node 0 above
def test_a_lost_node_that_comes_back_rejoins_at_the_next_restart(cluster: Cluster, tmp_path: Path) -> None:
    net, hosts = cluster
    ckpt, gate, held = tmp_path / "ckpt", tmp_path / "gate", tmp_path / "held"
    gate.mkdir()
    # held twice: the full world (to lose node 2) and the two others (to bring it back while they train)
    job = write_job(tmp_path, ckpt, gate, max_node_failures=2, held_worlds="3,2")
    lost = net[NODES[LOST]]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    proc = launch(net, hosts, tmp_path, job)
    try:
        first = held_step(gate, 3, lambda: ended(proc, out))
        proctree.signal_all(lost.pids(), signal.SIGKILL)  # the host goes down: sshd, the agent, its workers
        release(gate, 3)
        step = held_step(gate, 2, lambda: ended(proc, out))  # the two others trained on and checkpointed
        shutil.copytree(ckpt, held)  # what the 3-node world must resume from
        hosts.restart(lost)  # the host is back; the 2-node world stays held until node 2 joins
        proc.wait(timeout=600)
    finally:
        proc.kill()
        release(gate, 2)
        if hosts.procs[LOST].poll() is not None:
            hosts.restart(lost)
        proctree.signal_all(job_processes(lost, tmp_path), signal.SIGKILL)
    output, summary = out.read_text(), " ".join(err.read_text().split())
    assert proc.returncode == 0, summary[-3000:] + output[-4000:]
    assert f"node{LOST} │ 0 │ ok, rejoined │ {lost.addr} │ rejoined after:" in summary, summary
    assert re.search(rf"every node finished; node {LOST} \({re.escape(lost.addr)}\) rejoined after it failed "
                     r"\((connection closed|host stopped answering)", summary), summary
    assert "excluded" not in summary, summary
    assert f"ddpkit: node {LOST} ({lost.addr}) is back after it failed" in output, output[-4000:]
    # 3 -> 2 from the first checkpoint, then 2 -> 3 from the two others' checkpoint
    assert f"ckpt-{first:08d}.pt at step {first}" in output, output[-4000:]
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in output, output[-4000:]
    assert f"ckpt-{step:08d}.pt at step {step}" in output, output[-4000:]
    assert "world size 2 -> 3 (the checkpoint was written by 2 ranks)" in output, output[-4000:]
    for name in NODES:
        assert job_processes(net[name], tmp_path) == [], f"job processes left on {name}"
    same_as_uninterrupted(tmp_path, ckpt, held, step, nodes=3)
