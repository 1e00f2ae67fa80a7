"""A JobSet (jobset.x-k8s.io/v1alpha2) of one replicated Indexed Job: needs
the JobSet controller, which also makes the headless Service. Pod i is
`<name>-node-0-<i>.<name>` and takes its node rank from JOB_COMPLETION_INDEX.
Webhook facts are from kubernetes-sigs/jobset v0.12.0
(pkg/webhooks/jobset_webhook.go)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...contract import RowKey
from ...spec import JobSpec
from .base import DNS_LABEL_MAX, Controller, KindInfo, backoff_limit, single
from .pod import Container, check_container

# The one replicated Job, whose name is also the training container's.
RJOB = "node"
INFO = KindInfo("jobset", RowKey.JOBSET, container=RJOB, volcano="pod-group",
                controller=Controller("JobSet", "jobset.x-k8s.io", "jobset.sigs.k8s.io/jobset-name",
                                      "batch.kubernetes.io/job-completion-index"))
# The webhook checks that the longest pod name, <jobset>-<rjob>-<jobIndex>-<podIndex>
# plus the Job controller's 5-character random suffix, is a DNS-1035 label.
POD_SUFFIX = "-abcde"


@dataclass(frozen=True)
class JobSet:
    """The JobSet's own fields: the template's `obj`."""

    replicated_job: str


def problems(spec: JobSpec) -> list[str]:
    pod_name = f"{spec.name}-{RJOB}-0-{spec.nodes - 1}{POD_SUFFIX}"
    if len(pod_name) <= DNS_LABEL_MAX:
        return []
    return [f"name: {spec.name!r} is too long for a JobSet of {spec.nodes} nodes: the JobSet webhook needs "
            f"pod name {pod_name!r} to fit in {DNS_LABEL_MAX} characters; shorten name to at most "
            f"{DNS_LABEL_MAX - (len(pod_name) - len(spec.name))} characters"]


def view(spec: JobSpec) -> JobSet:
    return JobSet(replicated_job=RJOB)


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc.get("kind") != "JobSet":
        return []
    return [r["template"]["spec"]["template"]["spec"] for r in (doc.get("spec") or {}).get("replicatedJobs") or []]


def verify(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
    """JobSet's CRD and webhook rules that ddpkit's output could break, and
    the pod layout the rank contract assumes."""
    doc = single(docs)
    if doc is None:
        return [f"expected one document, found {len(docs)}"]
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        problems.append("not a jobset.x-k8s.io/v1alpha2 JobSet")
    s = doc["spec"]
    net = s.get("network") or {}
    if net.get("enableDNSHostnames") is not True or net.get("subdomain", spec.name) != spec.name:
        problems.append("network.enableDNSHostnames must be true with the JobSet's name as subdomain")
    rjobs = s.get("replicatedJobs") or []
    if [r.get("name") for r in rjobs] != [RJOB] or rjobs[0].get("replicas") != 1:
        problems.append(f"expected one replicatedJob {RJOB!r} with replicas 1")
        return problems
    j = rjobs[0]["template"]["spec"]
    if j.get("completionMode") != "Indexed" or not j.get("completions") == j.get("parallelism") == spec.nodes:
        problems.append("Job must be Indexed with completions = parallelism = nodes")
    if (s.get("failurePolicy") or {}).get("maxRestarts") != backoff_limit(spec):
        problems.append("failurePolicy.maxRestarts differs from k8s.backoff_limit")
    pod = j["template"]["spec"]
    if pod.get("restartPolicy") != "Never":
        problems.append("podFailurePolicy needs restartPolicy Never")
    containers = pod.get("containers") or []
    if len(containers) != 1:
        problems.append("expected exactly one container")
    else:
        problems += check_container(containers[0], want, "JobSet")
    return problems
