"""Kubernetes: one multi-document YAML file per job, of one of three kinds.

- pytorchjob: Kubeflow PyTorchJob (kubeflow.org/v1), one Master + Workers.
- indexed-job: a plain batch/v1 Indexed Job with its headless Service; runs on
  any cluster, no operator needed.
- trainjob: Kubeflow Trainer v2 TrainJob on the `torch-distributed` runtime.
- jobset: a JobSet (jobset.x-k8s.io/v1alpha2) of one Indexed Job; needs the
  JobSet controller, which also makes the headless Service.

All three run the same torchrun line (contract.torchrun_argv); only where the
node rank and master come from differs, and that is `$(VAR)` that the kubelet
expands from the environment each controller injects. Upstream facts used
here are from kubeflow/training-operator release-1.9 (pytorch_types.go,
envvar.go, pytorchjob_webhook.go) and kubeflow/trainer (plugins/torch/torch.go,
pkg/constants, trainjob_types.go).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from .. import envnames
from ..contract import (
    Arg,
    Target,
    elastic_refusal,
    hosts_for,
    k8s_service_name,
    master_port,
    rdzv_conf,
    sources,
    target_env,
    torchrun_argv,
)
from ..quoting import kubelet_unliteral
from ..render import OutputFile, Rendered, RenderError, k8s_arg
from ..spec import DNS1035, VOLCANO_GROUP_ANNOTATION, JobSpec, K8sVolume
from ..specfile import SpecError
from . import mounts, podsecurity

NAME = "k8s"

Kind = Literal["pytorchjob", "indexed-job", "trainjob", "jobset"]

KIND_TARGET: dict[str, Target] = {
    "pytorchjob": Target.PYTORCHJOB,
    "indexed-job": Target.INDEXED_JOB,
    "trainjob": Target.TRAINJOB,
    "jobset": Target.JOBSET,
}

# kubeflow.org/v1 PyTorchJob: the operator reads the master port from this
# container's port of this name, and refuses a job without the container.
PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_ROLES = ("Master", "Worker")

# Kubeflow Trainer's torch-distributed runtime: replicated job and container
# are both named "node"; the torch plugin refuses these names in trainer.env.
TRAINJOB_NODE = "node"
TRAINJOB_RESERVED_ENV = frozenset(
    {envnames.PET_NNODES, envnames.PET_NPROC_PER_NODE, envnames.PET_NODE_RANK, envnames.PET_MASTER_ADDR,
     envnames.PET_MASTER_PORT}
)
TRAINJOB_MAX_ITEMS = 128  # trainer.command / args / env: kubebuilder MaxItems
# JobSet: its one replicated Job; the webhook checks that the longest pod name,
# <jobset>-<rjob>-<jobIndex>-<podIndex> plus the Job controller's 5-character
# random suffix ("-abcde"), is a DNS-1035 label (pkg/webhooks/jobset_webhook.go, v0.12.0).
JOBSET_RJOB = "node"
JOBSET_POD_SUFFIX = "-abcde"
CONTAINER_NAMES: dict[str, str] = {
    "pytorchjob": PYTORCH_CONTAINER, "indexed-job": "trainer", "trainjob": TRAINJOB_NODE, "jobset": JOBSET_RJOB,
}
PATCH_MANAGER = "ddpkit.io/render"

GPU_RESOURCE = "nvidia.com/gpu"
DNS_LABEL_MAX = 63
SHM_VOLUME = "dshm"
# Shared storage that outlives a pod: where a checkpoint for `--resume auto` can live.
SHARED_SOURCES = frozenset({"persistent_volume_claim", "nfs"})
# spec field -> Kubernetes volume source key.
VOLUME_KEYS = {
    "persistent_volume_claim": "persistentVolumeClaim", "host_path": "hostPath", "nfs": "nfs",
    "config_map": "configMap", "secret": "secret", "empty_dir": "emptyDir",
}
PSS_PREFIX = "# Pod Security Standard: "
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
VOLCANO = "volcano"


@dataclass(frozen=True)
class Port:
    name: str
    number: int


@dataclass(frozen=True)
class Resources:
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
class Container:
    """The one training container, whatever the kind."""

    name: str
    image: str
    pull_policy: str
    command: list[Arg]
    env: dict[str, str]
    resources: Resources
    port: Port | None
    mounts: list[dict[str, Any]]
    security_context: dict[str, Any]
    secrets: list[SecretEnv] = field(default_factory=list)

    @property
    def k8s_command(self) -> list[str]:
        """The command exactly as it must appear in the manifest."""
        return [k8s_arg(a) for a in self.command]


def kind_of(spec: JobSpec) -> Kind:
    return spec.k8s.kind


def filename(spec: JobSpec) -> str:
    """`<job>.<kind>.yaml`: two jobs rendered into one folder keep their own files."""
    return f"{spec.name}.{spec.k8s.kind}.yaml"


def labels(spec: JobSpec) -> dict[str, str]:
    return {"app.kubernetes.io/managed-by": "ddpkit", "ddpkit.io/job": spec.name}


def object_labels(spec: JobSpec) -> dict[str, str]:
    """The job object's labels: Kueue admits a job whose object names its
    LocalQueue (and that was created suspended; it unsuspends it)."""
    out = labels(spec)
    if spec.k8s.queue is not None:
        out[KUEUE_QUEUE_LABEL] = spec.k8s.queue
    return out


def pod_annotations(spec: JobSpec) -> dict[str, str]:
    """The spec's pod annotations, and, for Volcano on kinds without a
    scheduling field of their own, the PodGroup each pod belongs to."""
    out = dict(spec.k8s.pod_annotations)
    if spec.k8s.scheduler == VOLCANO and kind_of(spec) in ("indexed-job", "jobset"):
        out[VOLCANO_GROUP_ANNOTATION] = spec.name
    return out


def resources(spec: JobSpec) -> Resources:
    """Requests equal limits (Guaranteed QoS: a training pod should not be
    the first one evicted); GPUs are limits only, as the device plugin wants."""
    fixed = {k: v for k, v in (("cpu", spec.k8s.cpu), ("memory", spec.k8s.memory)) if v is not None}
    limits = dict(fixed)
    if spec.device == "cuda":
        limits[GPU_RESOURCE] = str(spec.gpus_per_node)
    if spec.k8s.rdma is not None:
        limits[spec.k8s.rdma.resource] = str(spec.k8s.rdma.count)
    return Resources(requests=fixed, limits=limits)


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


def pod_volumes(spec: JobSpec) -> list[dict[str, Any]]:
    """/dev/shm (memory-backed: DataLoader workers and NCCL need more than
    the runtime's 64 MiB) and the spec's volumes, in every kind alike."""
    shm = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.k8s.shm_size}}
    return [shm, *(volume_manifest(v) for v in spec.k8s.volumes)]


def container_mounts(spec: JobSpec) -> list[dict[str, Any]]:
    return [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, *(mount_manifest(v) for v in spec.k8s.volumes)]


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
    """The pod-spec fields every kind but TrainJob renders as they are."""
    # fsGroup: the kubelet makes PVC and emptyDir volumes group-writable by
    # this group, so the non-root container can write its checkpoints.
    out: dict[str, Any] = {"terminationGracePeriodSeconds": spec.grace.k8s_grace_s,
                           "securityContext": {"fsGroup": spec.k8s.run_as_user}}
    if spec.k8s.scheduler == VOLCANO:
        out["schedulerName"] = VOLCANO
    if spec.k8s.host_network:
        # Without it a host-network pod resolves names with the node's
        # resolver and cannot find its peers' Service names.
        out |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    return out


def pod_security_view(spec: JobSpec, cont: Container) -> dict[str, Any]:
    """The pod spec as far as Pod Security is concerned, built from the same
    values the templates render (verify() re-checks the parsed file)."""
    return {**pod_fields(spec), "volumes": pod_volumes(spec),
            "containers": [{"name": cont.name, "securityContext": cont.security_context}]}


def resume_warning(spec: JobSpec) -> str | None:
    """`--resume auto` needs the checkpoint directory on storage that outlives
    the pod; without one a restarted pod starts again from step 0."""
    shared = [v.mount_path for v in spec.k8s.volumes if v.source in SHARED_SOURCES and not v.read_only]
    ckpt = mounts.unmounted_checkpoint(spec, shared)
    if ckpt is None:
        return None
    parent = mounts.checkpoint_parent(ckpt)
    return (
        f"warning: k8s: --resume auto but no shared writable volume is mounted at or above "
        f"--checkpoint-dir {shlex.quote(ckpt)}: a restarted pod finds no checkpoint and starts again. "
        f"Fix: add to k8s.volumes {{name: ckpt, mount_path: {parent}, persistent_volume_claim: <claim>}} "
        f"(a ReadWriteMany PVC or nfs)"
    )


def container_env(spec: JobSpec, kind: Kind) -> dict[str, str]:
    """The job env (the PyTorchJob operator appends PYTHONUNBUFFERED=1
    itself, so its row in the contract leaves it out)."""
    return target_env(spec, KIND_TARGET[kind])


def secret_env(spec: JobSpec) -> list[SecretEnv]:
    """Each secret's Secret and key: its own `k8s`, else `k8s.secret` with
    the variable's name as the key. check_spec refuses one with neither."""
    out = []
    for s in spec.secrets:
        secret = s.k8s.secret if s.k8s else spec.k8s.secret
        if secret is not None:
            out.append(SecretEnv(s.name, secret, (s.k8s.key if s.k8s else None) or s.name))
    return out


def container(spec: JobSpec, *, doctor: bool = False) -> Container:
    kind = kind_of(spec)
    target = KIND_TARGET[kind]
    port = master_port(spec, target)
    return Container(
        name=CONTAINER_NAMES[kind],
        image=spec.image,
        pull_policy=spec.k8s.image_pull_policy,
        command=torchrun_argv(spec, sources(spec, target), doctor=doctor),
        env=container_env(spec, kind),
        resources=resources(spec),
        port=Port(PYTORCH_PORT_NAME, int(port)) if kind == "pytorchjob" and port is not None else None,
        mounts=container_mounts(spec),
        security_context=security_context(spec),
        secrets=secret_env(spec),
    )


def pod_host_labels(spec: JobSpec) -> list[str]:
    """The first DNS label of every pod's host name: each must fit in 63
    characters (the PyTorchJob operator also makes a Service of that name)."""
    return [host.split(".")[0] for host in hosts_for(spec, KIND_TARGET[kind_of(spec)])]


def check_spec(spec: JobSpec) -> None:
    """Input problems only Kubernetes has: raised as SpecError (exit 2)
    before anything is rendered."""
    refusal = elastic_refusal(spec, KIND_TARGET[kind_of(spec)])
    if refusal:  # first: nothing below can build this job's launch line
        raise SpecError([refusal])
    problems = [p for p in [mounts.refusal(spec, KIND_TARGET[kind_of(spec)])] if p]
    unsourced = [s.name for s in spec.secrets if s.k8s is None and spec.k8s.secret is None]
    if unsourced:
        problems.append(f"secrets: {unsourced} have no Kubernetes Secret to come from; set k8s.secret (a Secret "
                        "with a key of each name), or give each entry its own k8s: {secret: NAME, key: KEY}")
    longest = max(pod_host_labels(spec), key=len)
    if len(longest) > DNS_LABEL_MAX:
        room = DNS_LABEL_MAX - (len(longest) - len(spec.name))
        problems.append(
            f"name: {spec.name!r} is too long for k8s.kind={spec.k8s.kind} with {spec.nodes} nodes: "
            f"pod host name {longest!r} has {len(longest)} characters and Kubernetes allows "
            f"{DNS_LABEL_MAX}; shorten name to at most {room} characters"
        )
    if kind_of(spec) == "jobset":
        pod_name = f"{spec.name}-{JOBSET_RJOB}-0-{spec.nodes - 1}{JOBSET_POD_SUFFIX}"
        if len(pod_name) > DNS_LABEL_MAX:
            problems.append(
                f"name: {spec.name!r} is too long for a JobSet of {spec.nodes} nodes: the JobSet webhook needs "
                f"pod name {pod_name!r} to fit in {DNS_LABEL_MAX} characters; shorten name to at most "
                f"{DNS_LABEL_MAX - (len(pod_name) - len(spec.name))} characters")
    if kind_of(spec) == "trainjob":
        reserved = sorted((set(spec.env) | set(spec.secret_names)) & TRAINJOB_RESERVED_ENV)
        if reserved:
            problems.append(f"env: {reserved} are set by the Trainer's torch plugin; remove them")
        cont = container(spec)
        for what, count in (("env", len(cont.env) + len(cont.secrets)), ("command", len(cont.command))):
            if count > TRAINJOB_MAX_ITEMS:
                problems.append(
                    f"{'command.args' if what == 'command' else 'env'}: a TrainJob allows at most "
                    f"{TRAINJOB_MAX_ITEMS} {what} items and this job needs {count}; shorten it"
                )
    if problems:
        raise SpecError(problems)


def pss_comment(pss: podsecurity.Level) -> str:
    return f"{PSS_PREFIX}{pss.value}"


def build(spec: JobSpec, *, doctor: bool = False) -> list[OutputFile]:
    check_spec(spec)
    kind = kind_of(spec)
    target = KIND_TARGET[kind]
    cont = container(spec, doctor=doctor)
    pss = podsecurity.level(pod_security_view(spec, cont))
    # The two notes a platform engineer needs before applying (the CLI
    # prints them on stderr, so `ddpkit render k8s > job.yaml` stays clean YAML).
    warning = None if doctor else resume_warning(spec)
    notes = (*([warning] if warning else []), f"meets Pod Security level {pss.value}")
    variables: dict[str, Any] = {
        "spec": spec,
        "container": cont,
        "pss_comment": pss_comment(pss),
        "volumes": pod_volumes(spec),
        "pod_fields": pod_fields(spec),
        "labels": labels(spec),
        "object_labels": object_labels(spec),
        "pod_annotations": pod_annotations(spec),
        "suspend": spec.k8s.queue is not None,
        "pod_group": spec.k8s.scheduler == VOLCANO and kind in ("indexed-job", "jobset"),
        "hosts": hosts_for(spec, target),
        "port": master_port(spec, target),
        "service": k8s_service_name(spec),
        "roles": [(role, n) for role, n in zip(PYTORCH_ROLES, (1, spec.nodes - 1)) if n > 0],
        "restart_policy": restart_policy(spec),
        "backoff_limit": backoff_limit(spec),
        "elastic_policy": elastic_policy(spec),
        "replicated_job": JOBSET_RJOB if kind == "jobset" else TRAINJOB_NODE,
        "patch_manager": PATCH_MANAGER,
    }
    return [OutputFile(filename(spec), f"k8s/{kind}.yaml.j2", variables, "yaml", notes=notes)]


def restart_policy(spec: JobSpec) -> str:
    """Never when the job may not retry: a restarted container would wait
    alone in a rendezvous its peers have left. OnFailure lets the operator
    count restarts against backoffLimit."""
    return "OnFailure" if spec.k8s.backoff_limit > 0 or spec.elastic else "Never"


def backoff_limit(spec: JobSpec) -> int:
    """Elastic: a failed pod restarts (OnFailure) and rejoins; allow the
    job at least max_restarts of those before the operator fails it."""
    if spec.elastic is None:
        return spec.k8s.backoff_limit
    return max(spec.k8s.backoff_limit, spec.elastic.max_restarts)


def elastic_policy(spec: JobSpec) -> dict[str, Any] | None:
    """The PyTorchJob's elasticPolicy (kubeflow.org/v1): the same c10d
    rendezvous, id, timeouts and node range as the torchrun line, so the
    PET_* variables the operator derives from it agree with the flags.
    Replicas count pods: the Master is one of them."""
    e = spec.elastic
    if e is None:
        return None
    port = master_port(spec, Target.PYTORCHJOB)
    conf = rdzv_conf(spec, Target.PYTORCHJOB)
    return {
        "minReplicas": e.min_nodes, "maxReplicas": spec.nodes, "maxRestarts": e.max_restarts,
        "rdzvBackend": "c10d", "rdzvHost": hosts_for(spec, Target.PYTORCHJOB)[0], "rdzvPort": port,
        "rdzvId": spec.name, "rdzvConf": [{"key": k, "value": str(v)} for k, v in conf.items()],
    }


# ---- verify: parse the file back and apply the controllers' own rules ----


def env_list_to_dict(items: list[dict[str, Any]] | None, where: str) -> dict[str, str]:
    """The literal `value:` items (secretKeyRef items: secret_items)."""
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
    if secret_items(got.get("env")) != [s.item for s in want.secrets]:
        problems.append(f"{where}: the secrets' secretKeyRef items differ from the spec's secrets")
    if full:
        mounts = {m["mountPath"] for m in got.get("volumeMounts", [])}
        if "/dev/shm" not in mounts:
            problems.append(f"{where}: /dev/shm is not mounted")
        if got.get("volumeMounts") != want.mounts:
            problems.append(f"{where}: volumeMounts differ from k8s.volumes")
        if got.get("securityContext") != want.security_context:
            problems.append(f"{where}: securityContext differs from the spec's")
    return problems


def pod_specs(docs: list[dict[str, Any]], kind: Kind) -> list[dict[str, Any]]:
    """Every pod template's spec in the file (for TrainJob: its runtime patch)."""
    out = []
    for doc in docs:
        spec = doc.get("spec") or {}
        if kind == "pytorchjob":
            out += [r["template"]["spec"] for r in (spec.get("pytorchReplicaSpecs") or {}).values()]
        elif doc.get("kind") == "Job":
            out.append(spec["template"]["spec"])
        elif doc.get("kind") == "JobSet":
            out += [r["template"]["spec"]["template"]["spec"] for r in spec.get("replicatedJobs") or []]
        elif kind == "trainjob":
            for patch in spec.get("runtimePatches") or []:
                rjobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
                out += [r["template"]["spec"]["template"]["spec"] for r in rjobs]
    return out


def check_pod_security(text: str, docs: list[dict[str, Any]], kind: Kind) -> list[str]:
    """The level named on the file's first line is the one its pods meet."""
    first = text.split("\n", 1)[0]
    got = podsecurity.lowest([podsecurity.level(p) for p in pod_specs(docs, kind)])
    if not first.startswith(pss_comment(got)):
        return [f"first line {first!r} does not name the Pod Security level its pods meet ({got.value})"]
    return []


def verify_pytorchjob(doc: dict[str, Any], spec: JobSpec, want: Container) -> list[str]:
    """The training-operator's webhook rules, plus agreement with the spec."""
    problems = []
    if doc["spec"].get("elasticPolicy") != elastic_policy(spec):
        problems.append("elasticPolicy differs from the spec's elastic section")
    if (doc.get("apiVersion"), doc.get("kind")) != ("kubeflow.org/v1", "PyTorchJob"):
        problems.append("not a kubeflow.org/v1 PyTorchJob")
    replica_specs = doc["spec"].get("pytorchReplicaSpecs") or {}
    if set(replica_specs) - set(PYTORCH_ROLES):
        problems.append(f"replica types {sorted(replica_specs)}; only Master and Worker exist")
    if replica_specs.get("Master", {}).get("replicas") != 1:
        problems.append("exactly one Master replica is required")
    total = 0
    for role, rspec in replica_specs.items():
        replicas = rspec.get("replicas")
        if not isinstance(replicas, int) or replicas < 1:
            problems.append(f"{role}: replicas must be at least 1")
            continue
        total += replicas
        containers = rspec["template"]["spec"].get("containers") or []
        ours = [c for c in containers if c.get("name") == PYTORCH_CONTAINER]
        if not ours:
            problems.append(f"{role}: no container named {PYTORCH_CONTAINER!r}")
            continue
        problems += check_container(ours[0], want, role)
        ports = {p.get("name"): p.get("containerPort") for p in ours[0].get("ports", [])}
        if want.port and ports.get(PYTORCH_PORT_NAME) != want.port.number:
            problems.append(f"{role}: port {PYTORCH_PORT_NAME} is not {want.port.number}")
    if total != spec.nodes:
        problems.append(f"{total} pods for {spec.nodes} nodes")
    elastic = doc["spec"].get("elasticPolicy")
    if elastic is not None:  # pytorchjob_webhook.go validateSpec
        if "Worker" not in replica_specs:
            problems.append("Worker must be configured if elastic policy is used")
        if "nProcPerNode" in elastic and "nprocPerNode" in doc["spec"]:
            problems.append("elasticPolicy.nProcPerNode must not be used with nprocPerNode")
    if doc["spec"].get("nprocPerNode") != str(spec.nproc_per_node):
        problems.append("nprocPerNode (a string in kubeflow.org/v1) differs from nproc_per_node")
    return problems


def verify_indexed_job(docs: list[dict[str, Any]], spec: JobSpec, want: Container) -> list[str]:
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


def job_object(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The document Kueue admits: the one that is not a Service or PodGroup."""
    return next(d for d in docs if d.get("kind") not in ("Service", "PodGroup"))


def verify_gang(docs: list[dict[str, Any]], spec: JobSpec, kind: Kind) -> list[str]:
    """Kueue: the queue label and suspend on the job object. Volcano: every
    pod names the scheduler, and a PodGroup of minMember = nodes holds them
    (the kind's own field for PyTorchJob)."""
    problems = []
    obj = job_object(docs)
    queue = obj["metadata"].get("labels", {}).get(KUEUE_QUEUE_LABEL)
    spec_part = obj["spec"]["runPolicy"] if kind == "pytorchjob" else obj["spec"]
    if queue != spec.k8s.queue or bool(spec_part.get("suspend")) != (spec.k8s.queue is not None):
        problems.append(f"Kueue: label {KUEUE_QUEUE_LABEL} / suspend disagree with k8s.queue")
    volcano = spec.k8s.scheduler == VOLCANO
    if any((p.get("schedulerName") == VOLCANO) != volcano for p in pod_specs(docs, kind)):
        problems.append("schedulerName disagrees with k8s.scheduler")
    groups = [d for d in docs if d.get("kind") == "PodGroup"]
    if kind == "pytorchjob":
        policy = obj["spec"]["runPolicy"].get("schedulingPolicy")
        if (policy == {"minAvailable": spec.nodes}) != volcano:
            problems.append("runPolicy.schedulingPolicy.minAvailable disagrees with k8s.scheduler")
    elif kind != "trainjob" and volcano and (
            [g["spec"].get("minMember") for g in groups] != [spec.nodes] or groups[0]["metadata"]["name"] != spec.name):
        problems.append(f"expected one PodGroup {spec.name!r} with minMember {spec.nodes}")
    if groups and not (volcano and kind in ("indexed-job", "jobset")):
        problems.append("a PodGroup without scheduler: volcano")
    return problems


def verify_jobset(doc: dict[str, Any], spec: JobSpec, want: Container) -> list[str]:
    """JobSet's CRD and webhook rules that ddpkit's output could break, and
    the pod layout the rank contract assumes."""
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        problems.append("not a jobset.x-k8s.io/v1alpha2 JobSet")
    s = doc["spec"]
    net = s.get("network") or {}
    if net.get("enableDNSHostnames") is not True or net.get("subdomain", spec.name) != spec.name:
        problems.append("network.enableDNSHostnames must be true with the JobSet's name as subdomain")
    rjobs = s.get("replicatedJobs") or []
    if [r.get("name") for r in rjobs] != [JOBSET_RJOB] or rjobs[0].get("replicas") != 1:
        problems.append(f"expected one replicatedJob {JOBSET_RJOB!r} with replicas 1")
        return problems
    j = rjobs[0]["template"]["spec"]
    if j.get("completionMode") != "Indexed" or not j.get("completions") == j.get("parallelism") == spec.nodes:
        problems.append("Job must be Indexed with completions = parallelism = nodes")
    if (s.get("failurePolicy") or {}).get("maxRestarts") != spec.k8s.backoff_limit:
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


def verify_trainjob(doc: dict[str, Any], spec: JobSpec, want: Container) -> list[str]:
    """The Trainer's CRD rules and its torch plugin's Validate()."""
    problems = []
    if (doc.get("apiVersion"), doc.get("kind")) != ("trainer.kubeflow.org/v1alpha1", "TrainJob"):
        problems.append("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    t = doc["spec"].get("trainer") or {}
    if doc["spec"].get("runtimeRef", {}).get("name") != spec.k8s.runtime:
        problems.append(f"runtimeRef is not {spec.k8s.runtime!r}")
    if t.get("numNodes") != spec.nodes or t.get("numProcPerNode") != spec.nproc_per_node:
        problems.append("numNodes / numProcPerNode differ from the spec")
    problems += check_container({"name": want.name, **t}, want, "trainer", full=False)
    for pod in pod_specs([doc], "trainjob"):
        patched = [c for c in pod.get("containers") or [] if c.get("name") == want.name]
        if len(patched) != 1 or patched[0].get("volumeMounts") != want.mounts \
                or patched[0].get("securityContext") != want.security_context:
            problems.append(f"runtime patch: container {want.name!r} lacks the volume mounts or securityContext")
    env_names = {e["name"] for e in t.get("env", [])}
    if env_names & TRAINJOB_RESERVED_ENV:
        problems.append(f"trainer.env sets reserved {sorted(env_names & TRAINJOB_RESERVED_ENV)}")
    for key in ("command", "args", "env"):
        if len(t.get(key) or []) > TRAINJOB_MAX_ITEMS:
            problems.append(f"trainer.{key} has more than {TRAINJOB_MAX_ITEMS} items")
    return problems


def verify(spec: JobSpec, rendered: Rendered, *, doctor: bool = False) -> None:
    name = filename(spec)
    docs = [d for d in yaml.safe_load_all(rendered.files[name]) if d is not None]
    want = container(spec, doctor=doctor)
    kind = kind_of(spec)
    problems = check_pod_security(rendered.files[name], docs, kind) + verify_gang(docs, spec, kind)
    for pod in pod_specs(docs, kind):
        if pod.get("volumes") != pod_volumes(spec):
            problems.append("pod volumes differ from k8s.volumes")
        if pod.get("terminationGracePeriodSeconds") != spec.grace.k8s_grace_s:
            problems.append("terminationGracePeriodSeconds differs from the grace chain (k8s.termination_grace_s)")
    for doc in docs:
        meta = doc.get("metadata", {})
        if not DNS1035.match(meta.get("name", "")) or len(meta["name"]) > DNS_LABEL_MAX:
            problems.append(f"{doc.get('kind')} name {meta.get('name')!r} is not a DNS-1035 label")
        if meta.get("name") != spec.name or meta.get("namespace") != spec.k8s.namespace:
            problems.append(f"{doc.get('kind')} name/namespace differ from the spec")
    docs = [d for d in docs if d.get("kind") != "PodGroup"]  # verify_gang checked it
    if kind == "indexed-job":
        problems += verify_indexed_job(docs, spec, want)
    elif len(docs) != 1:
        problems.append(f"expected one document, found {len(docs)}")
    elif kind == "pytorchjob":
        problems += verify_pytorchjob(docs[0], spec, want)
    elif kind == "jobset":
        problems += verify_jobset(docs[0], spec, want)
    else:
        problems += verify_trainjob(docs[0], spec, want)
    if problems:
        raise RenderError(f"{name}: " + "; ".join(problems))
