"""A job rendered for Kubernetes (`ddpkit render k8s`, started by `kubectl
apply`): kubectl knows its state (the job object's newest true condition)
and its pods' logs, found by the labels its controller sets
(targets/kubernetes: each kind's `Controller`). ddpkit did not start it
and does not stop it: cancel names the `kubectl delete` that does."""

from __future__ import annotations

import json
import shlex
import shutil
from typing import Any

from ....runs import Applied, RunRecord, RunState, RunTarget, StoredRun
from ..applied import CONTROLLERS, last_error, print_tool_logs, run_tool
from ..common import RunCommandError
from ..logs import LogRequest
from .base import Now, log_lines
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
        return print_tool_logs(kubectl_logs(rec, rec.applied, request), shutil.which("kubectl") is not None, rec,
                               request)

    def cancel(self, run: StoredRun, now: Now) -> int:
        a = run.record.applied
        if a is None:
            return RENDERING.cancel(run, now)
        stop = shlex.join(["kubectl", "delete", f"{a.kind.lower()}.{a.group}", a.object_name, *_ns(a)])
        raise RunCommandError(f"run {run.record.id} was rendered for {self.launcher}, which started it, not ddpkit; "
                              f"stop it with: {stop}")


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
