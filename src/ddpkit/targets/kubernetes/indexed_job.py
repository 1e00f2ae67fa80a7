"""A plain batch/v1 Indexed Job with its headless Service: runs on any
cluster, no operator needed. Pod i is `<name>-<i>.<service>` and takes its
node rank from JOB_COMPLETION_INDEX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...contract import RowKey
from ...spec import JobSpec
from .base import Controller, KindInfo
from .pod import Container, check_container

INFO = KindInfo("indexed-job", RowKey.INDEXED_JOB, container="trainer", volcano="pod-group",
                controller=Controller("Job", "batch", "batch.kubernetes.io/job-name",
                                      "batch.kubernetes.io/job-completion-index"))


@dataclass(frozen=True)
class IndexedJob:
    """The Job's own fields: the template's `obj`."""

    # What a non-zero exit does (podFailurePolicy): FailJob ends the whole
    # Job at once, so its peers stop waiting in their collective; Count
    # counts it against backoffLimit, and every pod is recreated and resumes.
    failure_action: str


def problems(spec: JobSpec) -> list[str]:
    return []


def view(spec: JobSpec) -> IndexedJob:
    return IndexedJob(failure_action="FailJob" if spec.k8s.backoff_limit == 0 else "Count")


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [doc["spec"]["template"]["spec"]] if doc.get("kind") == "Job" else []


def verify(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
    by_kind = {d.get("kind"): d for d in docs}
    svc, job = by_kind.get("Service"), by_kind.get("Job")
    if svc is None or job is None or len(docs) != 2:
        return ["expected one Service and one Job"]
    problems = []
    s, j = svc["spec"], job["spec"]
    pod = j["template"]
    if s.get("clusterIP") != "None" or not s.get("publishNotReadyAddresses"):
        problems.append("Service must be headless and publish not-ready addresses")
    if not s.get("selector") or any(pod["metadata"]["labels"].get(k) != v for k, v in s["selector"].items()):
        problems.append("Service selector does not select the job's pods")
    if pod["spec"].get("subdomain") != svc["metadata"]["name"]:
        problems.append("pod subdomain is not the Service name: pods would not resolve each other")
    if j.get("completionMode") != "Indexed" or not j.get("completions") == j.get("parallelism") == spec.nodes:
        problems.append("Job must be Indexed with completions = parallelism = nodes")
    if pod["spec"].get("restartPolicy") != "Never":
        problems.append("podFailurePolicy needs restartPolicy Never")
    containers = pod["spec"].get("containers") or []
    if len(containers) != 1:
        problems.append("expected exactly one container")
    else:
        problems += check_container(containers[0], want, "Job")
    return problems
