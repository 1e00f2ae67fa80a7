"""Each pod's output as `kubectl logs` shows it, the way a user reads a
Kubernetes job, after a normal run, a pre-emption (the kubelet's eviction)
and a lost pod: no record frame, no traceback of a normal stop, no torch
chatter, ddpkit's own lines present. The pods are run in Docker with their
controller's environment (tests/test_k8s_emulated.py's machinery), their
checkpoint claim a Docker volume shared as a ReadWriteMany claim is: the
job's records and each pod's log are kept there
(targets/kubernetes/storage.records_folder, agent/nodelog.py), where `ddpkit
report` reads them (the kubectl backend against a fake kubectl:
tests/test_k8s_kubectl.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit import records
from ddpkit.runs import resolve
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import kubernetes
from tests import test_k8s_kubectl as fake_kubectl
from tests.helpers.matrix import DDPKIT
from tests.helpers.stop_output import NOISE
from tests.infra import docker_daemon as daemon_infra
from tests.infra.docker_daemon import REPO, Docker
from tests.test_k8s_emulated import (
    CKPT,
    RESUME_ARGS,
    SLOW_STEPS,
    TINY,
    checkpoint_claim,
    kill_after_first_checkpoint,
    pods,
    rendered,
    run_pods,
    store_pod,
)

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name
world = fake_kubectl.world  # the fake kubectl on PATH and its world

JOB = "cpu-smoke"
KEPT = Path("ddpkit-records") / JOB  # the records folder under the claim's mount (/ckpt)
# torch's agent lines on a failed or stopped group, beside tests/helpers/stop_output.NOISE
CHATTER = (*NOISE, "failed (exitcode", "Received", "Sending process", "ChildFailedError")


def job(args: list[str], nodes: int, *overrides: str) -> JobSpec:
    return load_spec(REPO / "examples" / "cpu-smoke.yaml",
                     overrides=["k8s.kind=pytorchjob", "command.args=" + json.dumps(args), *overrides],
                     nodes=nodes, nproc_per_node=1)


def assert_reads_clean(logs: list[str]) -> None:
    """No record frame and no torch chatter in any pod's output."""
    for i, log in enumerate(logs):
        for noise in (*CHATTER, records.FRAME):
            assert noise not in log, f"{noise!r} in pod {i}'s output\n{log[-6000:]}"


def kept_files(mountpoint: Path) -> dict[str, str]:
    """The records folder on the claim: each file's name and text."""
    folder = mountpoint / KEPT
    return {p.name: p.read_text() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_normal_runs_pod_output_reads_clean(docker_daemon: Docker, world: Path, tmp_path: Path) -> None:
    """PyTorchJob, 2 pods, the example's checkpoint claim, rendered by `ddpkit
    render k8s` (a recorded run): each pod's output holds ddpkit's lines and
    the trainer's, no frame or chatter; the job's records are on the claim, a
    file per pod named after its host, and `ddpkit report` draws them, read
    through the kubectl backend (a fake kubectl serving the claim)."""
    args = json.dumps([*TINY, "--metrics=-"])
    done = subprocess.run([DDPKIT, "render", "k8s", "-f", str(REPO / "examples" / "cpu-smoke.yaml"), "-o",
                           str(tmp_path / "out"), "--set", "k8s.kind=pytorchjob", "--set", f"command.args={args}",
                           "--set", "nodes=2", "--set", "nproc_per_node=1"],
                          capture_output=True, text=True, timeout=120, check=False, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    run = resolve(JOB)
    assert run.record.applied is not None
    spec = load_spec(run.folder.spec_file)
    pods_ = pods(spec, Path(run.record.applied.files[0]).read_text())
    assert all(p.env["DDPKIT_RECORDS"] == f"/ckpt/{KEPT}" for p in pods_), pods_[0].env
    with checkpoint_claim(docker_daemon, pods_[0].fs_group) as (volume, mountpoint):
        codes, logs = run_pods(docker_daemon, pods_, volumes={"smoke-checkpoints": volume})
        kept = kept_files(mountpoint)
        (world / "volumes" / "smoke-checkpoints").rmdir()
        (world / "volumes" / "smoke-checkpoints").symlink_to(mountpoint)
        report = subprocess.run([DDPKIT, "report", JOB], capture_output=True, text=True, timeout=300, check=False,
                                env=os.environ.copy())
    said = "\n".join(logs)[-8000:]
    assert codes == [0, 0], said
    assert_reads_clean(logs)
    assert all("ddpkit" in log for log in logs), said
    jsonl = sorted(name for name in kept if name.endswith(".jsonl"))
    assert jsonl and set(jsonl) <= {f"{p.hostname}.jsonl" for p in pods_}, sorted(kept)
    kinds = {json.loads(line)["kind"] for name in jsonl for line in kept[name].splitlines()}
    assert {"train", "step_times"} <= kinds, kinds
    assert report.returncode == 0, report.stdout + report.stderr
    found = re.search(r"\((\d+) train and (\d+) step-time records", report.stdout)
    assert found and int(found.group(1)) > 0 and int(found.group(2)) > 0, report.stdout


def stop_all_after_first_checkpoint(volume_dir: Path, grace_s: int) -> Callable[[list[Any]], int | None]:
    """The kubelet's eviction of every pod at once, once the first checkpoint
    is on the claim: SIGTERM to each container, SIGKILL after `grace_s`
    (terminationGracePeriodSeconds) to one still running."""
    latest = volume_dir / CKPT.removeprefix("/ckpt/") / "latest"

    def stop(containers: list[Any]) -> int | None:
        if not latest.exists():
            time.sleep(0.5)
            return None
        threads = [threading.Thread(target=c.stop, kwargs={"timeout": grace_s}) for c in containers]
        for t in threads:
            t.start()
        return 0
    return stop


@pytest.mark.full  # test_a_normal_runs_pod_output_reads_clean
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_evicted_jobs_pods_output_reads_one_line_per_pod(docker_daemon: Docker) -> None:
    """PyTorchJob, 2 pods, evicted after the first checkpoint: SIGTERM to both,
    SIGKILL after the manifest's terminationGracePeriodSeconds. Each pod's
    output says the stop in ddpkit's one line, no traceback or chatter; torch's
    stop lines are in the pod's log on the claim."""
    spec = job(RESUME_ARGS, 2)
    text = rendered(spec)
    grace = kubernetes.pod_specs([d for d in yaml.safe_load_all(text) if d], "pytorchjob")[0][
        "terminationGracePeriodSeconds"]
    pods_ = [dataclasses.replace(p, env=p.env | SLOW_STEPS) for p in pods(spec, text)]
    with checkpoint_claim(docker_daemon, pods_[0].fs_group) as (volume, mountpoint):
        codes, logs = run_pods(docker_daemon, pods_, volumes={"smoke-checkpoints": volume},
                               kill=stop_all_after_first_checkpoint(mountpoint, grace), fail_fast=False)
        kept = kept_files(mountpoint)
    said = "\n".join(logs)[-8000:]
    # each pod's container (the agent) ends 75, as its worker did (PREEMPTED: checkpointed on the signal),
    # where torchrun's own end is 1: the pod's record says a checkpointed stop, not a failure
    assert codes == [75, 75], said
    assert_reads_clean(logs)
    for i, log in enumerate(logs):
        assert f"ddpkit.agent: node {i}: SIGTERM: its worker stopped (exit 75)" in log, log[-4000:]
    node_logs = "".join(v for k, v in kept.items() if k.endswith(".log"))
    assert "death signal" in node_logs, sorted(kept)


@pytest.mark.full  # node 0 lost: test_elastic_ssh.py; clean output: test_a_normal_runs_pod_output_reads_clean
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_elastic_pytorchjob_goes_on_when_its_master_pod_is_lost(docker_daemon: Docker) -> None:
    """Elastic PyTorchJob, 3 pods, min_nodes 2, its rendezvous store in the
    file's own Job and Service (<name>-rdzv), the checkpoint directory on the
    shared claim. The Master's container is SIGKILLed after the first
    checkpoint and not restarted (its node gone): the Master held no store,
    so the two Workers re-form at once and finish from that checkpoint with
    world size 2, exit 0; the store then exits 0 by itself (the rendezvous
    closed). The Workers' output as `kubectl logs` shows it: no frame, no
    traceback of the knock-on gloo error, no torch chatter; those are in each
    pod's log on the claim."""
    args = [a.replace("--epochs=3", "--epochs=6") for a in RESUME_ARGS]
    spec = job(args, 3, 'elastic={"min_nodes": 2, "max_restarts": 2}')
    text = rendered(spec)
    pods_ = [dataclasses.replace(p, env=p.env | SLOW_STEPS) for p in pods(spec, text)]
    store = store_pod(spec, text, linger_s=2)
    assert store.dns_names == ["cpu-smoke-rdzv"] and store.argv[:3] == ["python3", "-m", "ddpkit.rdzv_store"], store
    assert all("--rdzv-endpoint=cpu-smoke-rdzv:23456" in p.argv for p in pods_), pods_[0].argv
    with checkpoint_claim(docker_daemon, pods_[0].fs_group) as (volume, mountpoint):
        codes, logs = run_pods(docker_daemon, [store, *pods_], volumes={"smoke-checkpoints": volume},
                               kill=kill_after_first_checkpoint(mountpoint, 1), fail_fast=False)
        kept = kept_files(mountpoint)
    said = "\n".join(logs)[-8000:]
    assert codes == [0, 137, 0, 0], said  # the store, the lost Master, the two Workers
    assert "world size 3 -> 2" in said and "resumed from" in said, said
    assert logs[0].strip().endswith("ddpkit.rdzv_store: stopped: the job's rendezvous closed"), logs[0]
    assert_reads_clean([logs[2], logs[3]])  # the survivors (the lost Master's output ends mid-line)
    assert records.FRAME not in logs[1]
    node_logs = "".join(v for k, v in kept.items() if k.endswith(".log"))
    assert node_logs, sorted(kept)


CRASH = """import os
raise ValueError(f"bad shape (3, 4) on rank {os.environ['RANK']}")
"""


@pytest.mark.full  # one line and the node log: test_agent_nodelog.py; clean: test_a_normal_runs_pod_output_reads_clean
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failed_programs_pod_output_says_its_cause_in_one_line_and_where_the_traceback_is(
        docker_daemon: Docker) -> None:
    """A program of the user's own (on the claim) that raises, in one pod: its
    output says the exception, where it was raised and the log on the claim
    that holds the whole traceback and torch's report; the pod fails (exit 1)."""
    spec = load_spec(REPO / "examples" / "cpu-smoke.yaml",
                     overrides=["k8s.kind=indexed-job", 'command={"script": "/ckpt/crash.py"}'], nodes=1,
                     nproc_per_node=1)
    pods_ = pods(spec, rendered(spec))
    with checkpoint_claim(docker_daemon, pods_[0].fs_group) as (volume, mountpoint):
        (mountpoint / "crash.py").write_text(CRASH)
        codes, logs = run_pods(docker_daemon, pods_, volumes={"smoke-checkpoints": volume})
        kept = kept_files(mountpoint)
    [log] = logs
    assert codes == [1], log
    assert_reads_clean(logs)
    [line] = [line for line in log.splitlines() if "ValueError" in line]
    where = f"/ckpt/{KEPT}/{pods_[0].hostname}.log"
    assert "ValueError: bad shape (3, 4) on rank 0" in line and f"(its traceback: {where})" in line, log
    assert where in log.split(line, 1)[1], f"the agent's report line names the log too\n{log}"
    node_log = kept[f"{pods_[0].hostname}.log"]
    assert "Traceback (most recent call last)" in node_log and "ChildFailedError" in node_log, node_log
