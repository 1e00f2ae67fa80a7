"""The `k8s:` section: what only a Kubernetes job has (the kind, the pod's
resources, volumes, scheduling). The same section renders every kind; what a
kind cannot express is refused here, before any manifest is written."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from .fields import (
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    DNS_LABEL_MAX,
    K8sNamespace,
    K8sObjectName,
    K8sQuantity,
    K8sSize,
    Strict,
    each,
    matching,
    rule,
)


class Toleration(Strict):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None


VolumeSource = Literal["persistent_volume_claim", "host_path", "nfs", "config_map", "secret", "empty_dir"]
VOLUME_SOURCES: tuple[VolumeSource, ...] = (
    "persistent_volume_claim", "host_path", "nfs", "config_map", "secret", "empty_dir")
# The annotation that puts a pod into a Volcano PodGroup.
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
# Names ddpkit's own pod volumes use; a user volume of that name would replace them.
K8S_RESERVED_VOLUMES = frozenset({"dshm", "ddpkit-workdir"})


class NfsSource(Strict):
    server: str = Field(min_length=1)
    path: str = Field(pattern=r"^/")


class EmptyDirSource(Strict):
    medium: Literal["", "Memory"] = ""
    size_limit: K8sSize | None = None


# Kubernetes' volume and volumeMount keys -> (this spec's key, the one key of
# the Kubernetes source object that holds its value, or None: taken as it is).
_K8S_VOLUME_KEYS: dict[str, tuple[str, str | None]] = {
    "mountPath": ("mount_path", None), "readOnly": ("read_only", None), "subPath": ("sub_path", None),
    "persistentVolumeClaim": ("persistent_volume_claim", "claimName"), "hostPath": ("host_path", "path"),
    "configMap": ("config_map", "name"), "secret": ("secret", "secretName"), "emptyDir": ("empty_dir", None),
}


def kubernetes_volume_spelling(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with Kubernetes' keys turned into this spec's (K8sVolume)."""
    out = {k: v for k, v in data.items() if k not in _K8S_VOLUME_KEYS}
    for key, (ours, inner) in _K8S_VOLUME_KEYS.items():
        if key not in data:
            continue
        if ours != key and ours in data:  # `secret` is spelt alike: only its value's form differs
            raise ValueError(f"both {key} and {ours} are set; keep one")
        value = data[key]
        if inner is not None and isinstance(value, dict):
            if set(value) - {inner}:
                raise ValueError(f"{key}: only {{{inner}: ...}} is understood here (got {sorted(value)})")
            value = value.get(inner)
        if key == "emptyDir" and isinstance(value, dict) and "sizeLimit" in value:
            value = {**{k: v for k, v in value.items() if k != "sizeLimit"}, "size_limit": value["sizeLimit"]}
        out[ours] = value
    return out


def _not_reserved(name: str) -> str:
    if name in K8S_RESERVED_VOLUMES:
        raise ValueError(f"{name!r} is ddpkit's /dev/shm volume; choose another name")
    return name


VolumeName = Annotated[str, AfterValidator(matching(
    DNS1123_LABEL, "{value!r} is not a volume name (DNS-1123 label)", max_len=DNS_LABEL_MAX)),
    AfterValidator(_not_reserved)]
# Paths the kubelet reads in a volume and its mount.
AbsolutePath = Annotated[str, AfterValidator(rule(
    lambda v: v.startswith("/") and ":" not in v, "{value!r} must be an absolute path without ':'"))]
# The API server refuses an absolute subPath or one with '..'.
SubPath = Annotated[str, AfterValidator(rule(
    lambda v: not v.startswith("/") and ".." not in v.split("/"), "{value!r} must be a relative path without '..'"))]


class K8sVolume(Strict):
    """One pod volume and its mount in the training container; exactly one
    source field is set. The same volume is rendered in every kind."""

    name: VolumeName
    mount_path: AbsolutePath = Field(description="absolute path in the container")
    read_only: bool = False
    sub_path: SubPath | None = Field(default=None, description="mount only this path inside the volume")
    persistent_volume_claim: K8sObjectName | None = Field(default=None, description="claim name")
    host_path: AbsolutePath | None = Field(default=None, description="absolute path on the node")
    nfs: NfsSource | None = None
    config_map: K8sObjectName | None = Field(default=None, description="ConfigMap name")
    secret: K8sObjectName | None = Field(default=None, description="Secret name")
    empty_dir: EmptyDirSource | None = None

    @model_validator(mode="before")
    @classmethod
    def _kubernetes_spelling(cls, data: Any) -> Any:
        """The pod spec's own spelling (`persistentVolumeClaim: {claimName: x}`,
        `mountPath`, `readOnly`, ...), as a Kubernetes user writes it, means
        the same volume: translated here, one spelling per key."""
        return kubernetes_volume_spelling(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_source(self) -> K8sVolume:
        given = [s for s in VOLUME_SOURCES if getattr(self, s) is not None]
        if len(given) != 1:
            raise ValueError(f"volume {self.name!r}: set exactly one of {', '.join(VOLUME_SOURCES)} (got {given or 'none'})")
        if self.mount_path.rstrip("/") == "/dev/shm":
            raise ValueError("/dev/shm is mounted by ddpkit (resources.shm_size); mount elsewhere")
        return self

    @property
    def source(self) -> VolumeSource:
        return next(s for s in VOLUME_SOURCES if getattr(self, s) is not None)


class RdmaOptions(Strict):
    """An RDMA device resource for NCCL over InfiniBand / RoCE (e.g. the
    k8s-rdma-shared-dev-plugin's rdma/ib); adds IPC_LOCK to the container."""

    resource: str = Field(default="rdma/ib", pattern=r"^[a-z0-9.-]+/[A-Za-z0-9_.-]+$")
    count: int = Field(default=1, ge=1)


SecretNames = Annotated[list[str], AfterValidator(each(matching(
    DNS1123_SUBDOMAIN, "{value!r} is not a Kubernetes secret name (DNS-1123 subdomain)")))]
RuntimeName = Annotated[str, AfterValidator(matching(DNS1123_SUBDOMAIN, "{value!r} is not a Kubernetes object name"))]
LocalQueueName = Annotated[str, AfterValidator(matching(
    DNS1123_SUBDOMAIN, "{value!r} is not a Kueue LocalQueue name (DNS-1123 subdomain)"))]


class K8sOptions(Strict):
    kind: Literal["pytorchjob", "indexed-job", "trainjob", "jobset"] = "pytorchjob"
    namespace: K8sNamespace = "default"
    shm_size: K8sQuantity | None = Field(default=None, description="deprecated: resources.shm_size")
    cpu: K8sQuantity | None = Field(default=None, description=(
        "CPU request and limit per pod, e.g. 500m; default: resources.cpus_per_process x nproc_per_node"))
    memory: K8sQuantity | None = Field(default=None, description="deprecated: resources.memory_per_node")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    image_pull_secrets: SecretNames = Field(default_factory=list)
    secret: K8sObjectName | None = Field(
        default=None, description="the Secret that every secrets: entry without its own k8s is read from "
                                  "(key: the variable's name)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # Running: when the job ends (one pod failed), the operator deletes the
    # pods still running instead of leaving them in a collective for 30 minutes.
    clean_pod_policy: Literal["None", "Running", "All"] = "Running"
    backoff_limit: int = Field(default=0, ge=0)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    runtime: RuntimeName = Field(default="torch-distributed", description="TrainJob runtimeRef name")
    volumes: list[K8sVolume] = Field(default_factory=list, description="pod volumes mounted in the training container")
    run_as_user: int = Field(default=1000, ge=1, description="container UID; non-root (restricted Pod Security)")
    rdma: RdmaOptions | None = Field(default=None, description="RDMA device resource; adds IPC_LOCK")
    host_network: bool = Field(default=False, description="pods use the node's network (not allowed by baseline)")
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="e.g. k8s.v1.cni.cncf.io/networks")
    # The SIGTERM-to-SIGKILL time a preempted pod gets to write a checkpoint:
    # derived from preemption.checkpoint_s unless set (JobSpec.grace).
    termination_grace_s: int | None = Field(
        default=None, ge=0, le=3600,
        description="pod terminationGracePeriodSeconds; default: derived from preemption.checkpoint_s",
    )
    active_deadline_s: int | None = Field(default=None, ge=1, description="wall-clock limit of the whole job")
    queue: LocalQueueName | None = Field(
        default=None, description="Kueue LocalQueue: the job is created suspended and admitted whole")
    scheduler: Literal["default", "volcano"] = Field(default="default", description="volcano: gang-schedule all pods")

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, value: list[K8sVolume]) -> list[K8sVolume]:
        names = [v.name for v in value]
        paths = [v.mount_path.rstrip("/") or "/" for v in value]
        for what, items in (("name", names), ("mount_path", paths)):
            twice = sorted({x for x in items if items.count(x) > 1})
            if twice:
                raise ValueError(f"volume {what} {twice} appears twice; each volume needs its own")
        return value

    @model_validator(mode="after")
    def _kind_options(self) -> K8sOptions:
        # The TrainJob's runtime patch has no hostNetwork or schedulerName
        # field: the runtime owns both.
        if self.kind == "trainjob" and self.host_network:
            raise ValueError("host_network: a TrainJob cannot set it (its runtime patch has no such field); "
                             "set hostNetwork in the ClusterTrainingRuntime, or use another kind")
        if self.kind == "trainjob" and self.scheduler == "volcano":
            raise ValueError("scheduler: a TrainJob cannot choose its scheduler (its runtime patch has no "
                             "schedulerName); set podGroupPolicy.volcano in the ClusterTrainingRuntime, or use "
                             "another kind")
        if self.queue is not None and self.scheduler == "volcano":
            raise ValueError("queue (Kueue) and scheduler: volcano are two gang schedulers for one job; choose one")
        if self.scheduler == "volcano" and VOLCANO_GROUP_ANNOTATION in self.pod_annotations:
            raise ValueError(f"pod_annotations: {VOLCANO_GROUP_ANNOTATION} is set by scheduler: volcano; remove it")
        return self
