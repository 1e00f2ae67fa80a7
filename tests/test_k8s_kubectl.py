"""The kubectl backend against a fake `kubectl` on PATH (tests/helpers/
fake_kubectl.py; no API server runs here), which serves the files of an
emulated claim and the output of emulated pods: `ddpkit report` of a
Kubernetes run brings the job's records from its shared volume into the run
folder through a reader pod and draws them, and `log_iter` gives the lines
`ddpkit logs` prints. With the pods run for real in Docker (the records and
node logs written on the claim): tests/test_k8s_raw_output.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.launch.control.backends.kubectl import Kubectl
from ddpkit.launch.control.logs import LogRequest
from ddpkit.runs import resolve
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.matrix import DDPKIT
from tests.infra.docker_daemon import REPO

JOB = "cpu-smoke"  # examples/cpu-smoke.yaml: its checkpoint claim smoke-checkpoints at /ckpt
FOLDER_ON_CLAIM = Path("ddpkit-records") / JOB  # where the pods keep them: /ckpt/ddpkit-records/cpu-smoke
PODS = ("cpu-smoke-master-0", "cpu-smoke-worker-0")


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake kubectl first on PATH, its world, and a runs folder of this test's."""
    bin_dir, world = tmp_path / "bin", tmp_path / "world"
    bin_dir.mkdir()
    (world / "volumes" / "smoke-checkpoints").mkdir(parents=True)
    (world / "pods").mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests/helpers/fake_kubectl.py'} \"$@\"\n")
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_KUBECTL_DIR", str(world))
    monkeypatch.setenv("DDPKIT_RUNS_DIR", str(tmp_path / "runs"))
    return world


def ddpkit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDPKIT, *args], capture_output=True, text=True, timeout=300, check=False,
                          env=os.environ.copy())


def render(tmp_path: Path, *overrides: str) -> None:
    sets = [w for o in overrides for w in ("--set", o)]
    done = ddpkit("render", "k8s", "-f", str(REPO / "examples" / "cpu-smoke.yaml"), "-o", str(tmp_path / "out"),
                  "--set", "k8s.kind=pytorchjob", *sets)
    assert done.returncode == 0, done.stderr


def calls(world: Path) -> list[list[str]]:
    return [json.loads(line) for line in (world / "calls.jsonl").read_text().splitlines()]


def test_report_copies_a_k8s_jobs_records_from_its_claim_and_draws_them(world: Path, tmp_path: Path) -> None:
    render(tmp_path)
    kept = world / "volumes" / "smoke-checkpoints" / FOLDER_ON_CLAIM
    for pod in PODS:
        for i in range(1, 4):
            records.append(kept / f"{pod}.jsonl", records.StepTimes(step=i, step_s=(0.01, 0.02)), 1000.0 + i)
        (kept / f"{pod}.log").write_text("==== ... rank 1: its traceback\nTraceback ...\n")
    records.append(kept / f"{PODS[0]}.jsonl", records.Train(step=3, loss=1.5, images_per_s=40.0), 1003.0)
    done = ddpkit("report", JOB)
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert "(1 train and 6 step-time records" in done.stdout, done.stdout
    run = resolve(JOB).folder
    assert sorted(p.name for p in run.records_folder.iterdir() if p.name != "report") == sorted(
        [f"{pod}.jsonl" for pod in PODS] + [f"{pod}.log" for pod in PODS])
    assert (run.path / "report.html").is_file()
    # one reader pod: created with the claim read-only at the job's mount, copied from, then deleted
    verbs = [c[0] for c in calls(world)]
    assert verbs == ["create", "wait", "cp", "delete"], calls(world)
    [reader] = [p.stem for p in (world / "created").glob("*.deleted")]
    mounts = json.loads((world / "created" / f"{reader}.deleted").read_text())
    assert mounts == {"/ckpt": {"claim": "smoke-checkpoints", "read_only": True}}, mounts
    [cp] = [c for c in calls(world) if c[0] == "cp"]
    assert f"{reader}:/ckpt/{FOLDER_ON_CLAIM}" in cp, cp


def test_report_of_a_k8s_job_without_records_says_why_in_one_line(world: Path, tmp_path: Path) -> None:
    render(tmp_path)  # nothing on the claim yet: kubectl cp finds no folder
    done = ddpkit("report", JOB)
    assert done.returncode == ExitCode.FAILED, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"no records of job {JOB} on its volume yet (/ckpt/{FOLDER_ON_CLAIM})" in line, line
    assert [c[0] for c in calls(world)][-1] == "delete", "the reader pod is deleted whatever happened"
    render(tmp_path, "k8s.volumes=[]")  # no shared volume: nothing asked of kubectl
    before = len(calls(world))
    done = ddpkit("report", JOB)
    [line] = done.stderr.strip().splitlines()
    assert done.returncode == ExitCode.FAILED and "has no shared volume" in line, line
    assert len(calls(world)) == before


def test_log_iter_gives_the_pods_lines_logs_prints(world: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    render(tmp_path)
    job_label = {"training.kubeflow.org/job-name": JOB}
    for pod, role, lines in ((PODS[0], "master", "ddpkit.agent: node 0 ready\n[rank0]:step 1\n"),
                             (PODS[1], "worker", "[rank1]:step 1\n"), ("other-master-0", "master", "not ours\n")):
        labels = {**job_label, "training.kubeflow.org/replica-type": role,
                  "training.kubeflow.org/replica-index": "0"}
        if pod.startswith("other"):
            labels["training.kubeflow.org/job-name"] = "other"
        (world / "pods" / f"{pod}.json").write_text(json.dumps({"labels": labels, "container": "pytorch"}))
        (world / "pods" / f"{pod}.log").write_text(lines)
    run = resolve(JOB)
    backend = Kubectl()
    everything = [line for batch in backend.log_iter(run, LogRequest()) for line in batch]
    assert everything == [f"[pod/{PODS[0]}/pytorch] ddpkit.agent: node 0 ready",
                          f"[pod/{PODS[0]}/pytorch] [rank0]:step 1", f"[pod/{PODS[1]}/pytorch] [rank1]:step 1"]
    assert backend.logs(run, LogRequest()) == ExitCode.OK
    assert capsys.readouterr().out.splitlines() == everything
    node1 = [line for batch in backend.log_iter(run, LogRequest(node=1)) for line in batch]
    assert node1 == [f"[pod/{PODS[1]}/pytorch] [rank1]:step 1"]
    followed = [line for batch in backend.log_iter(run, LogRequest(follow=True)) for line in batch]
    assert followed == everything  # kubectl's own -f ends once every pod's container has (here: at once)
    asked = [c for c in calls(world) if c[0] == "logs"]
    assert "-f" in asked[-1] and not any("-f" in c for c in asked[:-1]), asked


def test_the_records_folder_is_on_the_shared_volume_else_in_the_container() -> None:
    """The example's first volume is read-only data, its second the checkpoint claim: the folder goes there."""
    from ddpkit.spec.yamlfile import load_spec
    from ddpkit.targets.kubernetes.storage import records_env

    example = REPO / "examples" / "cpu-smoke.yaml"
    assert records_env(load_spec(example)) == {"DDPKIT_RECORDS": f"/ckpt/{FOLDER_ON_CLAIM}"}  # ddpkit train
    assert records_env(load_spec(example, overrides=["k8s.volumes=[]"])) == {"DDPKIT_RECORDS": records.CONTAINER_FOLDER}
    own = load_spec(example, overrides=['command={"script": "/app/train.py"}'])
    assert records_env(own) == {"DDPKIT_RECORDS": f"/ckpt/{FOLDER_ON_CLAIM}", "DDPKIT_METRICS": "-"}
