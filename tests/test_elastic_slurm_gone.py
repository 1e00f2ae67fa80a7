"""An elastic Slurm job whose batch host is lost for good, on a real cluster
(tests/infra/slurm_cluster.py: three nodes, torchrun mode, min_nodes 2),
submitted as a user would: `ddpkit submit slurm --follow`.

Right after the first checkpoint of the 3-node world, every process of node1
(the batch host) is SIGKILLed, its slurmd included, and it is not started
again. The two other nodes' agents requeue the job (as in
tests/test_elastic_slurm.py); slurmctld finds node1 not responding after
SlurmdTimeout and marks it DOWN. The job asks for `--nodes=2-3`, so its next
run starts on node2 and node3 instead of waiting for node1 (with
`--nodes=3` it stayed PENDING, `Nodes_required_for_job_are_DOWN,_DRAINED...`),
resumes from the checkpoint with world size 2 and ends COMPLETED. The same
for a program of the user's own (the PyTorch tutorial's script, which loads
its own snapshot). The lease's restore starts node1's slurmd again and
resumes the node after each test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from ddpkit.launch.supervise import proctree
from tests.helpers.elastic_gate import LAST_CALL_S, held_step, release
from tests.helpers.followed import Followed
from tests.helpers.runs import metrics
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import JobInfo, SlurmCluster
from tests.test_elastic_slurm import PYTHON, ROOT, render
from tests.test_preamble import TUTORIAL

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=3) as c:
        yield c


def node_state(cluster: SlurmCluster, node: str) -> str:
    return cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"]).stdout.strip()


@dataclass
class Lost:
    """A job submitted with --follow whose batch host was lost for good: what
    the user saw, its final state, and when (seconds after the loss) it was
    requeued, node1 DOWN, running again on the two nodes left, COMPLETED."""

    followed: Followed
    job: int
    final: JobInfo
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def after_requeue(self) -> str:
        text = self.followed.text
        return text[text.index(f"ddpkit: job {self.job} was requeued (restart 1)"):]

    def timing(self) -> str:
        return ", ".join(f"{what} {self.marks.get(what, float('nan')):.1f} s"
                         for what in ("requeued", "node1 DOWN", "running on node[2-3]", "COMPLETED"))


def lose_the_batch_host_for_good(cluster: SlurmCluster, tmp: Path, job_yaml: Path,
                                 ready: Callable[[Followed], None], release_it: Callable[[], None]) -> Lost:
    """Submit with --follow; once `ready` returns, SIGKILL every process of
    node1 (slurmd, the batch shell, the store, the trainer) and never start
    them again; `release_it` lets the others go on. Waits for the job's end."""
    proc = cluster.ctl.popen(["ddpkit", "submit", "slurm", "-f", str(job_yaml), "--dir", str(tmp), "--follow"],
                             cwd=tmp, env=cluster.env({"DDPKIT_RUNS_DIR": str(tmp / "runs")}),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    followed = Followed(proc)
    job = int(followed.wait_for(r"submitted Slurm job (\d+):", timeout=120).group(1))
    assert cluster.net is not None
    marks: dict[str, float] = {}
    try:
        ready(followed)
        assert cluster.job(job).nodes == "node[1-3]", cluster.job(job)  # idle nodes: the range's top
        lost = time.monotonic()
        proctree.signal_all(cluster.net["node1"].pids(), signal.SIGKILL)
        release_it()
        deadline = lost + 480
        while "running on node[2-3]" not in marks:
            info = cluster.job(job)
            assert not info.finished, f"{info}\n{followed.text[-6000:]}"
            now = time.monotonic() - lost
            if info.restarts >= 1:
                marks.setdefault("requeued", now)
            if "node1 DOWN" not in marks and node_state(cluster, "node1").startswith("down"):
                marks["node1 DOWN"] = now
            if info.restarts >= 1 and info.state == "RUNNING":
                assert info.nodes == "node[2-3]" and info.raw.get("BatchHost") == "node2", info
                marks["running on node[2-3]"] = now
            assert time.monotonic() < deadline, f"the requeued job did not start: {info}\n{followed.text[-6000:]}"
            time.sleep(0.3)
        final = cluster.wait(job, timeout=480)
        marks["COMPLETED"] = time.monotonic() - lost
        proc.wait(timeout=60)
    finally:
        cluster.run(["scancel", str(job)])
        if followed.running:
            proc.kill()
    said = followed.text
    assert final.state == "COMPLETED" and final.restarts == 1 and final.nodes == "node[2-3]", f"{final}\n{said[-6000:]}"
    assert proc.returncode == 0, said[-6000:]
    assert said.rstrip().splitlines()[-1] == f"ddpkit: job {job} ended COMPLETED (exit code 0:0)", said[-2000:]
    lost_job = Lost(followed, job, final, marks)
    # no wait for the lost node after the requeue, and the second run on the two left
    after = lost_job.after_requeue
    assert "DOWN" not in after and "ReqNodeNotAvail" not in after, after[-6000:]
    assert re.search(rf"\[batch\] ddpkit: job {job} run 2 on 2 of 2-3 nodes, node\[2-3\]: master node2:", after), \
        after[-6000:]
    return lost_job


@pytest.mark.full  # the lost batch host's requeue and resume from its checkpoint: test_elastic_slurm.py
@pytest.mark.timeout(900)
def test_a_batch_host_lost_for_good_has_the_requeued_job_run_on_the_two_nodes_left(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    job_yaml = render(tmp_path, gate, requeue=True).with_suffix(".yaml")
    held: list[int] = []

    def ready(followed: Followed) -> None:
        held.append(held_step(gate, 3, lambda: None if followed.running else followed.text[-4000:], timeout=300))

    lost = lose_the_batch_host_for_good(cluster, tmp_path, job_yaml, ready, lambda: release(gate, 3))
    # the second run resumed from the checkpoint the three ranks wrote before the loss, with two
    (step,) = held
    resume = [r for r in metrics(tmp_path / "metrics.jsonl") if r["kind"] == "resume"][-1]
    assert resume["step"] == step and resume["checkpoint"] == str(tmp_path / "ckpt" / f"ckpt-{step:08d}.pt"), resume
    assert resume["world_size"] == 2, resume
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in lost.after_requeue, lost.after_requeue[-6000:]
    print(f"LOST-HOST-TIMING slurm ddpkit train: host lost -> {lost.timing()}")


@pytest.mark.full  # the lost batch host's requeue and resume from its checkpoint: test_elastic_slurm.py
@pytest.mark.timeout(900)
def test_a_program_of_the_users_own_resumes_from_its_snapshot_on_the_two_nodes_left(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot.pt"
    spec = {
        "name": "elastic", "nodes": 3, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 120}, "elastic": {"min_nodes": 2, "max_restarts": 2, "last_call_s": LAST_CALL_S},
        "command": {"python": PYTHON, "script": str(TUTORIAL),
                    "args": ["40", "1", "--batch_size", "32", "--snapshot", str(snapshot), "--step-sleep", "0.2"]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"},
    }
    job_yaml = tmp_path / "elastic.yaml"
    job_yaml.write_text(yaml.safe_dump(spec))

    def ready(followed: Followed) -> None:
        followed.wait_for(r"Epoch 1 \| Training snapshot saved", timeout=300)

    lost = lose_the_batch_host_for_good(cluster, tmp_path, job_yaml, ready, lambda: None)
    text = lost.followed.text
    before = text[:text.index(f"ddpkit: job {lost.job} run 2 on")]
    saved = [int(n) for n in re.findall(r"Epoch (\d+) \| Training snapshot saved", before)]
    resumed = [int(n) for n in re.findall(r"Resuming training from snapshot at Epoch (\d+)", lost.after_requeue)]
    assert saved and resumed == [max(saved)] * 2, f"saved {saved}, resumed {resumed}\n{lost.after_requeue[-6000:]}"
    assert re.search(r"Epoch 39 \| Training snapshot saved", lost.after_requeue), lost.after_requeue[-4000:]
    print(f"LOST-HOST-TIMING slurm own program: host lost -> {lost.timing()}")
