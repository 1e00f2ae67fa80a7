"""Kubeflow PyTorchJob (kubeflow.org/v1): one Master and nodes-1 Workers.

The operator injects PET_NODE_RANK, MASTER_ADDR and MASTER_PORT (read from
the container port named pytorchjob-port, on a container named pytorch).
Upstream facts are from kubeflow/training-operator release-1.9
(pytorch_types.go, envvar.go, pytorchjob_webhook.go).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...contract import Target, elastic_rdzv_backend, resolve
from ...spec import JobSpec
from .base import Controller, KindInfo, single
from .pod import Container, check_container

INFO = KindInfo("pytorchjob", Target.PYTORCHJOB, container="pytorch", volcano="scheduling-policy",
                controller=Controller("PyTorchJob", "kubeflow.org", "training.kubeflow.org/job-name",
                                      "training.kubeflow.org/replica-index",
                                      roles=("training.kubeflow.org/replica-type", "master", "worker")),
                run_policy="runPolicy", port_name="pytorchjob-port")
ROLES = ("Master", "Worker")


@dataclass(frozen=True)
class ElasticPolicy:
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
class PyTorchJob:
    """The PyTorchJob's own fields: the template's `obj`."""

    clean_pod_policy: str
    restart_policy: str
    roles: list[tuple[str, int]]  # (replica type, replicas), Worker only with more than one node
    elastic: ElasticPolicy | None


def restart_policy(spec: JobSpec) -> str:
    """Never when the job may not retry: a restarted container would wait
    alone in a rendezvous its peers have left. OnFailure lets the operator
    count restarts against backoffLimit."""
    return "OnFailure" if spec.k8s.backoff_limit > 0 or spec.elastic else "Never"


def elastic_policy(spec: JobSpec) -> ElasticPolicy | None:
    e = spec.elastic
    launch = resolve(spec, INFO.target)
    if e is None or launch.rdzv_conf is None:
        return None
    return ElasticPolicy(
        min_replicas=e.min_nodes, max_replicas=spec.nodes, max_restarts=e.max_restarts,
        rdzv_backend=elastic_rdzv_backend(spec), rdzv_host=launch.hosts[0], rdzv_port=launch.port,
        rdzv_id=spec.name, rdzv_conf=launch.rdzv_conf,
    )


def problems(spec: JobSpec) -> list[str]:
    return []


def view(spec: JobSpec) -> PyTorchJob:
    return PyTorchJob(
        clean_pod_policy=spec.k8s.clean_pod_policy, restart_policy=restart_policy(spec),
        roles=[(role, n) for role, n in zip(ROLES, (1, spec.nodes - 1)) if n > 0], elastic=elastic_policy(spec),
    )


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    replicas = (doc.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return [r["template"]["spec"] for r in replicas.values()]


def verify(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
    """The training-operator's webhook rules, plus agreement with the spec."""
    doc = single(docs)
    if doc is None:
        return [f"expected one document, found {len(docs)}"]
    policy = elastic_policy(spec)
    problems = []
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
