"""Kubernetes: one multi-document YAML file per job, of one of four kinds.

- pytorchjob: Kubeflow PyTorchJob (kubeflow.org/v1), one Master + Workers.
- indexed-job: a plain batch/v1 Indexed Job with its headless Service; runs on
  any cluster, no operator needed.
- trainjob: Kubeflow Trainer v2 TrainJob on the `torch-distributed` runtime.
- jobset: a JobSet (jobset.x-k8s.io/v1alpha2) of one Indexed Job; needs the
  JobSet controller, which also makes the headless Service.

All four run the same torchrun line (contract.torchrun_argv); only where the
node rank and master come from differs, and that is `$(VAR)` that the kubelet
expands from the environment each controller injects.

The package: `pod.py` (the container, volumes, security context: the same
in every kind), `gang.py` (Kueue and Volcano), `base.py` (names, labels, the
`Meta` view), and one module per kind with its `KindInfo`, its template's
view, its own checks and its controller's rules for verify. This module only
puts them together; no function here branches on the kind.
"""

from __future__ import annotations

from typing import Any, Protocol

import yaml

from ...contract import CONTRACT, RowKey, resolve
from ...render.engine import OutputFile, Rendered, RenderError
from ...spec import DNS1035, JobSpec
from ...spec.yamlfile import SpecError
from ..refusals import refuse
from . import gang, indexed_job, jobset, pod, pytorchjob, trainjob
from .base import DNS_LABEL_MAX, Kind, KindInfo, filename, labels, meta, name_problems
from .gang import job_object
from .pod import GPU_RESOURCE, Container
from .storage import resume_warning
from .trainjob import RESERVED_ENV as TRAINJOB_RESERVED_ENV

NAME = "k8s"


class KindModule(Protocol):
    """One module per kind (pytorchjob.py, indexed_job.py, ...), satisfied structurally."""

    @property
    def INFO(self) -> KindInfo:
        ...

    def problems(self, spec: JobSpec) -> list[str]:
        """Input problems only this kind has (joined into one SpecError, exit 2)."""
        ...

    def view(self, spec: JobSpec) -> object:
        """The kind's own template fields: the template's `obj`."""
        ...

    def pod_specs(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        """Every pod template's spec in one parsed document of the file."""
        ...

    def verify(self, docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
        """The controller's own rules on the parsed documents (PodGroups left out)."""
        ...


def _kinds(*modules: KindModule) -> dict[str, KindModule]:
    return {m.INFO.kind: m for m in modules}


KINDS: dict[str, KindModule] = _kinds(pytorchjob, indexed_job, trainjob, jobset)
KIND_TARGET: dict[str, RowKey] = {kind: m.INFO.target for kind, m in KINDS.items()}

__all__ = [
    "GPU_RESOURCE", "KINDS", "KIND_TARGET", "NAME", "TRAINJOB_RESERVED_ENV", "Kind", "build", "check_spec",
    "container", "filename", "job_object", "pod_specs", "resume_warning", "verify",
]


def kind_module(spec: JobSpec) -> KindModule:
    return KINDS[spec.k8s.kind]


def container(spec: JobSpec) -> Container:
    return pod.container(spec, kind_module(spec).INFO)


def pod_specs(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Every pod template's spec in the file (for TrainJob: its runtime patch)."""
    return [p for doc in docs for p in KINDS[kind].pod_specs(doc)]


def check_spec(spec: JobSpec) -> None:
    """Input problems only Kubernetes has: raised as SpecError (exit 2)
    before anything is rendered."""
    module = kind_module(spec)
    refuse(spec, module.INFO.target)  # first: the checks below build the launch line
    problems = pod.secret_problems(spec) + name_problems(spec, module.INFO) + module.problems(spec)
    if problems:
        raise SpecError(problems)


def build(spec: JobSpec) -> list[OutputFile]:
    check_spec(spec)
    module = kind_module(spec)
    info = module.INFO
    launch = resolve(spec, info.target)  # once: the pod's container and the job's hosts and port read it
    the_pod = pod.pod_view(spec, pod.container(spec, info, launch), labels(spec), gang.pod_annotations(spec, info))
    level = pod.security_level(the_pod)
    # The two notes a platform engineer needs before applying (the CLI
    # prints them on stderr, so `ddpkit render k8s > job.yaml` stays clean YAML).
    notes = (*pod.storage_warnings(spec), f"meets Pod Security level {level.value}")
    variables: dict[str, Any] = {
        "job": meta(spec, launch, gang.object_labels(spec, labels(spec)), level.value),
        "pod": the_pod,
        "gang": gang.gang(spec, info),
        "obj": module.view(spec),
    }
    return [OutputFile(filename(spec), info.template, variables, "yaml", notes=notes)]


def verify(spec: JobSpec, rendered: Rendered) -> None:
    """Parse the file back and apply the controllers' own rules."""
    name = filename(spec)
    module = kind_module(spec)
    docs = [d for d in yaml.safe_load_all(rendered.files[name]) if d is not None]
    want = pod.container(spec, module.INFO)
    pods = pod_specs(docs, module.INFO.kind)
    problems = pod.check_pod_security(rendered.files[name], pods) + gang.verify_gang(docs, pods, spec, module.INFO)
    problems += pod.check_pods(pods, spec) + _metadata_problems(docs, spec, module.INFO.target)
    problems += module.verify([d for d in docs if d.get("kind") != "PodGroup"], spec, want)  # verify_gang checked those
    if problems:
        raise RenderError(f"{name}: " + "; ".join(problems))


def _metadata_problems(docs: list[dict[str, Any]], spec: JobSpec, target: RowKey) -> list[str]:
    """Every object is named for the job (an elastic job's store, where the kind renders one, for its store)."""
    service = CONTRACT[target].elastic.store_service
    names = {spec.name} | ({service(spec)} if service is not None and spec.elastic is not None else set())
    problems = []
    for doc in docs:
        m = doc.get("metadata", {})
        if not DNS1035.match(m.get("name", "")) or len(m["name"]) > DNS_LABEL_MAX:
            problems.append(f"{doc.get('kind')} name {m.get('name')!r} is not a DNS-1035 label")
        if m.get("name") not in names or m.get("namespace") != spec.k8s.namespace:
            problems.append(f"{doc.get('kind')} name/namespace differ from the spec")
    return problems

