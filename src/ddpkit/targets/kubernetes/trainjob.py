"""Kubeflow Trainer v2 TrainJob on the `torch-distributed` runtime.

The torch plugin injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT. The TrainJob API has no volumes of its
own: volumes, securityContext, scheduling and pull secrets go into the
runtime's pods as a runtime patch. Facts are from kubeflow/trainer
(plugins/torch/torch.go, pkg/constants, trainjob_types.go).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...contract import RowKey
from ...shared import envnames
from ...spec import JobSpec
from .base import Controller, KindInfo, single
from .pod import Container, check_container, container

# The runtime's replicated job and its container are both named "node".
NODE = "node"
INFO = KindInfo("trainjob", RowKey.TRAINJOB, container=NODE, volcano="refused",
                controller=Controller("TrainJob", "trainer.kubeflow.org", "jobset.sigs.k8s.io/jobset-name",
                                      "batch.kubernetes.io/job-completion-index"))
# The torch plugin refuses these names in trainer.env.
RESERVED_ENV = frozenset(
    {envnames.PET_NNODES, envnames.PET_NPROC_PER_NODE, envnames.PET_NODE_RANK, envnames.PET_MASTER_ADDR,
     envnames.PET_MASTER_PORT}
)
MAX_ITEMS = 128  # trainer.command / args / env: kubebuilder MaxItems
PATCH_MANAGER = "ddpkit.io/render"


@dataclass(frozen=True)
class TrainJob:
    """The TrainJob's own fields: the template's `obj`."""

    runtime: str  # the ClusterTrainingRuntime it runs on
    replicated_job: str  # the runtime's replicated job that the patch names
    patch_manager: str


def problems(spec: JobSpec) -> list[str]:
    out = []
    reserved = sorted((set(spec.env) | set(spec.secret_names)) & RESERVED_ENV)
    if reserved:
        out.append(f"env: {reserved} are set by the Trainer's torch plugin; remove them")
    cont = container(spec, INFO)
    for what, count in (("env", len(cont.env) + len(cont.from_elsewhere)), ("command", len(cont.command))):
        if count > MAX_ITEMS:
            out.append(f"{'command.args' if what == 'command' else 'env'}: a TrainJob allows at most "
                       f"{MAX_ITEMS} {what} items and this job needs {count}; shorten it")
    return out


def view(spec: JobSpec) -> TrainJob:
    return TrainJob(runtime=spec.k8s.runtime, replicated_job=NODE, patch_manager=PATCH_MANAGER)


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods of the runtime patch (what ddpkit renders of them)."""
    out = []
    for patch in (doc.get("spec") or {}).get("runtimePatches") or []:
        rjobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        out += [r["template"]["spec"]["template"]["spec"] for r in rjobs]
    return out


def verify(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
    """The Trainer's CRD rules and its torch plugin's Validate()."""
    doc = single(docs)
    if doc is None:
        return [f"expected one document, found {len(docs)}"]
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != ("trainer.kubeflow.org/v1alpha1", "TrainJob"):
        problems.append("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    t = doc["spec"].get("trainer") or {}
    if doc["spec"].get("runtimeRef", {}).get("name") != spec.k8s.runtime:
        problems.append(f"runtimeRef is not {spec.k8s.runtime!r}")
    if t.get("numNodes") != spec.nodes or t.get("numProcPerNode") != spec.nproc_per_node:
        problems.append("numNodes / numProcPerNode differ from the spec")
    problems += check_container({"name": want.name, **t}, want, "trainer", full=False)
    for pod in pod_specs(doc):
        patched = [c for c in pod.get("containers") or [] if c.get("name") == want.name]
        if len(patched) != 1 or patched[0].get("volumeMounts") != want.mounts \
                or patched[0].get("securityContext") != want.security_context:
            problems.append(f"runtime patch: container {want.name!r} lacks the volume mounts or securityContext")
    env_names = {e["name"] for e in t.get("env", [])}
    if env_names & RESERVED_ENV:
        problems.append(f"trainer.env sets reserved {sorted(env_names & RESERVED_ENV)}")
    for key in ("command", "args", "env"):
        if len(t.get(key) or []) > MAX_ITEMS:
            problems.append(f"trainer.{key} has more than {MAX_ITEMS} items")
    return problems
