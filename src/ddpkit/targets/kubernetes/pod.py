"""The pod every kind runs: the training container (command, environment,
secrets, resources, port), its volumes and mounts, its security context and
the pod-spec fields, as the typed `Pod` view the templates read, plus the
checks of the same values read back from a rendered file."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from ...contract import Arg, LaunchPlan, RowKey, resolve
from ...render.engine import RenderError, k8s_arg
from ...render.quoting import kubelet_unliteral
from ...rendezvous import runkey
from ...spec import JobSpec, K8sVolume
from .. import podsecurity, program_paths
from . import gang
from .base import KindInfo, pss_comment
from .storage import SHARED_SOURCES, records_env, resume_warning

GPU_RESOURCE = "nvidia.com/gpu"
SHM_VOLUME = "dshm"
WORKDIR_VOLUME = "ddpkit-workdir"  # command.workdir, where no volume of the spec holds it
# spec field -> Kubernetes volume source key.
VOLUME_KEYS = {
    "persistent_volume_claim": "persistentVolumeClaim", "host_path": "hostPath", "nfs": "nfs",
    "config_map": "configMap", "secret": "secret", "empty_dir": "emptyDir",
}


@dataclass(frozen=True)
class Port:
    name: str
    number: int


@dataclass(frozen=True)
class PodResources:
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SecretEnv:
    """One `secrets:` variable: its value comes from key `key` of Secret
    `secret` (valueFrom.secretKeyRef), never from the manifest."""

    name: str
    secret: str
    key: str

    @property
    def item(self) -> dict[str, Any]:
        return {"name": self.name, "valueFrom": {"secretKeyRef": {"name": self.secret, "key": self.key}}}


@dataclass(frozen=True)
class FieldEnv:
    """A variable the kubelet fills from the pod's own metadata
    (valueFrom.fieldRef, the downward API)."""

    name: str
    field_path: str

    @property
    def item(self) -> dict[str, Any]:
        return {"name": self.name, "valueFrom": {"fieldRef": {"fieldPath": self.field_path}}}


# The label the Job controller puts on every pod of a Job (Kubernetes 1.27+): the Job's uid.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
# The kinds whose pods all belong to one batch Job (a JobSet's and a TrainJob's one replicated Job "node").
_ONE_JOB = frozenset({RowKey.INDEXED_JOB, RowKey.JOBSET, RowKey.TRAINJOB})


def run_key_env(target: RowKey) -> list[FieldEnv]:
    """The run key on Kubernetes (runkey.py): the uid of the Job that owns
    the pods, read from the pod's labels. The API server assigns it when the
    Job is created, so no manifest holds it and every submission is a new
    run; a stranger on the pod network cannot learn it, while anyone allowed
    to read the Job or its pods through the API can (docs/guides/security.md, threat
    model). A PyTorchJob's operator creates the pods itself, with no uid
    they share in their labels: none there, and the job runs unkeyed."""
    return [FieldEnv(runkey.ENV, f"metadata.labels['{JOB_UID_LABEL}']")] if target in _ONE_JOB else []


@dataclass(frozen=True)
class Container:
    """The one training container, whatever the kind."""

    name: str
    image: str
    pull_policy: str
    command: list[Arg]
    env: dict[str, str]
    resources: PodResources
    port: Port | None
    mounts: list[dict[str, Any]]
    security_context: dict[str, Any]
    secrets: list[SecretEnv] = field(default_factory=list)
    field_env: list[FieldEnv] = field(default_factory=list)

    @property
    def from_elsewhere(self) -> list[dict[str, Any]]:
        """The env items whose value is in no manifest: secrets, then the downward API's."""
        return [s.item for s in self.secrets] + [f.item for f in self.field_env]

    @property
    def k8s_command(self) -> list[str]:
        """The command exactly as it must appear in the manifest."""
        return [k8s_arg(a) for a in self.command]


@dataclass(frozen=True)
class Pod:
    """The pod template as every kind renders it: the template's `pod`."""

    container: Container
    fields: dict[str, Any]  # scalar pod-spec fields, rendered as they are (pod_fields)
    volumes: list[dict[str, Any]]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    image_pull_secrets: list[str]
    labels: dict[str, str]
    annotations: dict[str, str]


def pod_cpu(spec: JobSpec) -> str | None:
    """The pod's CPU: k8s.cpu (a pod's own quantity, e.g. 500m) where set,
    else resources.cpus_per_process for each of the node's processes."""
    per_process = spec.resources.cpus_per_process
    if spec.k8s.cpu is not None or per_process is None:
        return spec.k8s.cpu
    return str(per_process * spec.nproc_per_node)


def resources(spec: JobSpec) -> PodResources:
    """Requests equal limits (Guaranteed QoS: a training pod should not be
    the first one evicted); GPUs are limits only, as the device plugin wants."""
    fixed = {k: v for k, v in (("cpu", pod_cpu(spec)), ("memory", spec.resources.memory_per_node)) if v is not None}
    limits = dict(fixed)
    if spec.device == "cuda":
        limits[GPU_RESOURCE] = str(spec.gpus_per_node)
    if spec.k8s.rdma is not None:
        limits[spec.k8s.rdma.resource] = str(spec.k8s.rdma.count)
    return PodResources(requests=fixed, limits=limits)


def volume_manifest(v: K8sVolume) -> dict[str, Any]:
    """The pod's `volumes:` item for one spec volume."""
    source: dict[str, Any]
    if v.persistent_volume_claim is not None:
        source = {"claimName": v.persistent_volume_claim}
        if v.read_only:
            source["readOnly"] = True
    elif v.host_path is not None:
        source = {"path": v.host_path, "type": "Directory"}
    elif v.nfs is not None:
        source = {"server": v.nfs.server, "path": v.nfs.path, **({"readOnly": True} if v.read_only else {})}
    elif v.config_map is not None:
        source = {"name": v.config_map}
    elif v.secret is not None:
        source = {"secretName": v.secret}
    else:
        assert v.empty_dir is not None  # the spec's _one_source guarantees one source
        source = {k: val for k, val in (("medium", v.empty_dir.medium), ("sizeLimit", v.empty_dir.size_limit))
                  if val}
    return {"name": v.name, VOLUME_KEYS[v.source]: source}


def mount_manifest(v: K8sVolume) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": v.name, "mountPath": v.mount_path}
    if v.read_only:
        mount["readOnly"] = True
    if v.sub_path is not None:
        mount["subPath"] = v.sub_path
    return mount


def workdir_on_empty_dir(spec: JobSpec) -> str | None:
    """command.workdir where no volume of the spec's holds it: an emptyDir is
    mounted there, since the non-root container can make no folder outside
    its volumes (fsGroup makes the emptyDir writable for it)."""
    folder = spec.command.workdir
    if folder is None or program_paths.under(str(folder), [v.mount_path for v in spec.k8s.volumes]):
        return None
    return str(folder)


def pod_volumes(spec: JobSpec) -> list[dict[str, Any]]:
    """/dev/shm (memory-backed: DataLoader workers and NCCL need more than
    the runtime's 64 MiB), the spec's volumes, and command.workdir's emptyDir
    where no volume holds it, in every kind alike."""
    shm = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}}
    workdir = [{"name": WORKDIR_VOLUME, "emptyDir": {}}] if workdir_on_empty_dir(spec) else []
    return [shm, *(volume_manifest(v) for v in spec.k8s.volumes), *workdir]


def container_mounts(spec: JobSpec) -> list[dict[str, Any]]:
    folder = workdir_on_empty_dir(spec)
    workdir = [{"name": WORKDIR_VOLUME, "mountPath": folder}] if folder else []
    return [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, *(mount_manifest(v) for v in spec.k8s.volumes), *workdir]


def security_context(spec: JobSpec) -> dict[str, Any]:
    """What the restricted Pod Security Standard asks of a container; RDMA
    adds IPC_LOCK (NCCL pins its buffers with mlock), which no level but
    privileged allows."""
    caps: dict[str, list[str]] = {"drop": ["ALL"]}
    if spec.k8s.rdma is not None:
        caps["add"] = ["IPC_LOCK"]
    return {
        "runAsNonRoot": True,
        "runAsUser": spec.k8s.run_as_user,
        "allowPrivilegeEscalation": False,
        "seccompProfile": {"type": "RuntimeDefault"},
        "capabilities": caps,
    }


def pod_fields(spec: JobSpec) -> dict[str, Any]:
    """The scalar pod-spec fields, rendered as they are (TrainJob: in its runtime patch)."""
    # fsGroup: the kubelet makes PVC and emptyDir volumes group-writable by
    # this group, so the non-root container can write its checkpoints.
    out: dict[str, Any] = {"terminationGracePeriodSeconds": spec.grace.k8s_grace_s,
                           "securityContext": {"fsGroup": spec.k8s.run_as_user}}
    scheduler = gang.scheduler_name(spec)
    if scheduler is not None:
        out["schedulerName"] = scheduler
    if spec.k8s.host_network:
        # Without it a host-network pod resolves names with the node's
        # resolver and cannot find its peers' Service names.
        out |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    return out


def secret_env(spec: JobSpec) -> list[SecretEnv]:
    """Each secret's Secret and key: its own `k8s`, else `k8s.secret` with
    the variable's name as the key. secret_problems refuses one with neither."""
    out = []
    for s in spec.secrets:
        secret = s.k8s.secret if s.k8s else spec.k8s.secret
        if secret is not None:
            out.append(SecretEnv(s.name, secret, (s.k8s.key if s.k8s else None) or s.name))
    return out


def secret_problems(spec: JobSpec) -> list[str]:
    unsourced = [s.name for s in spec.secrets if s.k8s is None and spec.k8s.secret is None]
    if not unsourced:
        return []
    return [f"secrets: {unsourced} have no Kubernetes Secret to come from; set k8s.secret (a Secret "
            "with a key of each name), or give each entry its own k8s: {secret: NAME, key: KEY}"]


def container(spec: JobSpec, info: KindInfo, launch: LaunchPlan | None = None) -> Container:
    """The training container. Its env is the job env of the kind's contract
    row (the PyTorchJob operator appends PYTHONUNBUFFERED=1 itself)."""
    launch = launch or resolve(spec, info.target)
    port = launch.port
    return Container(
        name=info.container,
        image=spec.image,
        pull_policy=spec.k8s.image_pull_policy,
        command=launch.argv,
        env=launch.env | records_env(spec),
        resources=resources(spec),
        port=Port(info.port_name, int(port)) if info.port_name and port is not None else None,
        mounts=container_mounts(spec),
        security_context=security_context(spec),
        secrets=secret_env(spec),
        field_env=run_key_env(info.target),
    )


def pod_view(spec: JobSpec, cont: Container, labels: dict[str, str], annotations: dict[str, str]) -> Pod:
    return Pod(
        container=cont, fields=pod_fields(spec), volumes=pod_volumes(spec),
        node_selector=dict(spec.k8s.node_selector),
        tolerations=[t.model_dump(exclude_none=True) for t in spec.k8s.tolerations],
        image_pull_secrets=list(spec.k8s.image_pull_secrets), labels=labels, annotations=annotations,
    )


def security_level(p: Pod) -> podsecurity.Level:
    """The Pod Security level of the pod spec built from the same values the
    templates render (verify() re-checks the parsed file)."""
    view = {**p.fields, "volumes": p.volumes,
            "containers": [{"name": p.container.name, "securityContext": p.container.security_context}]}
    return podsecurity.level(view)


def storage_warnings(spec: JobSpec) -> list[str]:
    """The resume warning, and what a program of the user's own needs that the pod's volumes do not hold."""
    warning = resume_warning(spec)
    seen = [v.mount_path for v in spec.k8s.volumes]
    kept = [v.mount_path for v in spec.k8s.volumes if v.source in SHARED_SOURCES and not v.read_only]
    view = program_paths.ContainerView("k8s", seen=seen, kept=kept, fix=program_paths.volume_fix)
    folder = workdir_on_empty_dir(spec)
    workdir = [] if folder is None else [
        f"warning: k8s: command.workdir {shlex.quote(folder)} is an emptyDir in each pod: what the program writes "
        "there goes with the pod. "
        f"Fix: {program_paths.volume_fix(folder)}"]
    return [*([warning] if warning else []), *program_paths.program_warnings(spec, view), *workdir]


# ---- verify: the same values read back from the parsed file ----


def env_list_to_dict(items: list[dict[str, Any]] | None, where: str) -> dict[str, str]:
    """The literal `value:` items (valueFrom items: secret_items)."""
    out: dict[str, str] = {}
    names: set[str] = set()
    for item in items or []:
        if item["name"] in names:
            raise RenderError(f"{where}: env {item['name']!r} appears twice")
        names.add(item["name"])
        if "valueFrom" not in item:
            out[item["name"]] = kubelet_unliteral(item["value"])
    return out


def secret_items(items: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [item for item in items or [] if "valueFrom" in item]


def check_container(got: dict[str, Any], want: Container, where: str, *, full: bool = True) -> list[str]:
    problems = []
    if got.get("name") != want.name:
        problems.append(f"{where}: container is named {got.get('name')!r}, expected {want.name!r}")
    if not got.get("image") or got["image"] != want.image:
        problems.append(f"{where}: image {got.get('image')!r} is not the job's {want.image!r}")
    if got.get("command") != want.k8s_command:
        problems.append(f"{where}: command differs from the torchrun line")
    if env_list_to_dict(got.get("env"), where) != want.env:
        problems.append(f"{where}: env differs from the job's environment")
    if secret_items(got.get("env")) != want.from_elsewhere:
        problems.append(f"{where}: the valueFrom items differ from the spec's secrets and the run key")
    if full:
        paths = {m["mountPath"] for m in got.get("volumeMounts", [])}
        if "/dev/shm" not in paths:
            problems.append(f"{where}: /dev/shm is not mounted")
        if got.get("volumeMounts") != want.mounts:
            problems.append(f"{where}: volumeMounts differ from k8s.volumes")
        if got.get("securityContext") != want.security_context:
            problems.append(f"{where}: securityContext differs from the spec's")
    return problems


def check_pods(pods: list[dict[str, Any]], spec: JobSpec) -> list[str]:
    """What every kind's pods share: the volumes and the grace period."""
    problems = []
    for p in pods:
        if p.get("volumes") != pod_volumes(spec):
            problems.append("pod volumes differ from k8s.volumes")
        if p.get("terminationGracePeriodSeconds") != spec.grace.k8s_grace_s:
            problems.append("terminationGracePeriodSeconds differs from the grace chain (k8s.termination_grace_s)")
    return problems


def check_pod_security(text: str, pods: list[dict[str, Any]]) -> list[str]:
    """The level named on the file's first line is the one its pods meet."""
    first = text.split("\n", 1)[0]
    got = podsecurity.lowest([podsecurity.level(p) for p in pods])
    if not first.startswith(pss_comment(got.value)):
        return [f"first line {first!r} does not name the Pod Security level its pods meet ({got.value})"]
    return []

