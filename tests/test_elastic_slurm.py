"""An elastic job on a real Slurm cluster (tests/infra/slurm_cluster.py:
slurmctld and three slurmds in network namespaces), torchrun mode, 3 nodes,
min_nodes 2, at a known step: right after the first checkpoint of the
3-node world (tests/helpers/elastic_gate.py).

- node1's trainer dies (its torchrun agent and workers SIGKILLed; the host
  and its slurmd stay). Its agent held the rendezvous, so the others cannot
  re-form the job and the job step ends with an error; the batch script
  relaunches the step on the allocation's nodes that are up, and the new
  workers resume from the checkpoint. Run first: the next test takes node3
  down for good.
- node3 is lost: its slurmd, its job step's slurmstepd and its trainer are
  SIGKILLed. The two others re-form the job and train on from the
  checkpoint with world size 2, and the job ends COMPLETED.
- node3 freezes: every process on it SIGSTOPped, slurmd and slurmstepd too,
  so no connection closes and nothing answers. The others' heartbeat watch
  declares node 2 lost after watchdog.loss_s and they re-form without it
  and finish; the step ends when slurmctld finds node3 not responding
  (SlurmdTimeout): COMPLETED.
- node3's trainer freezes (its torchrun agent and workers SIGSTOPped; slurmd
  and slurmstepd answer, as with a GPU hung in its driver). The others
  re-form without it and finish, but Slurm sees a task still running: the
  batch shell, told by `ddpkit train` that training finished, ends the
  step's tasks watchdog.loss_s later (without it the job would run until
  its time limit): COMPLETED, nothing left on node3.
- node1, the batch host, is lost: every process on it SIGKILLed (slurmd, the
  batch shell and its srun, the rendezvous store, the trainer). Nothing there
  can end the job; the others' agents requeue it, and once node1 is back it
  runs again from the checkpoint: COMPLETED, Restarts=1."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit import records
from ddpkit.launch.supervise import proctree
from tests.helpers.elastic_gate import LAST_CALL_S, agents_and_workers, held_step, release
from tests.helpers.stop_output import NOISE
from tests.infra import netns, slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import JobInfo, SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
_reason = slurm_cluster.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

TRAIN = ["--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain",
         "--synthetic-size", "96", "--batch-size", "4", "--epochs", "2", "--no-eval", "--lr", "0.05",
         "--base-batch", "8", "--seed", "0", "--checkpoint-every", "4", "--keep", "100", "--resume", "auto"]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    # take_node3_down kills node3's slurmd: the lease's restore starts it again and resumes the node
    with slurm_pool.lease(nodes=3) as c:
        yield c


def render(tmp: Path, gate: Path, requeue: bool = False) -> Path:
    spec = {
        "name": "elastic", "nodes": 3, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 120}, "elastic": {"min_nodes": 2, "max_restarts": 2, "last_call_s": LAST_CALL_S},
        "command": {"python": PYTHON, "module": "tests.helpers.elastic_gate",
                    "args": [*TRAIN, "--checkpoint-dir", str(tmp / "ckpt"), "--metrics", str(tmp / "metrics.jsonl")]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                "ELASTIC_TEST_GATE_DIR": str(gate), "ELASTIC_TEST_GATE_WORLD": "3"},
        "slurm": {"requeue": requeue},
    }
    job = tmp / "elastic.yaml"
    job.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(job), "-o", str(tmp)],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return tmp / "elastic.sbatch"


def run_with_a_loss(cluster: SlurmCluster, tmp: Path, lose: Callable[[netns.Network], None],
                    ) -> tuple[int, str, JobInfo]:
    """Submit the job, call `lose` once the 3-node world is held at its
    first checkpoint, let it go on; the step it was held at, the job's
    output and its final state."""
    gate = tmp / "gate"
    gate.mkdir()
    job = cluster.sbatch(render(tmp, gate))
    assert cluster.net is not None
    try:
        step = held_step(gate, 3, lambda: None, timeout=300)
        lose(cluster.net)
        release(gate, 3)
        info = cluster.wait(job, timeout=600)
    finally:
        cluster.run(["scancel", str(job)])
    return step, (tmp / f"elastic-{job}.out").read_text(), info


def kill_node1_trainer(net: netns.Network) -> None:
    trainer = agents_and_workers(net["node1"].pids())
    assert trainer, "no torchrun agent on node1"
    proctree.signal_all(trainer, signal.SIGKILL)


def take_node3_down(net: netns.Network) -> None:
    proctree.signal_all(net["node3"].pids(), signal.SIGKILL)  # slurmd, slurmstepd, the trainer


def freeze_node3(net: netns.Network) -> None:
    proctree.signal_all(net["node3"].pids(), signal.SIGSTOP)  # slurmd, slurmstepd, the trainer


def freeze_node3_trainer(net: netns.Network) -> None:
    trainer = agents_and_workers(net["node3"].pids())
    assert trainer, "no torchrun agent on node3"
    proctree.signal_all(trainer, signal.SIGSTOP)  # slurmd and slurmstepd go on answering


@pytest.mark.full  # a lost node on Slurm: the lost batch host below
@pytest.mark.timeout(900)
def test_a_failed_step_is_relaunched_on_the_nodes_that_are_up(cluster: SlurmCluster, tmp_path: Path) -> None:
    step, text, info = run_with_a_loss(cluster, tmp_path, kill_node1_trainer)
    assert info.state == "COMPLETED", text[-6000:]
    assert re.search(r"ddpkit: elastic: job step ended with status [1-9]\d*; relaunch 1 on 3 node\(s\): "
                     r"node1,node2,node3", text), text[-6000:]
    relaunched = text[text.index("relaunch 1 on 3 node(s)"):]
    # the relaunched step resumed from the checkpoint with the same world, and finished
    assert f"ckpt-{step:08d}.pt at step {step}" in relaunched, relaunched[-6000:]
    assert "ddpkit train finished" in relaunched and "world size 3" in relaunched, relaunched[-6000:]


@pytest.mark.full  # a whole host lost: the lost batch host below
@pytest.mark.timeout(900)
def test_a_lost_node_leaves_two_that_complete_the_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    step, text, info = run_with_a_loss(cluster, tmp_path, take_node3_down)
    print(f"LOST-NODE OUTPUT {len(text.splitlines())} lines\n{text}")
    assert info.state == "COMPLETED", text[-6000:]
    assert f"ckpt-{step:08d}.pt at step {step}" in text, text[-6000:]
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in text, text[-6000:]
    # the output file as people read it: ddpkit's lines above, no record, no traceback, no torch chatter
    for noise in (*NOISE, records.FRAME):
        assert noise not in text, f"{noise!r} in the output\n{text[-6000:]}"


@pytest.mark.full  # a lost host on Slurm: the lost batch host below; a silent node: test_elastic_compose.py[paused]
@pytest.mark.timeout(900)
def test_a_frozen_node_leaves_two_that_complete_the_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    assert cluster.net is not None
    try:
        step, text, info = run_with_a_loss(cluster, tmp_path, freeze_node3)
    finally:
        # a host frozen for good: the pool's restore starts its slurmd again
        proctree.signal_all(cluster.net["node3"].pids(), signal.SIGKILL)
    assert info.state == "COMPLETED", text[-6000:]
    assert f"ckpt-{step:08d}.pt at step {step}" in text, text[-6000:]
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in text, text[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    [lost] = [r for r in records if r["kind"] == "lost"]  # the heartbeats noticed it, not a collective timeout
    assert lost["noticed_by"] == "heartbeat" and lost["action"] == "re-form", lost
    assert {r["node"] for r in lost["lost"]} == {2} and not [r for r in records if r["kind"] == "stall"], records
    # the step ended once slurmctld found the frozen host not responding, not by a relaunch
    assert "srun: error: Node failure on node3" in text and "relaunch" not in text, text[-6000:]


@pytest.mark.full  # a silent node: test_elastic_compose.py[paused]; a lost host on Slurm: the lost batch host below
@pytest.mark.timeout(900)
def test_a_node_whose_trainer_froze_is_ended_once_the_others_finished(cluster: SlurmCluster, tmp_path: Path) -> None:
    assert cluster.net is not None
    try:
        step, text, info = run_with_a_loss(cluster, tmp_path, freeze_node3_trainer)
        left = agents_and_workers(cluster.net["node3"].pids())
    finally:
        proctree.signal_all(agents_and_workers(cluster.net["node3"].pids()), signal.SIGKILL)
    assert info.state == "COMPLETED", text[-6000:]
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in text, text[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    [lost] = [r for r in records if r["kind"] == "lost"]
    assert lost["noticed_by"] == "heartbeat" and {r["node"] for r in lost["lost"]} == {2}, lost
    # the frozen task was ended by the batch shell, told that training finished, not by a node failure
    assert re.search(r"ddpkit: elastic: training finished, but job step \d+\.0 still ran 10s later \(a node the "
                     r"others left behind, watchdog\.loss_s\); ending its tasks", text), text[-6000:]
    assert "Node failure" not in text and "relaunch" not in text, text[-6000:]
    assert left == [], f"node3's frozen trainer outlived the job: {left}"


def lose_the_batch_host(net: netns.Network) -> None:
    proctree.signal_all(net["node1"].pids(), signal.SIGKILL)  # slurmd, the batch shell, the store, the trainer


def _where_it_waits(folder: Path, job: int) -> str:
    """What a lost batch host's job that was not requeued left to read: the
    end of its output file and of every node's log (the agents' own lines)."""
    said = []
    for path in sorted([folder / f"elastic-{job}.out", *folder.glob(f"elastic-{job}.records/**/*.log")]):
        if path.is_file():
            said.append(f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(said)


@pytest.mark.timeout(900)
def test_a_lost_batch_host_has_the_others_requeue_the_job_which_resumes_from_its_checkpoint(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """node1 holds the batch shell, its srun and the rendezvous store: with every
    process of it killed, nothing on node1 can end the job, and `--no-kill` keeps
    the allocation. The others' agents find the store gone and requeue the job at
    once, instead of leaving it allocated and idle until its time limit; once
    node1 is back, the job runs again and resumes from the checkpoint."""
    gate = tmp_path / "gate"
    gate.mkdir()
    job = cluster.sbatch(render(tmp_path, gate, requeue=True))
    assert cluster.net is not None
    try:
        step = held_step(gate, 3, lambda: None, timeout=300)
        lose_the_batch_host(cluster.net)
        release(gate, 3)
        # the fallback ruled out is an allocation left idle until its time limit (a year here); the
        # agents' way there (a failed collective, a rendezvous on a dead store, two connection
        # checks) took 20-40 s on an idle 2-core machine and over 120 s with other suites beside it
        lost = time.monotonic()
        deadline = lost + 360
        while cluster.job(job).restarts < 1:
            assert time.monotonic() < deadline, f"not requeued: {cluster.job(job)}\n{_where_it_waits(tmp_path, job)}"
            time.sleep(0.5)
        print(f"LOST BATCH HOST: requeued {time.monotonic() - lost:.1f} s after the loss")
        assert cluster.restart_dead_slurmds() == ["node1"]
        info = cluster.wait(job, timeout=600)
    finally:
        cluster.run(["scancel", str(job)])
    text = (tmp_path / f"elastic-{job}.out").read_text()
    assert info.state == "COMPLETED" and info.restarts == 1, f"{info}\n{text[-6000:]}"
    # the run after the requeue resumed from the checkpoint the three ranks wrote before the loss
    assert f"ckpt-{step:08d}.pt at step {step}" in text, text[-6000:]
    assert "ddpkit train finished" in text, text[-6000:]
    # the requeued run's normal end: the store's host stayed until the others left, so no c10d error of theirs
    after = text[text.index("this job was requeued by Slurm"):]
    assert not re.search(r"frame #\d+|TCPStore\.cpp|exit barrier|could not close the rendezvous", after), after[-6000:]
    # the others' agents said why in the job's output, with the batch host's srun gone: one line each
    said = [line for line in text.splitlines() if line.startswith("ddpkit.agent: the batch host")]
    assert 1 <= len(said) <= 2 and all("is gone" in line and "requeueing it" in line for line in said), text[-6000:]
