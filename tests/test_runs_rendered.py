"""Runs of rendered jobs (launch/control/applied.py, backends/kubectl.py): `ddpkit render k8s|compose`
records a run, and `status`/`logs`/`cancel` ask kubectl or docker compose
about it, or name the exact command where the tool is not installed.

There is no Kubernetes API server here, so kubectl is a stand-in script on
PATH that records its argv and answers as kubectl does (a PyTorchJob's JSON
with its conditions, NotFound, log lines). docker compose is real in
tests/test_targets_matrix_docker.py::test_docker_compose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.launch.control.backends.kubectl import condition_state
from ddpkit.runs import RunState, all_runs

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
SPEC = """name: "tiny-k8s"
nodes: 3
nproc_per_node: 2
device: cpu
k8s:
  kind: {kind}
  namespace: team-a
"""

KUBECTL = """#!/bin/sh
PATH=/usr/bin:/bin
printf '%s\\n' "$*" >> "{log}"
case "$1" in
  get) if [ -f "{answer}" ]; then cat "{answer}"; else
         echo 'Error from server (NotFound): pytorchjobs.kubeflow.org "tiny-k8s" not found' >&2; exit 1; fi ;;
  logs) echo "[pod/tiny-k8s-worker-0/pytorch] step 3 loss 1.0"; echo "[pod/tiny-k8s-worker-0/pytorch] done" ;;
esac
"""


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    return {**os.environ, "DDPKIT_RUNS_DIR": str(tmp_path / "runs"), "PATH": str(bin_dir)}  # /usr/bin may hold a real kubectl


def kubectl_here(env: dict[str, str], tmp_path: Path, answer: dict[str, object] | None = None) -> Path:
    log, answer_file = tmp_path / "kubectl.argv", tmp_path / "kubectl.json"
    script = Path(env["PATH"].split(":")[0]) / "kubectl"
    script.write_text(KUBECTL.format(log=log, answer=answer_file))
    script.chmod(0o755)
    if answer is not None:
        answer_file.write_text(json.dumps(answer))
    return log


def ddpkit(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDPKIT, *argv], env=env, capture_output=True, text=True, check=False, timeout=60)


def render(env: dict[str, str], tmp_path: Path, kind: str = "pytorchjob") -> Path:
    job = tmp_path / f"{kind}.yaml"
    job.write_text(SPEC.format(kind=kind))
    out = ddpkit(env, "render", "k8s", "-f", str(job), "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "`ddpkit status " in out.stderr, out.stderr
    return tmp_path / "out"


@pytest.mark.parametrize(("kind", "api_kind", "group"), [
    ("pytorchjob", "PyTorchJob", "kubeflow.org"), ("indexed-job", "Job", "batch"),
    ("jobset", "JobSet", "jobset.x-k8s.io"), ("trainjob", "TrainJob", "trainer.kubeflow.org"),
])
def test_the_recorded_job_object_is_the_one_the_kind_renders(env: dict[str, str], tmp_path: Path, kind: str,
                                                             api_kind: str, group: str) -> None:
    """The kind's register (its Controller) names the object its template
    writes: `status` asks kubectl for that object."""
    render(env, tmp_path, kind)
    (run,) = all_runs(Path(env["DDPKIT_RUNS_DIR"]))
    assert run.record.applied is not None
    assert (run.record.applied.kind, run.record.applied.group) == (api_kind, group)


def test_render_records_one_run_per_job_and_target(env: dict[str, str], tmp_path: Path) -> None:
    render(env, tmp_path)
    render(env, tmp_path)  # the same job again: the cluster holds one object of that name
    runs = all_runs(Path(env["DDPKIT_RUNS_DIR"]))
    assert len(runs) == 1, [r.record for r in runs]
    rec = runs[0].record
    assert rec.state == RunState.RENDERED and rec.target == "k8s"
    assert rec.applied is not None
    assert (rec.applied.kind, rec.applied.group, rec.applied.object_name, rec.applied.namespace) == \
        ("PyTorchJob", "kubeflow.org", "tiny-k8s", "team-a")
    assert rec.applied.files == [str((tmp_path / "out" / "tiny-k8s.pytorchjob.yaml").resolve())]
    assert (runs[0].folder.rendered_dir / "tiny-k8s.pytorchjob.yaml").exists()


def test_status_reads_the_jobs_conditions_from_kubectl(env: dict[str, str], tmp_path: Path) -> None:
    render(env, tmp_path)
    log = kubectl_here(env, tmp_path, {"status": {"conditions": [
        {"type": "Created", "status": "True", "lastTransitionTime": "2026-11-25T10:00:00Z"},
        {"type": "Running", "status": "False", "lastTransitionTime": "2026-11-25T10:05:00Z"},
        {"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded",
         "lastTransitionTime": "2026-11-25T10:05:00Z"}]}})
    out = ddpkit(env, "status", "tiny-k8s")
    assert out.returncode == 0, out.stderr
    assert "finished" in out.stdout.splitlines()[0], out.stdout
    assert "PyTorchJob tiny-k8s: condition Succeeded (PyTorchJobSucceeded) (kubectl)" in out.stdout, out.stdout
    assert log.read_text().splitlines() == ["get pytorchjob.kubeflow.org tiny-k8s -n team-a -o json"]
    listed = ddpkit(env, "runs")
    assert "finished" in listed.stdout, listed.stdout


def test_status_of_a_job_not_yet_applied_says_how_to_apply_it(env: dict[str, str], tmp_path: Path) -> None:
    out_dir = render(env, tmp_path)
    kubectl_here(env, tmp_path)  # no answer file: NotFound
    out = ddpkit(env, "status", "tiny-k8s")
    assert out.returncode == 0, out.stderr
    assert "rendered" in out.stdout.splitlines()[0]
    assert f"`kubectl apply -f {(out_dir / 'tiny-k8s.pytorchjob.yaml').resolve()}`" in out.stdout, out.stdout


@pytest.mark.parametrize(("kind", "node", "selector"), [
    ("pytorchjob", 0, "training.kubeflow.org/job-name=tiny-k8s,training.kubeflow.org/replica-type=master,"
                      "training.kubeflow.org/replica-index=0"),
    ("pytorchjob", 2, "training.kubeflow.org/job-name=tiny-k8s,training.kubeflow.org/replica-type=worker,"
                      "training.kubeflow.org/replica-index=1"),
    ("indexed-job", 2, "batch.kubernetes.io/job-name=tiny-k8s,batch.kubernetes.io/job-completion-index=2"),
    ("jobset", 1, "jobset.sigs.k8s.io/jobset-name=tiny-k8s,batch.kubernetes.io/job-completion-index=1"),
    ("trainjob", 1, "jobset.sigs.k8s.io/jobset-name=tiny-k8s,batch.kubernetes.io/job-completion-index=1"),
])
def test_logs_of_a_node_select_its_pod_by_the_controllers_labels(
        env: dict[str, str], tmp_path: Path, kind: str, node: int, selector: str) -> None:
    render(env, tmp_path, kind)
    log = kubectl_here(env, tmp_path)
    out = ddpkit(env, "logs", "tiny-k8s", "--rank", str(node * 2 + 1), "--tail", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[pod/tiny-k8s-worker-0/pytorch] step 3 loss 1.0",
                                       "[pod/tiny-k8s-worker-0/pytorch] done"]
    assert f"showing node {node}, which holds rank {node * 2 + 1}" in out.stderr
    assert log.read_text().split() == ["logs", "-n", "team-a", "-l", selector, "--prefix", "--tail=2",
                                       "--max-log-requests=5"]


def test_logs_of_the_whole_job_ask_for_every_line(env: dict[str, str], tmp_path: Path) -> None:
    render(env, tmp_path)
    log = kubectl_here(env, tmp_path)
    assert ddpkit(env, "logs", "tiny-k8s", "-f").returncode == 0
    # With a selector kubectl shows only 10 lines unless told otherwise.
    assert log.read_text().split() == ["logs", "-n", "team-a", "-l", "training.kubeflow.org/job-name=tiny-k8s",
                                       "--prefix", "--tail=-1", "--max-log-requests=5", "-f"]


def test_without_kubectl_status_and_logs_name_the_exact_command(env: dict[str, str], tmp_path: Path) -> None:
    render(env, tmp_path)
    status = ddpkit(env, "status", "tiny-k8s")
    assert status.returncode == 0, status.stderr
    assert ("kubectl is not installed here; where it is: kubectl get pytorchjob.kubeflow.org tiny-k8s -n team-a "
            "-o json") in status.stdout, status.stdout
    logs = ddpkit(env, "logs", "tiny-k8s", "--node", "1")
    assert logs.returncode == 3, logs
    assert logs.stderr.strip() == (
        "ddpkit logs: kubectl is not installed here; where it is, run: kubectl logs -n team-a -l "
        "training.kubeflow.org/job-name=tiny-k8s,training.kubeflow.org/replica-type=worker,"
        "training.kubeflow.org/replica-index=0 --prefix --tail=-1 --max-log-requests=5")


def test_cancel_of_a_rendered_job_names_the_command_that_stops_it(env: dict[str, str], tmp_path: Path) -> None:
    render(env, tmp_path)
    out = ddpkit(env, "cancel", "tiny-k8s")
    assert out.returncode == 2, out
    assert out.stderr.strip().endswith("stop it with: kubectl delete pytorchjob.kubeflow.org tiny-k8s -n team-a")


@pytest.mark.parametrize(("status", "state"), [
    ({}, RunState.PENDING),
    ({"active": 3}, RunState.RUNNING),
    ({"conditions": [{"type": "Suspended", "status": "True"}]}, RunState.PENDING),
    ({"conditions": [{"type": "Failed", "status": "True", "lastTransitionTime": "b"},
                     {"type": "Running", "status": "True", "lastTransitionTime": "a"}]}, RunState.FAILED),
    ({"conditions": [{"type": "Complete", "status": "True"}]}, RunState.FINISHED),
    ({"conditions": [{"type": "Failed", "status": "False"}], "active": 1}, RunState.RUNNING),
])
def test_condition_state(status: dict[str, object], state: RunState) -> None:
    assert condition_state(status)[0] == state


# docker compose's containers -> the job's end: (service, state, exit code) rows as `ps --format json` gives them
def _compose_now(rows: list[tuple[str, str, int]]) -> tuple[RunState, int | None, str]:
    from ddpkit.launch.control.backends.compose import _from_containers
    from ddpkit.runs import Applied

    applied = Applied(tool="compose", files=["/job/compose.yaml"], project="job")
    now = _from_containers(applied, ["docker", "compose"],
                           [{"Service": svc, "State": st, "ExitCode": code} for svc, st, code in rows])
    return now.state, now.exit_code, now.detail


@pytest.mark.parametrize(("rows", "state", "code"), [
    # static: node0 decides once it has exited, as `up --exit-code-from node0` does
    ([("node0", "running", 0), ("node1", "exited", 1)], RunState.RUNNING, None),
    ([("node0", "exited", 3), ("node1", "running", 0)], RunState.FAILED, 3),
    # elastic (the rdzv service): a node that exited 0 ends it well, node0 lost or not
    ([("rdzv", "running", 0), ("node0", "exited", 137), ("node1", "exited", 0), ("node2", "running", 0)],
     RunState.FINISHED, 0),
    ([("rdzv", "running", 0), ("node0", "exited", 137), ("node1", "running", 0), ("node2", "restarting", 1)],
     RunState.RUNNING, None),
    # every node exited, none with 0: the first failed node's code, in rank order (node10 after node2)
    ([("rdzv", "running", 0), ("node10", "exited", 5), ("node2", "exited", 14), ("node0", "exited", 1)],
     RunState.FAILED, 1),
    ([("rdzv", "running", 0), ("node10", "exited", 5), ("node2", "exited", 14)], RunState.FAILED, 14),
])
def test_compose_status_of_static_and_elastic_jobs(rows: list[tuple[str, str, int]], state: RunState,
                                                   code: int | None) -> None:
    got_state, got_code, _ = _compose_now(rows)
    assert (got_state, got_code) == (state, code)


def test_compose_status_names_the_store_first_and_what_is_left() -> None:
    _, _, where = _compose_now([("node2", "paused", 0), ("node1", "exited", 0), ("rdzv", "running", 0),
                                ("node0", "exited", 0)])
    assert where.startswith("rdzv running, node0 exited (0), node1 exited (0), node2 paused (docker compose); "
                            "rdzv, node2 left: `docker compose -f /job/compose.yaml -p job down` removes them"), where
