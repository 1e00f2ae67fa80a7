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
resumes from the checkpoint with world size 2 and ends COMPLETED. The lease's
restore starts node1's slurmd again and resumes the node after the test."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.launch.supervise import proctree
from tests.helpers.elastic_gate import held_step, release
from tests.helpers.followed import Followed
from tests.helpers.runs import metrics
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster
from tests.test_elastic_slurm import render

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=3) as c:
        yield c


def submit_and_follow(cluster: SlurmCluster, tmp: Path, job_yaml: Path) -> tuple[Followed, int]:
    proc = cluster.ctl.popen(["ddpkit", "submit", "slurm", "-f", str(job_yaml), "--dir", str(tmp), "--follow"],
                             cwd=tmp, env=cluster.env({"DDPKIT_RUNS_DIR": str(tmp / "runs")}),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    followed = Followed(proc)
    return followed, int(followed.wait_for(r"submitted Slurm job (\d+):", timeout=120).group(1))


def node_state(cluster: SlurmCluster, node: str) -> str:
    return cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"]).stdout.strip()


@pytest.mark.full  # the lost batch host's requeue and resume from its checkpoint: test_elastic_slurm.py
@pytest.mark.timeout(900)
def test_a_batch_host_lost_for_good_has_the_requeued_job_run_on_the_two_nodes_left(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    job_yaml = render(tmp_path, gate, requeue=True).with_suffix(".yaml")
    followed, job = submit_and_follow(cluster, tmp_path, job_yaml)
    assert cluster.net is not None
    try:
        step = held_step(gate, 3, lambda: None if followed.running else followed.text[-4000:], timeout=300)
        assert cluster.job(job).nodes == "node[1-3]", cluster.job(job)  # Slurm gave the range's top while idle
        lost = time.monotonic()
        proctree.signal_all(cluster.net["node1"].pids(), signal.SIGKILL)  # slurmd, the batch shell, store, trainer
        release(gate, 3)
        marks: dict[str, float] = {}
        deadline = lost + 480
        while "running" not in marks:
            info = cluster.job(job)
            assert not info.finished, f"{info}\n{followed.text[-6000:]}"
            if info.restarts >= 1:
                marks.setdefault("requeued", time.monotonic())
            if "down" not in marks and node_state(cluster, "node1").startswith("down"):
                marks["down"] = time.monotonic()
            if info.restarts >= 1 and info.state == "RUNNING":
                marks["running"] = time.monotonic()
                assert info.nodes == "node[2-3]" and info.raw.get("BatchHost") == "node2", info
            assert time.monotonic() < deadline, f"the requeued job did not start: {info}\n{followed.text[-6000:]}"
            time.sleep(0.3)
        final = cluster.wait(job, timeout=480)
        done = time.monotonic()
        followed.proc.wait(timeout=60)
    finally:
        cluster.run(["scancel", str(job)])
        if followed.running:
            followed.proc.kill()
    said = followed.text
    assert final.state == "COMPLETED" and final.restarts == 1 and final.nodes == "node[2-3]", f"{final}\n{said[-6000:]}"
    assert followed.proc.returncode == 0, said[-6000:]
    # what the user saw: the requeue, no wait for the lost node, the second run on two nodes, the end
    after = said[said.index(f"ddpkit: job {job} was requeued (restart 1)"):]
    assert "DOWN" not in after and "ReqNodeNotAvail" not in after, after[-6000:]
    assert re.search(rf"\[batch\] ddpkit: job {job} run 2 on 2 of 2-3 nodes, node\[2-3\]: master node2:", after), \
        after[-6000:]
    assert said.rstrip().splitlines()[-1] == f"ddpkit: job {job} ended COMPLETED (exit code 0:0)", said[-2000:]
    # the second run resumed from the checkpoint the three ranks wrote before the loss, with two
    resume = [r for r in metrics(tmp_path / "metrics.jsonl") if r["kind"] == "resume"][-1]
    assert resume["step"] == step and resume["checkpoint"] == str(tmp_path / "ckpt" / f"ckpt-{step:08d}.pt"), resume
    assert resume["world_size"] == 2, resume
    assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in after, after[-6000:]
    print(f"LOST-HOST-TIMING slurm: host lost -> requeued {marks['requeued'] - lost:.1f} s, "
          f"-> node1 DOWN {marks.get('down', float('nan')) - lost:.1f} s, "
          f"-> running on node[2-3] {marks['running'] - lost:.1f} s, -> COMPLETED {done - lost:.1f} s")
