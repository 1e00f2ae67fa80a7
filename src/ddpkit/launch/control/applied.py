"""Runs that another tool starts: the Kubernetes manifests `ddpkit render k8s`
writes for `kubectl apply`, and the compose file `ddpkit render compose`
writes for `docker compose up`. Rendering records a run (state `rendered`);
`ddpkit status` and `ddpkit logs` then ask kubectl or docker compose about
it, and where that tool is not installed they print the exact command to run
where it is (docs/RUNS.md)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ...render import Rendered
from ...runs import Applied, RunFolder, RunRecord, RunsDirError, RunState, all_runs
from ...spec import JobSpec
from ...specfile import dump_yaml

TOOL_S = 30.0  # one kubectl/compose query; a cluster that does not answer in this is reported, not waited on


@dataclass(frozen=True)
class Kind:
    """What kubectl needs to find one kind's job object and its pods."""

    group: str  # the API group: `kubectl get <kind>.<group>` is unambiguous beside other CRDs
    job_label: str  # the label its controller puts on every pod of the job
    node_label: str  # the pod label that numbers the nodes


# Labels the controllers set (not ours): they hold even where a runtime replaces the pod template.
KINDS = {
    "PyTorchJob": Kind("kubeflow.org", "training.kubeflow.org/job-name", "training.kubeflow.org/replica-index"),
    "Job": Kind("batch", "batch.kubernetes.io/job-name", "batch.kubernetes.io/job-completion-index"),
    "JobSet": Kind("jobset.x-k8s.io", "jobset.sigs.k8s.io/jobset-name", "batch.kubernetes.io/job-completion-index"),
    "TrainJob": Kind("trainer.kubeflow.org", "jobset.sigs.k8s.io/jobset-name",
                     "batch.kubernetes.io/job-completion-index"),
}
RENDER_TARGETS = {"k8s": "kubectl", "compose": "compose"}

# Condition types of the four kinds (Job, JobSet, TrainJob, PyTorchJob), newest True one wins.
_CONDITION_STATES = {
    "Complete": RunState.FINISHED, "Completed": RunState.FINISHED, "Succeeded": RunState.FINISHED,
    "Failed": RunState.FAILED, "Running": RunState.RUNNING, "Restarting": RunState.RUNNING,
    "Suspended": RunState.PENDING, "Created": RunState.PENDING,
}


class ToolMissing(Exception):
    """kubectl or docker compose is not installed here: the message is the exact command."""


@dataclass(frozen=True)
class Answer:
    state: RunState
    exit_code: int | None
    detail: str


# ---- recording a render ----------------------------------------------------------------


def record_render(spec: JobSpec, target: str, rendered: Rendered, written: list[Path]) -> RunRecord | None:
    """The run of a rendered job. Rendering the same job again updates its
    rendered run (the cluster or the Docker host holds one job of that name)
    instead of adding another. None where the runs folder cannot be written:
    rendering goes on, it only says so."""
    try:
        run = _rendered_run(spec, target) or RunFolder.create(
            name=spec.name, target=target, nodes=spec.nodes, nproc_per_node=spec.nproc_per_node,
            spec_yaml=dump_yaml(spec), first="rendered")
        run.spec_file.write_text(dump_yaml(spec))
        copies = rendered.write(run.rendered_dir)
        applied = _applied(spec, target, rendered, written or copies)
        rec = run.record().model_copy(update={"applied": applied, "state": RunState.RENDERED,
                                              "nodes": spec.nodes, "nproc_per_node": spec.nproc_per_node})
        run.write(rec)
        run.event("files", ", ".join(applied.files))
        return rec
    except (RunsDirError, OSError, ValueError) as exc:
        print(f"ddpkit render: no run recorded ({exc}); the files are written all the same", file=sys.stderr)
        return None


def _rendered_run(spec: JobSpec, target: str) -> RunFolder | None:
    for run in all_runs():  # newest first
        rec = run.record
        if rec.name == spec.name and rec.target == target:
            return run.folder if rec.state == RunState.RENDERED else None
    return None


def _applied(spec: JobSpec, target: str, rendered: Rendered, written: list[Path]) -> Applied:
    files = [str(p.resolve()) for p in written]
    if target == "compose":
        main = [f for f in files if Path(f).name == "compose.yaml"] or files
        return Applied(tool="compose", files=main, project=spec.name)
    for text in rendered.files.values():
        for doc in yaml.safe_load_all(text):
            if isinstance(doc, dict) and doc.get("kind") in KINDS:
                meta = doc.get("metadata") or {}
                return Applied(tool="kubectl", files=files, kind=doc["kind"], group=KINDS[doc["kind"]].group,
                               object_name=str(meta.get("name", spec.name)),
                               namespace=str(meta.get("namespace") or spec.k8s.namespace or ""))
    raise ValueError(f"rendered {target} files hold none of the kinds {', '.join(KINDS)}")


# ---- kubectl ------------------------------------------------------------------------------


def _ns(a: Applied) -> list[str]:
    return ["-n", a.namespace] if a.namespace else []


def kubectl_get(a: Applied) -> list[str]:
    return ["kubectl", "get", f"{a.kind.lower()}.{a.group}", a.object_name, *_ns(a), "-o", "json"]


def kubectl_logs(rec: RunRecord, node: int | None, tail: int | None, follow: bool) -> list[str]:
    """One node's pods, or the whole job's, each line prefixed with its pod.
    With a selector kubectl shows only 10 lines unless told: --tail=-1."""
    a = rec.applied
    assert a is not None
    kind = KINDS[a.kind]
    selector = f"{kind.job_label}={a.object_name}"
    if node is not None:
        selector += "," + _node_selector(a.kind, kind, node)
    words = ["kubectl", "logs", *_ns(a), "-l", selector, "--prefix", f"--tail={-1 if tail is None else tail}",
             f"--max-log-requests={max(rec.nodes, 5)}"]
    return words + (["-f"] if follow else [])


def _node_selector(name: str, kind: Kind, node: int) -> str:
    if name == "PyTorchJob":  # the operator's roles: node 0 is Master 0, node i is Worker i-1
        role, index = ("master", 0) if node == 0 else ("worker", node - 1)
        return f"training.kubeflow.org/replica-type={role},{kind.node_label}={index}"
    return f"{kind.node_label}={node}"


def kubectl_state(rec: RunRecord) -> Answer:
    a = rec.applied
    assert a is not None
    words = kubectl_get(a)
    done = _run(words)
    if done.returncode != 0:
        err = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if "NotFound" in err or "not found" in err:
            apply = shlex.join(["kubectl", "apply", *(w for f in a.files for w in ("-f", f))])
            return Answer(RunState.RENDERED, None, f"not in the cluster (kubectl get: NotFound): `{apply}`")
        return Answer(RunState.RENDERED, None, f"kubectl could not say: {err}")
    obj = json.loads(done.stdout)
    state, why = condition_state(obj.get("status") or {})
    return Answer(state, None, f"{a.kind} {a.object_name}: {why} (kubectl)")


def condition_state(status: dict[str, Any]) -> tuple[RunState, str]:
    """The newest condition that is True decides; a Job without one is
    running while it has active pods."""
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict) and c.get("status") == "True"]
    conditions.sort(key=lambda c: str(c.get("lastTransitionTime", "")))
    for cond in reversed(conditions):
        state = _CONDITION_STATES.get(str(cond.get("type")))
        if state is not None:
            reason = f" ({cond['reason']})" if cond.get("reason") else ""
            return state, f"condition {cond.get('type')}{reason}"
    active = status.get("active")
    if isinstance(active, int) and active > 0:
        return RunState.RUNNING, f"{active} active pods"
    return RunState.PENDING, "no condition yet"


# ---- docker compose -----------------------------------------------------------------------


def compose_cli() -> list[str]:
    """docker's plugin where it is, else the standalone binary beside this
    Python (the project's venv) or on PATH; [] where there is none."""
    if shutil.which("docker") and _run(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    beside = Path(sys.executable).with_name("docker-compose")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("docker-compose")
    return [found] if found else []


def compose_base(rec: RunRecord, cli: list[str]) -> list[str]:
    a = rec.applied
    assert a is not None
    return [*cli, "-f", a.files[0], "-p", a.project]


def compose_logs(rec: RunRecord, cli: list[str], node: int | None, tail: int | None, follow: bool) -> list[str]:
    words = [*compose_base(rec, cli), "logs", "--no-color"]
    if tail is not None:
        words.append(f"--tail={tail}")
    if follow:
        words.append("-f")
    return words + ([] if node is None else [f"node{node}"])  # services are node<I> (templates/compose)


ACTIVE_CONTAINER = ("running", "restarting", "paused", "created")


def compose_state(rec: RunRecord) -> Answer:
    cli = compose_cli()
    words = compose_base(rec, cli or ["docker", "compose"]) + ["ps", "--all", "--format", "json"]
    if not cli:
        raise ToolMissing(shlex.join(words))
    done = _run(words)
    if done.returncode != 0:
        err = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return Answer(RunState.RENDERED, None, f"docker compose could not say: {err}")
    rows = _json_rows(done.stdout)
    if not rows:
        return Answer(RunState.RENDERED, None, f"no containers: start them with `{shlex.join(compose_base(rec, cli))} up`")
    states = {str(r.get("Service")): (str(r.get("State")), int(r.get("ExitCode") or 0)) for r in rows}
    summary = ", ".join(f"{svc} {st}" + (f" ({code})" if st == "exited" else "") for svc, (st, code) in sorted(states.items()))
    node0, code = states.get("node0", ("exited", 1))
    # node0 decides once it has exited, as `up --exit-code-from node0` does. An elastic job
    # (`up -d`) can end on the survivors while a lost node's container is still paused or running.
    if node0 != "exited" and any(st in ACTIVE_CONTAINER for st, _ in states.values()):
        return Answer(RunState.RUNNING, None, f"{summary} (docker compose)")
    left = sorted(svc for svc, (st, _) in states.items() if st in ACTIVE_CONTAINER)
    tail = f"; {', '.join(left)} left: `{shlex.join(compose_base(rec, cli))} down` removes them" if left else ""
    return Answer(RunState.FINISHED if code == 0 else RunState.FAILED, code, f"{summary} (docker compose){tail}")


def _json_rows(text: str) -> list[dict[str, Any]]:
    """`ps --format json`: one object per line (compose v2.21+) or one array."""
    text = text.strip()
    if text.startswith("["):
        return [r for r in json.loads(text) if isinstance(r, dict)]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---- shared --------------------------------------------------------------------------------


def state(rec: RunRecord) -> Answer:
    """ToolMissing when kubectl or docker compose is not here."""
    a = rec.applied
    assert a is not None
    if a.tool == "compose":
        return compose_state(rec)
    if shutil.which("kubectl") is None:
        raise ToolMissing(shlex.join(kubectl_get(a)))
    return kubectl_state(rec)


def logs_command(rec: RunRecord, node: int | None, tail: int | None, follow: bool) -> tuple[list[str], bool]:
    """The command that prints the logs, and whether it can run here."""
    a = rec.applied
    assert a is not None
    if a.tool == "compose":
        cli = compose_cli()
        return compose_logs(rec, cli or ["docker", "compose"], node, tail, follow), bool(cli)
    return kubectl_logs(rec, node, tail, follow), shutil.which("kubectl") is not None


def cancel_command(rec: RunRecord) -> str:
    a = rec.applied
    assert a is not None
    if a.tool == "compose":
        return shlex.join([*compose_base(rec, compose_cli() or ["docker", "compose"]), "down", "--timeout", "90"])
    return shlex.join(["kubectl", "delete", f"{a.kind.lower()}.{a.group}", a.object_name, *_ns(a)])


def _run(words: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(words, capture_output=True, text=True, check=False, timeout=TOOL_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(words, 124, "", f"no answer in {TOOL_S:g} s")
