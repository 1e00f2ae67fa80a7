"""What every Kubernetes kind shares: the kinds, the facts each kind module
declares about itself (`KindInfo`, with its `Controller`: the one register
of a kind's object and pod labels, which `ddpkit status` and `logs` read), the job object's names and labels, and
the `Meta` view every template reads for them. No kind is named here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ...contract import LaunchPlan, RowKey, hosts_for, k8s_service_name
from ...spec import JobSpec

Kind = Literal["pytorchjob", "indexed-job", "trainjob", "jobset"]
# How a kind asks Volcano to gang-schedule its pods: a PodGroup object and
# each pod's group annotation, the kind's own field (the operator makes the
# PodGroup), or not at all (the spec refuses volcano for it).
VolcanoVia = Literal["pod-group", "scheduling-policy", "refused"]

DNS_LABEL_MAX = 63
PSS_PREFIX = "# Pod Security Standard: "


@dataclass(frozen=True)
class Controller:
    """How kubectl finds one kind's job object and the pod of each node: by
    the labels its controller sets (not ours), which hold even where a
    runtime replaces the pod template."""

    api_kind: str  # the object's `kind:`
    group: str  # its API group: `kubectl get <kind>.<group>` is unambiguous beside other CRDs
    job_label: str  # on every pod of the job: its value is the job object's name
    node_label: str  # numbers the pods (within a role, where roles number them)
    # Where the controller numbers pods per role (label, first role, second role): node 0 is
    # the first role's pod 0, node i the second role's pod i-1.
    roles: tuple[str, str, str] | None = None

    def node_selector(self, node: int) -> str:
        """The label selector of node `node`'s pods, beside the job's."""
        if self.roles is None:
            return f"{self.node_label}={node}"
        label, first, second = self.roles
        role, index = (first, 0) if node == 0 else (second, node - 1)
        return f"{label}={role},{self.node_label}={index}"


@dataclass(frozen=True)
class KindInfo:
    """What the shared code needs to know about one kind."""

    kind: Kind
    target: RowKey  # its row in the rank contract
    container: str  # the training container's name (the controllers look for it)
    volcano: VolcanoVia
    controller: Controller  # what `ddpkit status` and `logs` ask kubectl for
    run_policy: str | None = None  # the key under `spec` that holds suspend and gang fields (PyTorchJob: runPolicy)
    port_name: str | None = None  # a named container port the controller reads the master port from

    @property
    def template(self) -> str:
        return f"k8s/{self.kind}.yaml.j2"


@dataclass(frozen=True)
class Meta:
    """The job as every kind's template names it: the template's `job`."""

    name: str
    namespace: str
    nodes: int
    nproc_per_node: int
    labels: dict[str, str]  # every object's labels and the pods' selector
    object_labels: dict[str, str]  # the job object's labels (Kueue reads its queue here)
    hosts: list[str]  # every pod's host name; node 0's hosts the rendezvous
    port: int | None
    service: str  # the headless Service the pods' host names resolve in
    pss_comment: str  # the file's first line: the Pod Security level its pods meet
    # How long and how often the job runs; each kind puts them in its own place.
    backoff_limit: int
    ttl_seconds_after_finished: int | None
    active_deadline_s: int | None


def filename(spec: JobSpec) -> str:
    """`<job>.<kind>.yaml`: two jobs rendered into one folder keep their own files."""
    return f"{spec.name}.{spec.k8s.kind}.yaml"


def labels(spec: JobSpec) -> dict[str, str]:
    return {"app.kubernetes.io/managed-by": "ddpkit", "ddpkit.io/job": spec.name}


def pss_comment(level: str) -> str:
    return f"{PSS_PREFIX}{level}"


def meta(spec: JobSpec, launch: LaunchPlan, object_labels: dict[str, str], level: str) -> Meta:
    return Meta(
        name=spec.name, namespace=spec.k8s.namespace, nodes=spec.nodes, nproc_per_node=spec.nproc_per_node,
        labels=labels(spec), object_labels=object_labels, hosts=launch.hosts,
        port=launch.port, service=k8s_service_name(spec), pss_comment=pss_comment(level),
        backoff_limit=backoff_limit(spec), ttl_seconds_after_finished=spec.k8s.ttl_seconds_after_finished,
        active_deadline_s=spec.k8s.active_deadline_s,
    )


def name_problems(spec: JobSpec, info: KindInfo) -> list[str]:
    """The first DNS label of every pod's host name must fit in 63
    characters (the PyTorchJob operator also makes a Service of that name)."""
    longest = max((host.split(".")[0] for host in hosts_for(spec, info.target)), key=len)
    if len(longest) <= DNS_LABEL_MAX:
        return []
    room = DNS_LABEL_MAX - (len(longest) - len(spec.name))
    return [f"name: {spec.name!r} is too long for k8s.kind={spec.k8s.kind} with {spec.nodes} nodes: "
            f"pod host name {longest!r} has {len(longest)} characters and Kubernetes allows "
            f"{DNS_LABEL_MAX}; shorten name to at most {room} characters"]


def single(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one document of a kind that renders one (None: there are more or none)."""
    return docs[0] if len(docs) == 1 else None


def backoff_limit(spec: JobSpec) -> int:
    """How many times the controller may restart the job: k8s.backoff_limit,
    and for an elastic job (PyTorchJob only) at least max_restarts, since a
    failed pod restarts and rejoins. One rule for every kind's field."""
    if spec.elastic is None:
        return spec.k8s.backoff_limit
    return max(spec.k8s.backoff_limit, spec.elastic.max_restarts)
