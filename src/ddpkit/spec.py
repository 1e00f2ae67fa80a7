"""JobSpec: the one validated description of a DDP job.

Every target (Slurm, Kubernetes, SSH, compose) renders from this model and
nothing else, so a value is checked once, here, before any file is written.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import envnames
from .wire import DEVICES_PER_PROCESS_FLAG, STRATEGY_FLAG, TRAIN_MODULE, flag_value

# Variables the launchers own. A user value for one of these would silently
# fight the rank contract, so they are refused with the reason.
RESERVED_ENV_EXACT = frozenset(
    {
        envnames.RANK,
        envnames.LOCAL_RANK,
        envnames.WORLD_SIZE,
        envnames.LOCAL_WORLD_SIZE,
        envnames.GROUP_RANK,
        envnames.GROUP_WORLD_SIZE,
        envnames.ROLE_RANK,
        envnames.ROLE_WORLD_SIZE,
        envnames.NODE_RANK,
        envnames.NNODES,
        envnames.NPROC_PER_NODE,
        envnames.MASTER_ADDR,
        envnames.MASTER_PORT,
        envnames.JOB_COMPLETION_INDEX,
        *envnames.SOCKET_IFNAMES,
    }
)
RESERVED_ENV_PREFIXES = ("PET_", "TORCHELASTIC_", "SLURM_", "OMPI_COMM_WORLD_", "DDPKIT_")

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IFNAME = re.compile(r"^[A-Za-z0-9_.@:-]{1,15}$")
# Slurm directive values are parsed by sbatch, not by a shell: keep them to
# characters that cannot start another option or another directive.
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,+-]+$")
SLURM_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+$")
SLURM_MEM = re.compile(r"^\d+[KMGT]?$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P|E|Ei)?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_GPUS_PER_NODE = 64
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL byte, which no shell, YAML file or environment can carry; remove it")
    return value


class Strict(BaseModel):
    """Base for every section: unknown keys are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=True)


class Backend(str, Enum):
    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"
    MPI = "mpi"


class Rendezvous(Strict):
    """static: node ranks come from the target (Slurm node id, hostfile line, pod
    index). c10d: torchrun agents agree on node ranks through a c10d store on
    node 0; useful when nodes may restart."""

    backend: Literal["static", "c10d"] = "static"
    timeout_s: int = Field(default=900, ge=10, le=86400, description="rendezvous/collective join timeout")


class Network(Strict):
    interface: str | list[str] = Field(
        default="auto",
        description="'auto' (pick the interface that routes to the master at start-up), one name, or a list",
    )

    @field_validator("interface")
    @classmethod
    def _check_interface(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if isinstance(value, list) and not value:
            raise ValueError("empty list; name at least one interface or use 'auto'")
        for name in names:
            if name.startswith("^"):
                raise ValueError(
                    f"{name!r}: Gloo does not accept NCCL's '^' exclusion syntax; "
                    "name the interface(s) to use, or use 'auto'"
                )
            if name == "auto" and isinstance(value, list):
                raise ValueError("'auto' cannot be mixed with interface names")
            if name != "auto" and not IFNAME.match(name):
                raise ValueError(f"{name!r} is not a Linux interface name (1-15 of A-Z a-z 0-9 _ . @ : -)")
        return value

    @property
    def names(self) -> list[str]:
        return [self.interface] if isinstance(self.interface, str) else list(self.interface)

    @property
    def is_auto(self) -> bool:
        return self.interface == "auto"

    @property
    def ifname_value(self) -> str:
        """The value for NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (comma list)."""
        return ",".join(self.names)


class Command(Strict):
    """What each process runs. Default: the ddpkit training entrypoint."""

    module: str | None = Field(default=None, description="python module run with -m (default ddpkit.train)")
    script: str | None = Field(default=None, description="path of a python script, as seen on the nodes")
    args: list[str] = Field(default_factory=list, description="arguments after the module or script")
    python: str = Field(default="python3", description="interpreter on the nodes / in the image")

    @model_validator(mode="after")
    def _one_of(self) -> Command:
        if self.module and self.script:
            raise ValueError("set either command.module or command.script, not both")
        if self.module is None and self.script is None:
            self.module = TRAIN_MODULE
        return self

    @field_validator("module")
    @classmethod
    def _module(cls, value: str | None) -> str | None:
        if value is not None and not MODULE_NAME.match(value):
            raise ValueError(f"{value!r} is not a dotted python module name, e.g. mypkg.train")
        return value

    @field_validator("script", "python")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is None:
            return value
        _no_nul(value)
        if not value or value.startswith("-") or "\n" in value:
            raise ValueError(f"{value!r} must be a path: not empty, no leading '-', no newline")
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: list[str]) -> list[str]:
        return [_no_nul(a) for a in value]

    def argv(self, *, doctor: bool = False) -> list[str]:
        """The program part of the launch line: ['-m', mod, *args] or [script, *args]."""
        if doctor:
            return ["-m", "ddpkit.doctor"]
        if self.module:
            return ["-m", self.module, *self.args]
        return [str(self.script), *self.args]


# ---- Slurm ---------------------------------------------------------------------

# Docker's rule for the first component of a reference: a registry host when
# it has a dot or a port, or is localhost; otherwise a Docker Hub repository.
DOCKER_HUB_HOSTS = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
# enroot's own parser (src/docker.sh, docker::import): docker://[USER@][REGISTRY#]IMAGE[:TAG]
ENROOT_URI = re.compile(r"^(?:[A-Za-z0-9_.!~*'()%;:&=+$,@-]+@)?(?:[^#]+#)?[a-z0-9/._-]+(?::[A-Za-z0-9._:-]+)?$")
# Schemes apptainer pulls from, and the local forms it opens (`apptainer help build`).
APPTAINER_SCHEME = re.compile(r"^(docker|library|oras|shub|http|https)://|^(docker-archive|docker-daemon|oci|oci-archive):")
ENROOT_SCHEMES = ("dockerd://", "podman://")
SQUASHFS_SUFFIXES = (".sqsh", ".sqfs", ".squashfs")


def _is_local_path(image: str) -> bool:
    return image.startswith(("/", "./", "../"))


def _split_registry(ref: str) -> tuple[str | None, str]:
    """(registry, rest) of a Docker reference; registry None for Docker Hub."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return (None if first in DOCKER_HUB_HOSTS else first), rest
    return None, ref


def enroot_image(image: str) -> str:
    """The image as pyxis' --container-image takes it: an enroot URI
    `[USER@][REGISTRY#]IMAGE[:TAG]` without its docker:// scheme, or a
    squashfs path. `ghcr.io/org/img:tag` -> `ghcr.io#org/img:tag`; Docker Hub
    images lose the host (enroot's default registry is Docker Hub, and it adds
    `library/` to one-word names itself). Raises ValueError with the fix."""
    if _is_local_path(image):
        if image.endswith(".sif"):
            raise ValueError(f"{image!r} is an Apptainer image; pyxis runs squashfs files ({', '.join(SQUASHFS_SUFFIXES)})")
        return image
    if image.endswith(SQUASHFS_SUFFIXES + (".sif",)):
        raise ValueError(f"{image!r}: write a local image as an absolute path or ./relative path "
                         "(pyxis reads any other word as a registry image)")
    if image.startswith(ENROOT_SCHEMES):
        return image
    ref = image.removeprefix("docker://")
    if "://" in ref:
        raise ValueError(f"{image!r}: pyxis/enroot pull docker:// images only (or dockerd://, podman://)")
    if "@sha256:" in ref or "@" in ref.split("#")[-1]:
        raise ValueError(f"{image!r}: enroot's image URI has no digest form; use a tag, or import the image "
                         "to a squashfs file and give its path")
    if "#" not in ref:
        registry, rest = _split_registry(ref)
        ref = f"{registry}#{rest}" if registry else rest
    if not ENROOT_URI.match(ref):
        raise ValueError(f"{image!r} does not fit enroot's [USER@][REGISTRY#]IMAGE[:TAG] "
                         "(the image name is lower-case letters, digits and / . _ -)")
    return ref


def apptainer_image(image: str) -> str:
    """The image as `apptainer exec` takes it: a URI with its scheme
    (`docker://ghcr.io/org/img:tag`), or a local file passed unchanged. An
    enroot-style `REGISTRY#IMAGE` is turned back into a Docker reference."""
    if _is_local_path(image) or APPTAINER_SCHEME.match(image):
        return image
    if image.endswith((".sif", *SQUASHFS_SUFFIXES)):
        raise ValueError(f"{image!r}: write a local image as an absolute path or ./relative path "
                         "(apptainer needs a scheme such as docker:// for anything else)")
    if "://" in image:
        raise ValueError(f"{image!r}: apptainer cannot pull this scheme; use docker://, oras:// or library://")
    registry, sep, rest = image.rpartition("#")
    if sep:
        registry = registry.rpartition("@")[2]  # enroot's USER@: apptainer takes credentials from the environment
        return f"docker://{registry}/{rest}"
    return f"docker://{image}"


def container_image(image: str, runtime: str) -> str:
    """`image` written in the syntax of the Slurm container runtime."""
    if runtime == "pyxis":
        return enroot_image(image)
    if runtime == "apptainer":
        return apptainer_image(image)
    return image


class SlurmContainer(Strict):
    runtime: Literal["none", "pyxis", "apptainer"] = "none"
    mounts: list[str] = Field(default_factory=list, description="'SRC:DST[:ro]' bind mounts, both absolute paths")
    workdir: str | None = None

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value: list[str]) -> list[str]:
        for m in value:
            parts = m.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
                raise ValueError(f"{m!r}: write mounts as SRC:DST or SRC:DST:ro")
            if "," in m or "\n" in m:
                raise ValueError(f"{m!r}: commas and newlines cannot appear in a mount (pyxis splits on commas)")
            relative = [p for p in parts[:2] if not p.startswith("/")]
            if relative:
                # A relative source resolves against wherever the task starts
                # (differently per runtime); a relative target is refused by both.
                raise ValueError(f"{m!r}: {relative[0]!r} is not an absolute path; write both sides of a mount "
                                 f"as absolute paths, e.g. /scratch/data:/data")
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or "\n" in value):
            raise ValueError(f"{value!r}: container workdir must be an absolute path")
        return value


SLURM_DEPENDENCY_TYPES = ("after", "afterany", "afterburstbuffer", "aftercorr", "afternotok", "afterok")
_DEP_ITEM = re.compile(rf"^(singleton|({'|'.join(SLURM_DEPENDENCY_TYPES)})(:\d+(_\d+)?(\+\d+)?)+)$")
SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,&|*!\[\]():+-]+$")
SLURM_HOSTLIST = re.compile(r"^[A-Za-z0-9_.,\[\]-]+$")
# Options ddpkit writes from other fields: a second copy in extra_sbatch
# would silently win over them (sbatch keeps the last) and break the job.
SBATCH_OWNED = {
    "job-name": "name", "nodes": "nodes", "ntasks": "nproc_per_node", "ntasks-per-node": "nproc_per_node",
    "cpus-per-task": "slurm.cpus_per_process", "gpus": "nproc_per_node", "gpus-per-node": "slurm.gpu_request",
    "gpus-per-task": "slurm.gpu_request", "gres": "slurm.gpu_request", "mem": "slurm.mem", "time": "slurm.time",
    "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos", "exclusive": "slurm.exclusive",
    "output": "slurm.output", "requeue": "slurm.requeue", "no-requeue": "slurm.requeue", "signal": "slurm.signal_seconds",
    "open-mode": "slurm.requeue", "dependency": "slurm.dependency", "constraint": "slurm.constraint",
    "reservation": "slurm.reservation", "nodelist": "slurm.nodelist", "exclude": "slurm.exclude",
}


def sbatch_directive_problem(value: str) -> str | None:
    """Why `value` cannot be one #SBATCH argument, or None. sbatch's
    directive parser blanks the words packjob/hetjob anywhere on the line."""
    if "\n" in value or "\r" in value or "\x00" in value:
        return "no newline or NUL"
    if any(word in value.lower() for word in ("packjob", "hetjob")):
        return "sbatch erases the words 'packjob' and 'hetjob' from #SBATCH lines"
    return None


class SlurmOptions(Strict):
    mode: Literal["torchrun", "srun"] = Field(
        default="torchrun",
        description="torchrun: one srun task per node running torchrun; srun: one task per GPU/process",
    )
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = Field(default=None, description="wall time, e.g. 04:00:00 or 1-00:00:00")
    mem: str | None = Field(default=None, description="memory per node, e.g. 64G")
    cpus_per_process: int | None = Field(
        default=None, ge=1, description="CPUs for each training process; each mode derives its --cpus-per-task"
    )
    cpus_per_task: int | None = Field(default=None, description="replaced by cpus_per_process (refused)")
    gpu_request: Literal["gpus-per-node", "gres"] = Field(
        default="gpus-per-node", description="how GPUs are asked for: --gpus-per-node=N or --gres=gpu:N"
    )
    exclusive: bool = False
    output: str = Field(default="%x-%j.out", description="sbatch --output pattern")
    requeue: bool = Field(default=True, description="requeue on preemption after checkpointing")
    signal_seconds: int | None = Field(
        default=None, ge=10, le=3600,
        description="seconds of warning before the time limit (--signal=B:SIG@N); default: derived from "
                    "preemption.checkpoint_s",
    )
    dependency: str | None = Field(default=None, description="e.g. afterok:1234 or afterany:12:13 (sbatch --dependency)")
    constraint: str | None = Field(default=None, description="node features, e.g. a100&ib (sbatch --constraint)")
    reservation: str | None = None
    nodelist: str | None = Field(default=None, description="hosts the job must use, e.g. gpu[01-04]")
    exclude: str | None = Field(default=None, description="hosts the job must not use, e.g. gpu07")
    extra_sbatch: list[str] = Field(default_factory=list, description="raw sbatch options, e.g. --mail-type=END")
    container: SlurmContainer = Field(default_factory=SlurmContainer)

    @field_validator("cpus_per_task")
    @classmethod
    def _cpus_per_task(cls, value: int | None) -> int | None:
        if value is not None:
            # Not mapped: it meant CPUs per node in torchrun mode and per
            # process in srun mode, so no one reading fits both modes.
            raise ValueError(
                "slurm.cpus_per_task is replaced by slurm.cpus_per_process (CPUs for each training process; "
                "ddpkit derives --cpus-per-task for either mode). It meant per node in torchrun mode, per process "
                f"in srun mode: set slurm.cpus_per_process to {value} / nproc_per_node if you used torchrun mode, "
                f"or to {value} if you used srun mode"
            )
        return value

    @field_validator("partition", "account", "qos", "reservation")
    @classmethod
    def _word(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_WORD.match(value):
            raise ValueError(f"{value!r} may only hold letters, digits and _ . , + -")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_TIME.match(value):
            raise ValueError(f"{value!r} is not a Slurm time: use MM, HH:MM:SS or D-HH:MM:SS")
        return value

    @field_validator("mem", mode="before")
    @classmethod
    def _mem_number(cls, value: Any) -> Any:
        # YAML reads `mem: 0` (Slurm: all of the node's memory) and `mem: 64000` (MB) as numbers
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_MEM.match(value):
            raise ValueError(f"{value!r} is not a Slurm memory size: use e.g. 64G or 500M")
        return value

    @field_validator("output")
    @classmethod
    def _output(cls, value: str) -> str:
        if not value or any(c in value for c in "\n\r\t ") or value.startswith("-"):
            raise ValueError(f"{value!r}: an output pattern has no whitespace and no leading '-'")
        problem = sbatch_directive_problem(value)
        if problem:
            raise ValueError(f"{value!r}: {problem}")
        return value

    @field_validator("dependency")
    @classmethod
    def _dependency(cls, value: str | None) -> str | None:
        if value is None:
            return value
        # ',' means all must hold, '?' any; sbatch refuses a list that mixes them.
        items = value.split("?") if "?" in value else value.split(",")
        if "?" in value and "," in value or not all(_DEP_ITEM.match(i) for i in items):
            raise ValueError(
                f"{value!r} is not a Slurm dependency: write TYPE:JOBID[:JOBID...] with TYPE one of "
                f"{', '.join(SLURM_DEPENDENCY_TYPES)} (or 'singleton'), several joined by ',' (all) or '?' (any), "
                "e.g. afterok:1234"
            )
        return value

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_CONSTRAINT.match(value):
            raise ValueError(f"{value!r} is not a Slurm constraint: feature names joined by & | , with [ ] ( ) *N")
        return value

    @field_validator("nodelist", "exclude")
    @classmethod
    def _hostlist(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_HOSTLIST.match(value):
            raise ValueError(f"{value!r} is not a Slurm host list, e.g. node[1-4],gpu07")
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _extra(cls, value: list[str]) -> list[str]:
        for option in value:
            if not option.startswith("--") or len(option) < 3:
                raise ValueError(f"{option!r}: write each extra sbatch option in its long form, e.g. --mail-type=END")
            problem = sbatch_directive_problem(option)
            if problem:
                raise ValueError(f"{option!r}: {problem}")
            name = option[2:].split("=", 1)[0]
            if name in SBATCH_OWNED:
                raise ValueError(f"{option!r}: ddpkit writes --{name} itself; set {SBATCH_OWNED[name]} instead")
        return value


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
K8S_RESERVED_VOLUMES = frozenset({"dshm"})


class NfsSource(Strict):
    server: str = Field(min_length=1)
    path: str = Field(pattern=r"^/")


class EmptyDirSource(Strict):
    medium: Literal["", "Memory"] = ""
    size_limit: str | None = None

    @field_validator("size_limit")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not K8S_QUANTITY.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity, e.g. 8Gi")
        return value


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


class K8sVolume(Strict):
    """One pod volume and its mount in the training container; exactly one
    source field is set. The same volume is rendered in every kind."""

    name: str
    mount_path: str = Field(description="absolute path in the container")
    read_only: bool = False
    sub_path: str | None = Field(default=None, description="mount only this path inside the volume")
    persistent_volume_claim: str | None = Field(default=None, description="claim name")
    host_path: str | None = Field(default=None, description="absolute path on the node")
    nfs: NfsSource | None = None
    config_map: str | None = Field(default=None, description="ConfigMap name")
    secret: str | None = Field(default=None, description="Secret name")
    empty_dir: EmptyDirSource | None = None

    @model_validator(mode="before")
    @classmethod
    def _kubernetes_spelling(cls, data: Any) -> Any:
        """The pod spec's own spelling (`persistentVolumeClaim: {claimName: x}`,
        `mountPath`, `readOnly`, ...), as a Kubernetes user writes it, means
        the same volume: translated here, one spelling per key."""
        return kubernetes_volume_spelling(data) if isinstance(data, dict) else data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > 63 or not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", value):
            raise ValueError(f"{value!r} is not a volume name (DNS-1123 label)")
        if value in K8S_RESERVED_VOLUMES:
            raise ValueError(f"{value!r} is ddpkit's /dev/shm volume; choose another name")
        return value

    @field_validator("mount_path", "host_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or ":" in value):
            raise ValueError(f"{value!r} must be an absolute path without ':'")
        return value

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        # The API server refuses an absolute subPath or one with '..'.
        if value is not None and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError(f"{value!r} must be a relative path without '..'")
        return value

    @field_validator("persistent_volume_claim", "config_map", "secret")
    @classmethod
    def _object_name(cls, value: str | None) -> str | None:
        if value is not None and not DNS1123_SUBDOMAIN.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes object name (DNS-1123 subdomain)")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> K8sVolume:
        given = [s for s in VOLUME_SOURCES if getattr(self, s) is not None]
        if len(given) != 1:
            raise ValueError(f"volume {self.name!r}: set exactly one of {', '.join(VOLUME_SOURCES)} (got {given or 'none'})")
        if self.mount_path.rstrip("/") == "/dev/shm":
            raise ValueError("/dev/shm is mounted by ddpkit (k8s.shm_size); mount elsewhere")
        return self

    @property
    def source(self) -> VolumeSource:
        return next(s for s in VOLUME_SOURCES if getattr(self, s) is not None)


class RdmaOptions(Strict):
    """An RDMA device resource for NCCL over InfiniBand / RoCE (e.g. the
    k8s-rdma-shared-dev-plugin's rdma/ib); adds IPC_LOCK to the container."""

    resource: str = Field(default="rdma/ib", pattern=r"^[a-z0-9.-]+/[A-Za-z0-9_.-]+$")
    count: int = Field(default=1, ge=1)


class K8sOptions(Strict):
    kind: Literal["pytorchjob", "indexed-job", "trainjob", "jobset"] = "pytorchjob"
    namespace: str = "default"
    shm_size: str = Field(default="8Gi", description="size of the memory-backed /dev/shm")
    cpu: str | None = Field(default=None, description="CPU request and limit per pod, e.g. '8'")
    memory: str | None = Field(default=None, description="memory request and limit per pod, e.g. 64Gi")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    image_pull_secrets: list[str] = Field(default_factory=list)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # Running: when the job ends (one pod failed), the operator deletes the
    # pods still running instead of leaving them in a collective for 30 minutes.
    clean_pod_policy: Literal["None", "Running", "All"] = "Running"
    backoff_limit: int = Field(default=0, ge=0)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    runtime: str = Field(default="torch-distributed", description="TrainJob runtimeRef name")
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
    queue: str | None = Field(default=None, description="Kueue LocalQueue: the job is created suspended and admitted whole")
    scheduler: Literal["default", "volcano"] = Field(default="default", description="volcano: gang-schedule all pods")

    @field_validator("namespace")
    @classmethod
    def _ns(cls, value: str) -> str:
        if len(value) > 63 or not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", value):
            raise ValueError(f"{value!r} is not a Kubernetes namespace (DNS-1123 label)")
        return value

    @field_validator("shm_size", "cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not K8S_QUANTITY.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity, e.g. 8Gi, 500m, 16")
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            if not DNS1123_SUBDOMAIN.match(name):
                raise ValueError(f"{name!r} is not a Kubernetes secret name (DNS-1123 subdomain)")
        return value

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, value: str) -> str:
        if not DNS1123_SUBDOMAIN.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes object name")
        return value

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

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        if value is not None and not DNS1123_SUBDOMAIN.match(value):
            raise ValueError(f"{value!r} is not a Kueue LocalQueue name (DNS-1123 subdomain)")
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


class SshOptions(Strict):
    hosts: list[str] = Field(default_factory=list, description="hosts in node-rank order (or use --hostfile)")
    user: str | None = None
    port: int = Field(default=22, ge=1, le=65535)
    workdir: str | None = Field(default=None, description="directory to cd into on every host")
    docker: bool = Field(default=False, description="run inside `docker run --gpus all --network host --ipc host IMAGE`")
    log_dir: str = Field(default="logs", description="local folder for one log file per node")
    connect_timeout_s: float = Field(default=10.0, gt=0)
    grace_s: float = Field(default=5.0, ge=0, description="SIGTERM to SIGKILL grace period on teardown")
    # As ssh's ServerAliveInterval/ServerAliveCountMax: a host that stops
    # answering (power loss, partition) sends no reset, so without this the
    # launcher and the other ranks would wait for it for good.
    alive_interval_s: float = Field(default=5.0, gt=0, description="seconds between liveness probes of each host")
    alive_count: int = Field(default=3, ge=1, description="unanswered probes after which a host counts as lost")

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        for h in value:
            if not h or any(c.isspace() for c in h) or h.startswith("-"):
                raise ValueError(f"{h!r} is not a host: no whitespace, no leading '-'")
        if len(set(value)) != len(value):
            raise ValueError("a host appears twice; each node needs its own host")
        return value


class ComposeOptions(Strict):
    network: str = Field(default="ddpnet", description="compose network name")
    cpus_per_node: float | None = Field(default=None, gt=0)

    @field_validator("network")
    @classmethod
    def _net(cls, value: str) -> str:
        if not re.match(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$", value):
            raise ValueError(f"{value!r} is not a compose network name")
        return value


# ---- Elastic membership ----------------------------------------------------------

ELASTIC_MAX_RESTARTS = 100


class Elastic(Strict):
    """Keep training when nodes are lost: torchrun's elastic agent with c10d
    rendezvous on node 0, `--nnodes=min_nodes:nodes`. After a membership
    change every agent restarts its workers, which resume from the latest
    checkpoint with the new world size (docs/ELASTIC.md)."""

    min_nodes: int = Field(ge=1, description="the job continues while at least this many nodes remain")
    max_restarts: int = Field(
        default=3, ge=0, le=ELASTIC_MAX_RESTARTS,
        description="worker-group restarts each agent allows (each membership change costs one)")
    keep_global_batch: bool = Field(
        default=False,
        description="false: the global batch shrinks with the world and the lr follows it (linear scaling); "
                    "true: gradient accumulation keeps the global batch of the full job")
    last_call_s: int | None = Field(
        default=None, ge=1, le=3600,
        description="seconds a rendezvous that already has min_nodes waits for more nodes before it closes "
                    "(default: the target's, 30, or 90 on PyTorchJob); every membership change pays it once")
    max_node_failures: int = Field(
        default=2, ge=1, le=100,
        description="launch ssh and launch local: a node that failed this many times is left out for the rest of the run; "
                    "before that, ddpkit restarts its agent once its host answers again and it joins at the "
                    "next rendezvous (1: left out at its first failure, as launch.sh does)")


class WatchdogOptions(Strict):
    """The hang watchdog (docs/WATCHDOG.md): a rank without progress for
    stall_s (never less than 5 x the slowest step) gets every rank's stacks
    dumped and the job stopped with exit 13."""

    enabled: bool = True
    stall_s: float = Field(default=60.0, ge=1, le=86400, description="seconds without progress that count as a stall")
    first_step_s: float | None = Field(
        default=None, ge=1, le=86400,
        description="limit for the first steps and a checkpoint write (default 5 x stall_s)",
    )

    def script_note(self, command: Command) -> str | None:
        """What a launcher says at start-up when the job runs the user's own
        script: ddpkit cannot watch a loop that never reports to it."""
        if not command.script or not self.enabled:
            return None
        return ("stall detection is off unless your script calls ddpkit.watchdog.progress(step) "
                "(docs/WATCHDOG.md); without it a hang lasts until the collective timeout")


# ---- Pre-emption: one grace chain for every target --------------------------

DEFAULT_CHECKPOINT_S = 60


def chain_margin(seconds: int) -> int:
    """The slack one link of the grace chain adds to the link inside it: a
    quarter of the inner time, at least 2 s (process exit, a requeue call), at
    most 15 s (a long checkpoint needs no longer exit)."""
    return max(2, min(15, math.ceil(seconds / 4)))


@dataclass(frozen=True)
class GraceChain:
    """What a stop that asks for a checkpoint may take, inside out:
    checkpoint_s < shutdown_s (torchrun's --shutdown-timeout: the forwarded
    signal to SIGKILL of the workers) < each outer warning (Slurm's
    --signal=B:SIG@N, Kubernetes' terminationGracePeriodSeconds, the
    launchers' grace after Ctrl-C or SIGTERM)."""

    checkpoint_s: int
    shutdown_s: int
    slurm_signal_s: int
    k8s_grace_s: int
    launcher_grace_s: int

    @classmethod
    def from_checkpoint(cls, checkpoint_s: int, slurm: int | None = None, k8s: int | None = None) -> GraceChain:
        shutdown = checkpoint_s + chain_margin(checkpoint_s)
        warning = shutdown + chain_margin(shutdown)
        return cls(checkpoint_s, shutdown, warning if slurm is None else slurm, warning if k8s is None else k8s, warning)

    @property
    def warnings(self) -> dict[str, int]:
        return {"slurm.signal_seconds": self.slurm_signal_s, "k8s.termination_grace_s": self.k8s_grace_s,
                "launcher grace": self.launcher_grace_s}


def checkpoint_within(warning_s: int) -> int | None:
    """The longest checkpoint whose chain fits inside `warning_s` (None: none
    does): what an old spec that set only a scheduler's warning allows."""
    fits = [c for c in range(1, warning_s) if GraceChain.from_checkpoint(c).launcher_grace_s <= warning_s]
    return fits[-1] if fits else None


class Preemption(Strict):
    """How a job stops when its scheduler wants the nodes back: the scheduler
    warns with `signal` (Slurm: before the time limit or a pre-emption;
    Kubernetes and the launchers always send SIGTERM), every rank finishes
    its step, rank 0 writes a checkpoint, and the job exits 75 (requeued
    under Slurm). `checkpoint_s` is the one number to set: the longest time
    from the signal to the checkpoint on disk (two training steps, since the
    ranks agree to stop one step later, plus one save). torchrun's
    --shutdown-timeout and every scheduler's warning are derived from it."""

    # One of the signals `ddpkit train` stops on (wire.TRAINER_STOP_SIGNALS).
    signal: Literal["USR2", "TERM"] = Field(default="USR2", description="Slurm's warning signal (not USR1: NCCL may use it)")
    checkpoint_s: int | None = Field(
        default=None, ge=1, le=3000,
        description=f"seconds from the stop signal to a written checkpoint (default {DEFAULT_CHECKPOINT_S}); "
                    "torchrun's --shutdown-timeout and the schedulers' warnings are derived from it",
    )


def grace_chain(spec: JobSpec) -> GraceChain:
    """The chain the renderers and launchers use. A scheduler warning set in
    an older spec (slurm.signal_seconds, k8s.termination_grace_s) without
    preemption.checkpoint_s sets the checkpoint time that fits inside the
    smallest of them; with checkpoint_s, each must exceed the shutdown timeout."""
    s, k = spec.slurm.signal_seconds, spec.k8s.termination_grace_s
    checkpoint = spec.preemption.checkpoint_s
    if checkpoint is None:
        given = [w for w in (s, k) if w is not None]
        checkpoint = checkpoint_within(min(given)) if given else DEFAULT_CHECKPOINT_S
        if checkpoint is None:
            raise ValueError(f"a scheduler warning of {min(given)} s leaves no time for a checkpoint; "
                             "raise it, or set preemption.checkpoint_s and let ddpkit derive it")
    return GraceChain.from_checkpoint(checkpoint, s, k)


def _chain_problem(spec: JobSpec) -> str | None:
    """One line naming the first link that breaks the chain, with its fix."""
    chain = grace_chain(spec)
    for name, value in chain.warnings.items():
        if value <= chain.shutdown_s:
            return (f"{name}={value} must exceed torchrun's --shutdown-timeout of {chain.shutdown_s} s "
                    f"(preemption.checkpoint_s={chain.checkpoint_s} plus {chain.shutdown_s - chain.checkpoint_s} s) "
                    f"or the workers are killed before their checkpoint is written; raise it (derived: "
                    f"{GraceChain.from_checkpoint(chain.checkpoint_s).launcher_grace_s}), lower "
                    "preemption.checkpoint_s, or remove it to derive it")
    return None


class JobSpec(Strict):
    """One DDP job. world_size = nodes * nproc_per_node."""

    name: str = Field(description="DNS-1035 label: lower case, digits, '-', starts with a letter, max 63")
    image: str = Field(default="ddpkit:latest", description="container image with ddpkit installed")
    nodes: int = Field(default=1, ge=1, le=4096)
    nproc_per_node: int = Field(default=1, ge=1, le=64, description="processes (GPUs) per node")
    device: Literal["cuda", "cpu"] = Field(default="cuda", description="cuda requests GPUs from the scheduler")
    strategy: Literal["ddp", "dp"] = Field(
        default="ddp", description="ddp: one process per device block; dp: one process drives several GPUs"
    )
    devices_per_process: int = Field(
        default=1, ge=1, le=MAX_GPUS_PER_NODE,
        description="GPUs each process owns: K when a model is split over K GPUs, or the GPUs a dp process drives",
    )
    backend: Backend = Backend.AUTO
    rendezvous: Rendezvous = Field(default_factory=Rendezvous)
    master_port: int | None = Field(
        default=None, ge=1024, le=65535, description="fixed port; default: derived per target (Slurm: from the job id)"
    )
    network: Network = Field(default_factory=Network)
    command: Command = Field(default_factory=Command)
    env: dict[str, str] = Field(default_factory=dict)
    slurm: SlurmOptions = Field(default_factory=SlurmOptions)
    k8s: K8sOptions = Field(default_factory=K8sOptions)
    ssh: SshOptions = Field(default_factory=SshOptions)
    compose: ComposeOptions = Field(default_factory=ComposeOptions)
    elastic: Elastic | None = Field(default=None, description="absent: a fixed set of nodes (a lost node ends the job)")
    watchdog: WatchdogOptions = Field(default_factory=WatchdogOptions)
    preemption: Preemption = Field(default_factory=Preemption)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > 63 or not DNS1035.match(value):
            raise ValueError(
                f"{value!r} is not a DNS-1035 label: use lower-case letters, digits and '-', "
                "start with a letter, end with a letter or digit, at most 63 characters"
            )
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value) or value.startswith("-") or not value.isascii():
            raise ValueError(f"{value!r} is not an image reference like registry/repo:tag")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_numbers(cls, value: Any) -> Any:
        """`OMP_NUM_THREADS: 4` is what a user writes: a number becomes its
        text. YAML's true/false/yes/no/on/off and null are not: which text
        was meant is unknowable, so they are refused with the fix."""
        if not isinstance(value, dict):
            return value
        out = {}
        for key, val in value.items():
            if isinstance(val, bool) or val is None:
                raise ValueError(f"{key}: YAML read this as {val!r}, not text (yes/no/on/off/true/false/null); "
                                 f"quote the text you meant, e.g. {key}: \"1\"")
            out[key] = str(val) if isinstance(val, int | float) else val
        return out

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if key in RESERVED_ENV_EXACT or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(
                    f"{key!r} is set by the launcher from the rank contract (nodes, nproc_per_node, "
                    "master_port, network.interface); set those fields instead of the variable"
                )
            _no_nul(val)
        return value

    @model_validator(mode="after")
    def _slurm_image(self) -> JobSpec:
        # The image must be expressible in the runtime's own syntax: refuse
        # here (exit 2) rather than let the nodes fail to pull it.
        runtime = self.slurm.container.runtime
        if runtime != "none":
            try:
                container_image(self.image, runtime)
            except ValueError as exc:
                raise ValueError(f"image with slurm.container.runtime={runtime}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _grace_chain(self) -> JobSpec:
        problem = _chain_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def grace(self) -> GraceChain:
        """The pre-emption grace chain (GraceChain): what each target waits."""
        return grace_chain(self)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @model_validator(mode="after")
    def _elastic(self) -> JobSpec:
        problems = _elastic_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        if self.elastic is not None and self.rendezvous.backend != "c10d":
            # elastic implies c10d (only the default is left to change: an explicit static was refused above)
            self.rendezvous = Rendezvous(backend="c10d", timeout_s=self.rendezvous.timeout_s)
        return self

    @model_validator(mode="after")
    def _device_layout(self) -> JobSpec:
        problems = _layout_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def gpus_per_node(self) -> int:
        """GPUs every target requests per node: processes per node x devices
        per process (wire.device_block says which ones each process owns)."""
        return self.nproc_per_node * self.devices_per_process if self.device == "cuda" else 0

    @property
    def resolved_backend(self) -> str:
        """The backend rendered into launch lines ('auto' follows the device)."""
        if self.backend != Backend.AUTO.value:
            return str(self.backend)
        return "nccl" if self.device == "cuda" else "gloo"


def _elastic_problems(spec: JobSpec) -> list[str]:
    """elastic must leave a node to lose, and it needs c10d rendezvous: an
    explicit `rendezvous.backend: static` is refused rather than overridden."""
    e = spec.elastic
    if e is None:
        return []
    out = []
    if spec.nodes < 2:
        out.append("elastic: a 1-node job has no node to lose; set nodes to 2 or more, or remove elastic")
    elif e.min_nodes > spec.nodes:
        out.append(f"elastic.min_nodes {e.min_nodes} is more than nodes {spec.nodes}; "
                   f"set min_nodes between 1 and {spec.nodes} (nodes is the maximum)")
    if spec.rendezvous.backend == "static" and "backend" in spec.rendezvous.model_fields_set:
        out.append("elastic needs c10d rendezvous (node ranks are assigned anew at each restart); "
                   "remove rendezvous.backend: static (elastic implies c10d) or set it to c10d")
    if e.keep_global_batch and spec.command.module != TRAIN_MODULE:
        out.append(f"elastic.keep_global_batch adjusts {TRAIN_MODULE}'s gradient accumulation; command runs "
                   "another program: set keep_global_batch: false and keep the global batch in your program")
    return out


def _layout_problems(spec: JobSpec) -> list[str]:
    """The device layout must fit one node, and the ddpkit entrypoint's own
    flags must say the same thing as the fields that size the GPU requests
    (otherwise a target would request GPUs the processes never use, or too few)."""
    out = []
    if spec.strategy == "dp" and spec.world_size != 1:
        out.append(f"strategy: dp runs one process, but nodes x nproc_per_node is {spec.world_size}; "
                   "set nodes: 1 and nproc_per_node: 1, or use strategy: ddp")
    if spec.nproc_per_node * spec.devices_per_process > MAX_GPUS_PER_NODE:
        out.append(f"nproc_per_node {spec.nproc_per_node} x devices_per_process {spec.devices_per_process} "
                   f"needs more than {MAX_GPUS_PER_NODE} GPUs per node; lower one of them")
    if spec.command.module != TRAIN_MODULE:
        return out  # another program's flags are its own business
    args = spec.command.args
    strategy = flag_value(args, STRATEGY_FLAG) or "ddp"
    if strategy != spec.strategy:
        out.append(f"command.args runs --strategy {strategy} but strategy is {spec.strategy}; "
                   f"set strategy: {strategy} (it sizes every GPU request)")
    dpp = flag_value(args, DEVICES_PER_PROCESS_FLAG)
    if spec.strategy == "ddp" and str(spec.devices_per_process) != (dpp or "1"):
        out.append(f"command.args has --devices-per-process {dpp or 1} but devices_per_process is "
                   f"{spec.devices_per_process}; make them equal (the field sizes every GPU request)")
    return out


def load_yaml(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of job fields")
    return data
