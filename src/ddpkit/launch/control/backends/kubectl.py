"""A job rendered for Kubernetes (`ddpkit render k8s`, started by `kubectl
apply`): kubectl knows its state (the job object's newest true condition)
and its pods' logs, found by the labels its controller sets
(targets/kubernetes: each kind's `Controller`), given as lines (`log_iter`:
`kubectl logs --prefix`, which `logs` prints). ddpkit did not start it and
does not stop it: cancel names the `kubectl delete` that does. A job with a
shared volume keeps its records and its pods' logs there
(targets/kubernetes/storage.records_folder); `copy_records` brings them
into the run folder for `ddpkit report`, through a pod of its own that
mounts the volume read-only (targets/kubernetes/reader.py) and `kubectl cp`:
the job's own pods may have ended (an ended pod cannot be exec'd into) or
been deleted, the volume is still there."""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ....runs import Applied, RunRecord, RunState, RunTarget, StoredRun
from ....shared.exitcodes import ExitCode
from ....spec.yamlfile import load_spec
from ....targets.kubernetes.reader import reader_pod
from ....targets.kubernetes.storage import records_folder
from ..applied import CONTROLLERS, last_error, run_tool
from ..common import RunCommandError, ToolMissing
from ..logs import LogRequest, print_lines, say_node_of_rank
from .base import Now, log_lines
from .compose import NoRecords
from .launched import Launched

# Condition types of the four kinds (Job, JobSet, TrainJob, PyTorchJob), newest True one wins.
_CONDITION_STATES = {
    "Complete": RunState.FINISHED, "Completed": RunState.FINISHED, "Succeeded": RunState.FINISHED,
    "Failed": RunState.FAILED, "Running": RunState.RUNNING, "Restarting": RunState.RUNNING,
    "Suspended": RunState.PENDING, "Created": RunState.PENDING,
}
RENDERING = Launched(RunTarget.K8S)  # a run folder whose files are not recorded yet: the render's own process


class Kubectl:
    launcher = "kubectl"
    rendered = True

    def describe(self, run: StoredRun) -> Now:
        a = run.record.applied
        if a is None:
            return RENDERING.describe(run)
        if shutil.which("kubectl") is None:
            return Now(RunState.RENDERED, None, f"kubectl is not installed here; where it is: "
                                                f"{shlex.join(kubectl_get(a))}", None)
        done = run_tool(kubectl_get(a))
        if done.returncode != 0:
            err = last_error(done)
            if "NotFound" in err or "not found" in err:
                apply = shlex.join(["kubectl", "apply", *(w for f in a.files for w in ("-f", f))])
                return Now(RunState.RENDERED, None, f"not in the cluster (kubectl get: NotFound): `{apply}`", None)
            return Now(RunState.RENDERED, None, f"kubectl could not say: {err}", None)
        state, why = condition_state(json.loads(done.stdout).get("status") or {})
        return Now(state, None, f"{a.kind} {a.object_name}: {why} (kubectl)", None)

    def status_lines(self, run: StoredRun) -> list[str]:
        a = run.record.applied
        return log_lines(run.record) + [f"file      {f}" for f in (a.files if a else [])]

    def logs(self, run: StoredRun, request: LogRequest) -> int:
        """One node's pods, or the whole job's, each line prefixed with its
        pod; a pod holds a node, so --rank shows the node that holds the rank."""
        rec = run.record
        if rec.applied is None:
            return RENDERING.logs(run, request)
        say_node_of_rank(rec, request, "a pod")
        lines = PodLogs(kubectl_logs(rec, rec.applied, request))
        for batch in lines:
            print_lines(batch)
        return ExitCode.OK if lines.returncode == 0 else ExitCode.FAILED

    def log_iter(self, run: StoredRun, request: LogRequest) -> Iterator[list[str]]:
        """The pods' output lines as `kubectl logs --prefix` gives them
        (`[pod/NAME/CONTAINER] line`), a batch per line; with --follow until
        every pod's container has ended (kubectl's own -f)."""
        a = run.record.applied
        if a is None:
            return iter(())
        return iter(PodLogs(kubectl_logs(run.record, a, request)))

    def cancel(self, run: StoredRun, now: Now) -> int:
        a = run.record.applied
        if a is None:
            return RENDERING.cancel(run, now)
        stop = shlex.join(["kubectl", "delete", f"{a.kind.lower()}.{a.group}", a.object_name, *_ns(a)])
        raise RunCommandError(f"run {run.record.id} was rendered for {self.launcher}, which started it, not ddpkit; "
                              f"stop it with: {stop}")


class PodLogs:
    """`kubectl logs`'s lines as they come; its exit status once they are all read."""

    def __init__(self, words: list[str]) -> None:
        if shutil.which(words[0]) is None:
            raise ToolMissing(words[0], shlex.join(words))
        self.words = words
        self.returncode: int | None = None

    def __iter__(self) -> Iterator[list[str]]:
        with subprocess.Popen(self.words, stdout=subprocess.PIPE, text=True, errors="replace") as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                yield [line.rstrip("\n")]
        self.returncode = proc.returncode


def copy_records(run: StoredRun) -> Path:
    """The job's records folder on its shared volume, copied into the run
    folder's records folder (each pod's `<host>.jsonl` and `<host>.log`,
    replacing an earlier copy) through a reader pod: created, waited for,
    `kubectl cp` from, deleted. NoRecords (one line) where they cannot be."""
    a = run.record.applied
    if a is None:
        raise NoRecords("the run was never rendered")
    spec = load_spec(run.folder.spec_file)
    name = f"{spec.name[:40]}-records-{secrets.token_hex(3)}"
    pod = reader_pod(spec, name, a.namespace or None)
    if pod is None:
        raise NoRecords(f"job {spec.name} has no shared volume (k8s.volumes: a persistent_volume_claim or nfs), "
                        "so its records stayed in its pods")
    if shutil.which("kubectl") is None:
        raise NoRecords("kubectl is not installed here")
    folder = run.folder.records_folder
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "reader-pod.yaml"
    manifest.write_text(yaml.safe_dump(pod, sort_keys=False))
    try:
        _kubectl(["create", "-f", str(manifest)], "could not create the pod that reads the job's volume")
        _kubectl(["wait", "--for=condition=Ready", f"pod/{name}", *_ns(a), "--timeout=120s"],
                 f"pod {name}, which reads the job's volume, did not start")
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            into = Path(tmp) / "copied"
            _kubectl(["cp", *_ns(a), f"{name}:{records_folder(spec)}", str(into)],
                     f"no records of job {spec.name} on its volume yet ({records_folder(spec)})")
            for part in sorted(into.glob("*")):
                if part.suffix in (".jsonl", ".log") and part.is_file():
                    part.replace(folder / part.name)
    finally:
        run_tool(["kubectl", "delete", "pod", name, *_ns(a), "--wait=false"])
        manifest.unlink(missing_ok=True)
    return folder


def _kubectl(words: list[str], why: str) -> None:
    done = run_tool(["kubectl", *words])
    if done.returncode != 0:
        raise NoRecords(f"{why}: kubectl {words[0]}: {last_error(done)}")


def _ns(a: Applied) -> list[str]:
    return ["-n", a.namespace] if a.namespace else []


def kubectl_get(a: Applied) -> list[str]:
    return ["kubectl", "get", f"{a.kind.lower()}.{a.group}", a.object_name, *_ns(a), "-o", "json"]


def kubectl_logs(rec: RunRecord, a: Applied, request: LogRequest) -> list[str]:
    """With a selector kubectl shows only 10 lines unless told: --tail=-1."""
    controller = CONTROLLERS[a.kind]
    selector = f"{controller.job_label}={a.object_name}"
    node = request.node_of_rank(rec)
    if node is not None:
        selector += "," + controller.node_selector(node)
    tail = -1 if request.tail is None else request.tail
    words = ["kubectl", "logs", *_ns(a), "-l", selector, "--prefix", f"--tail={tail}",
             f"--max-log-requests={max(rec.nodes, 5)}"]
    return words + (["-f"] if request.follow else [])


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
