"""Kubeflow PyTorchJob (kubeflow.org/v1): one Master and nodes-1 Workers.

The operator injects PET_NODE_RANK, MASTER_ADDR and MASTER_PORT (read from
the container port named pytorchjob-port, on a container named pytorch).
Upstream facts are from kubeflow/training-operator release-1.9
(pytorch_types.go, envvar.go, pytorchjob_webhook.go).

An elastic job's rendezvous store is not in the Master pod: the file adds a
batch/v1 Job of one pod running `python -m ddpkit.rdzv_store` and a Service
for it (`<name>-rdzv`, the elasticPolicy's rdzvHost), after the PyTorchJob.
Any pod may then be lost, the Master too; the store needs no GPU, is
restarted if it fails, and ends by itself once the job's rendezvous closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...contract import RowKey, elastic_rdzv_backend, pytorchjob_store_service, resolve
from ...render.quoting import kubelet_literal
from ...shared.agreed import RDZV_STORE_MODULE
from ...spec import JobSpec
from .base import Controller, KindInfo, labels, single
from .pod import Container, check_container

INFO = KindInfo("pytorchjob", RowKey.PYTORCHJOB, container="pytorch", volcano="scheduling-policy",
                controller=Controller("PyTorchJob", "kubeflow.org", "training.kubeflow.org/job-name",
                                      "training.kubeflow.org/replica-index",
                                      roles=("training.kubeflow.org/replica-type", "master", "worker")),
                run_policy="runPolicy", port_name="pytorchjob-port")
ROLES = ("Master", "Worker")
STORE_CONTAINER = "rdzv-store"
STORE_COMPONENT = {"ddpkit.io/component": "rdzv-store"}
STORE_BACKOFF = 6  # a store that keeps failing ends its Job; the pods' agents then fail as on any lost store
STORE_REQUESTS = (("cpu", "100m"), ("memory", "512Mi"))  # a TCPStore server and torch's import


@dataclass(frozen=True)
class PyTorchJobElasticPolicy:
    """The job's elasticPolicy: the same rendezvous (backend, id, timeouts) and
    node range as the torchrun line, so the PET_* variables the operator
    derives from it agree with the flags. Replicas count pods: the Master
    is one of them."""

    min_replicas: int
    max_replicas: int
    max_restarts: int
    rdzv_backend: str
    rdzv_host: str
    rdzv_port: int | None
    rdzv_id: str
    rdzv_conf: dict[str, int]

    @property
    def manifest(self) -> dict[str, Any]:
        """The object as kubeflow.org/v1 spells it, in the order the file lists it."""
        return {
            "minReplicas": self.min_replicas, "maxReplicas": self.max_replicas, "maxRestarts": self.max_restarts,
            "rdzvBackend": self.rdzv_backend, "rdzvHost": self.rdzv_host, "rdzvPort": self.rdzv_port, "rdzvId": self.rdzv_id,
            "rdzvConf": [{"key": k, "value": str(v)} for k, v in self.rdzv_conf.items()],
        }


@dataclass(frozen=True)
class RdzvStore:
    """An elastic job's rendezvous store: a Job of one pod and its Service, both `name`."""

    name: str
    port: int
    command: list[str]
    labels: dict[str, str]  # the store pod's, which the Service selects: the training pods have no component
    container: str = STORE_CONTAINER
    restart_policy: str = "OnFailure"  # restarted in place if it fails
    backoff_limit: int = STORE_BACKOFF
    requests: tuple[tuple[str, str], ...] = STORE_REQUESTS


@dataclass(frozen=True)
class PyTorchJob:
    """The PyTorchJob's own fields: the template's `obj`."""

    clean_pod_policy: str
    restart_policy: str
    roles: list[tuple[str, int]]  # (replica type, replicas), Worker only with more than one node
    elastic: PyTorchJobElasticPolicy | None
    store: RdzvStore | None


def restart_policy(spec: JobSpec) -> str:
    """Never when the job may not retry: a restarted container would wait
    alone in a rendezvous its peers have left. OnFailure lets the operator
    count restarts against backoffLimit."""
    return "OnFailure" if spec.k8s.backoff_limit > 0 or spec.elastic else "Never"


def elastic_policy(spec: JobSpec) -> PyTorchJobElasticPolicy | None:
    """The store's Service is the rendezvous host, and every agent its client (is_host=0), as on the launch line."""
    e = spec.elastic
    launch = resolve(spec, INFO.target)
    if e is None or launch.rdzv_conf is None:
        return None
    return PyTorchJobElasticPolicy(
        min_replicas=e.min_nodes, max_replicas=spec.nodes, max_restarts=e.max_restarts,
        rdzv_backend=elastic_rdzv_backend(spec), rdzv_host=pytorchjob_store_service(spec), rdzv_port=launch.port,
        rdzv_id=spec.name, rdzv_conf=launch.rdzv_conf | {"is_host": 0},
    )


def rdzv_store(spec: JobSpec) -> RdzvStore | None:
    launch = resolve(spec, INFO.target)
    if spec.elastic is None or launch.port is None:
        return None
    name = pytorchjob_store_service(spec)
    return RdzvStore(name, launch.port,
                     [spec.command.python, "-m", RDZV_STORE_MODULE, "--port", str(launch.port), "--rdzv-id", spec.name],
                     labels(spec) | STORE_COMPONENT)


def problems(spec: JobSpec) -> list[str]:
    return []


def view(spec: JobSpec) -> PyTorchJob:
    return PyTorchJob(
        clean_pod_policy=spec.k8s.clean_pod_policy, restart_policy=restart_policy(spec),
        roles=[(role, n) for role, n in zip(ROLES, (1, spec.nodes - 1)) if n > 0], elastic=elastic_policy(spec),
        store=rdzv_store(spec),
    )


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The training pods' specs (the rendezvous store's pod is checked on its own: store_problems)."""
    replicas = (doc.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return [r["template"]["spec"] for r in replicas.values()]


def verify(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
    """The training-operator's webhook rules, plus agreement with the spec."""
    jobs = [d for d in docs if d.get("kind") == "PyTorchJob"]
    doc = single(jobs)
    if doc is None:
        return [f"expected one PyTorchJob document, found {len(jobs)}"]
    policy = elastic_policy(spec)
    problems = store_problems([d for d in docs if d.get("kind") != "PyTorchJob"], spec, want)
    if doc["spec"].get("elasticPolicy") != (policy.manifest if policy else None):
        problems.append("elasticPolicy differs from the spec's elastic section")
    if (doc.get("apiVersion"), doc.get("kind")) != ("kubeflow.org/v1", "PyTorchJob"):
        problems.append("not a kubeflow.org/v1 PyTorchJob")
    replica_specs = doc["spec"].get("pytorchReplicaSpecs") or {}
    if set(replica_specs) - set(ROLES):
        problems.append(f"replica types {sorted(replica_specs)}; only Master and Worker exist")
    if replica_specs.get("Master", {}).get("replicas") != 1:
        problems.append("exactly one Master replica is required")
    problems += _replica_problems(replica_specs, spec, want)
    elastic = doc["spec"].get("elasticPolicy")
    if elastic is not None:  # pytorchjob_webhook.go validateSpec
        if "Worker" not in replica_specs:
            problems.append("Worker must be configured if elastic policy is used")
        if "nProcPerNode" in elastic and "nprocPerNode" in doc["spec"]:
            problems.append("elasticPolicy.nProcPerNode must not be used with nprocPerNode")
    if doc["spec"].get("nprocPerNode") != str(spec.nproc_per_node):
        problems.append("nprocPerNode (a string in kubeflow.org/v1) differs from nproc_per_node")
    return problems


def _replica_problems(replica_specs: dict[str, Any], spec: JobSpec, want: Container) -> list[str]:
    """Each role's replicas, its `pytorch` container and the named port; one pod per node in all."""
    problems = []
    total = 0
    for role, rspec in replica_specs.items():
        replicas = rspec.get("replicas")
        if not isinstance(replicas, int) or replicas < 1:
            problems.append(f"{role}: replicas must be at least 1")
            continue
        total += replicas
        containers = rspec["template"]["spec"].get("containers") or []
        ours = [c for c in containers if c.get("name") == INFO.container]
        if not ours:
            problems.append(f"{role}: no container named {INFO.container!r}")
            continue
        problems += check_container(ours[0], want, role)
        ports = {p.get("name"): p.get("containerPort") for p in ours[0].get("ports", [])}
        if want.port and ports.get(want.port.name) != want.port.number:
            problems.append(f"{role}: port {want.port.name} is not {want.port.number}")
    if total != spec.nodes:
        problems.append(f"{total} pods for {spec.nodes} nodes")
    return problems


def store_problems(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
    """The rendezvous store's Service and Job (the documents besides the
    PyTorchJob): there exactly when the job is elastic, as the spec says."""
    store = rdzv_store(spec)
    kinds = sorted(str(d.get("kind")) for d in docs)
    if store is None:
        return [f"documents {kinds} besides the PyTorchJob of a job that is not elastic"] if docs else []
    if kinds != ["Job", "Service"]:
        return [f"an elastic job's rendezvous store is a Job and a Service, found {kinds}"]
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    problems = []
    if service["metadata"].get("name") != store.name or job["metadata"].get("name") != store.name:
        problems.append(f"the rendezvous store's Service and Job are not both named {store.name}")
    ports = [(p.get("port"), p.get("targetPort")) for p in service["spec"].get("ports", [])]
    if service["spec"].get("selector") != store.labels or ports != [(store.port, store.port)]:
        problems.append(f"Service {store.name} does not select the store's pod on port {store.port}")
    template = job["spec"]["template"]
    pod_spec = template["spec"]
    containers = pod_spec.get("containers") or [{}]
    if (template["metadata"].get("labels") != store.labels or pod_spec.get("restartPolicy") != store.restart_policy
            or [c.get("name") for c in containers] != [store.container]):
        problems.append(f"Job {store.name}: its pod is not the store's (labels, restartPolicy OnFailure, one container)")
    c = containers[0]
    if (c.get("command") != [kubelet_literal(a) for a in store.command] or c.get("image") != want.image
            or c.get("securityContext") != want.security_context):
        problems.append(f"Job {store.name}: its container does not run the job's store as the spec says")
    return problems
