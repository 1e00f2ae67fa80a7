"""Gang scheduling: every pod of the job starts together or none does.

Kueue (`k8s.queue`) admits the job object whole: the object carries the
LocalQueue label and is created suspended. Volcano (`k8s.scheduler:
volcano`) schedules a PodGroup of `minMember = nodes`: every pod names the
scheduler, and the group is either the kind's own field (PyTorchJob's
runPolicy.schedulingPolicy; the operator makes the PodGroup) or a PodGroup
document plus each pod's group annotation (Indexed Job, JobSet). The spec
refuses Volcano for TrainJob, and the two schedulers together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...spec import VOLCANO_GROUP_ANNOTATION, JobSpec
from .base import KindInfo

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
VOLCANO = "volcano"


@dataclass(frozen=True)
class PodGroup:
    """A scheduling.volcano.sh/v1beta1 PodGroup document."""

    name: str
    min_member: int


@dataclass(frozen=True)
class Gang:
    """What the templates render for gang scheduling: the template's `gang`."""

    suspend: bool  # Kueue: created suspended, unsuspended on admission
    min_available: int | None  # the kind's own Volcano field (PyTorchJob's schedulingPolicy)
    pod_group: PodGroup | None  # a PodGroup document after the job's


def volcano(spec: JobSpec) -> bool:
    return spec.k8s.scheduler == VOLCANO


def scheduler_name(spec: JobSpec) -> str | None:
    """Every pod's schedulerName (None: the cluster's default scheduler)."""
    return VOLCANO if volcano(spec) else None


def object_labels(spec: JobSpec, labels: dict[str, str]) -> dict[str, str]:
    """The job object's labels: Kueue admits a job whose object names its
    LocalQueue (and that was created suspended; it unsuspends it)."""
    out = dict(labels)
    if spec.k8s.queue is not None:
        out[KUEUE_QUEUE_LABEL] = spec.k8s.queue
    return out


def pod_annotations(spec: JobSpec, info: KindInfo) -> dict[str, str]:
    """The spec's pod annotations, and, for Volcano on kinds without a
    scheduling field of their own, the PodGroup each pod belongs to."""
    out = dict(spec.k8s.pod_annotations)
    if volcano(spec) and info.volcano == "pod-group":
        out[VOLCANO_GROUP_ANNOTATION] = spec.name
    return out


def gang(spec: JobSpec, info: KindInfo) -> Gang:
    on = volcano(spec)
    return Gang(
        suspend=spec.k8s.queue is not None,
        min_available=spec.nodes if on and info.volcano == "scheduling-policy" else None,
        pod_group=PodGroup(spec.name, spec.nodes) if on and info.volcano == "pod-group" else None,
    )


def job_object(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The document Kueue admits: the one that is not a Service or PodGroup."""
    return next(d for d in docs if d.get("kind") not in ("Service", "PodGroup"))


def verify_gang(docs: list[dict[str, Any]], pods: list[dict[str, Any]], spec: JobSpec, info: KindInfo) -> list[str]:
    """Kueue: the queue label and suspend on the job object. Volcano: every
    pod names the scheduler, and a PodGroup of minMember = nodes holds them
    (the kind's own field for PyTorchJob)."""
    problems = []
    obj = job_object(docs)
    queue = obj["metadata"].get("labels", {}).get(KUEUE_QUEUE_LABEL)
    policy_part = obj["spec"][info.run_policy] if info.run_policy else obj["spec"]
    if queue != spec.k8s.queue or bool(policy_part.get("suspend")) != (spec.k8s.queue is not None):
        problems.append(f"Kueue: label {KUEUE_QUEUE_LABEL} / suspend disagree with k8s.queue")
    on = volcano(spec)
    if any((p.get("schedulerName") == VOLCANO) != on for p in pods):
        problems.append("schedulerName disagrees with k8s.scheduler")
    groups = [d for d in docs if d.get("kind") == "PodGroup"]
    if info.volcano == "scheduling-policy":
        if (policy_part.get("schedulingPolicy") == {"minAvailable": spec.nodes}) != on:
            problems.append("runPolicy.schedulingPolicy.minAvailable disagrees with k8s.scheduler")
    elif info.volcano == "pod-group" and on and (
            [g["spec"].get("minMember") for g in groups] != [spec.nodes] or groups[0]["metadata"]["name"] != spec.name):
        problems.append(f"expected one PodGroup {spec.name!r} with minMember {spec.nodes}")
    if groups and not (on and info.volcano == "pod-group"):
        problems.append("a PodGroup without scheduler: volcano")
    return problems
