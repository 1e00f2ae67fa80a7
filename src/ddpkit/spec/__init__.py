"""JobSpec: the one validated description of a DDP job.

Every target (Slurm, Kubernetes, SSH, compose) renders from this model and
nothing else, so a value is checked once, here, before any file is written.
Reading it from YAML, `--set` and CLI flags is specfile's job.

The package, by concern:
  job.py      JobSpec: every section, and the validators that tie them together
  sections.py the sections every target shares (rendezvous, network, command, elastic, watchdog, preamble)
  environment.py  env: and secrets: against the variables the launchers own
  consistency.py  the checks that span sections (elastic membership, device layout, a Slurm --export)
  fields.py   the base model and the annotated field types (SlurmTime, K8sQuantity, DNS names, ...)
  slurm.py, k8s.py, ssh.py, compose.py   one module per target's options
  secrets.py  secrets: (values written nowhere) and the token-shaped env: warning
  grace.py    the pre-emption grace chain
  image.py    an image in each Slurm container runtime's syntax
  resources.py  resources: (CPUs, memory, /dev/shm) in one spelling every target maps
  doctor_mode.py  the job with `ddpkit doctor` as its command (render/launch --doctor)

Every name other modules use is imported from here (`from ddpkit.spec import
JobSpec`), never from a submodule, so the files can move again.
"""

from ..shared.agreed import TRAIN_MODULE
from .compose import ComposeNetworkName, ComposeOptions
from .doctor_mode import DOCTOR_MODULE, doctor_mode
from .environment import JOB_ENV_SETTINGS, RESERVED_ENV_EXACT, RESERVED_ENV_PREFIXES
from .fields import (
    DNS1035,
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    ENV_NAME,
    IFNAME,
    K8S_QUANTITY,
    MODULE_NAME,
    SLURM_MEM,
    SLURM_TIME,
    SLURM_WORD,
    ImageRef,
    JobName,
    K8sNamespace,
    K8sObjectName,
    K8sQuantity,
    K8sSize,
    NodePath,
    PythonModule,
    SlurmMem,
    SlurmTime,
    SlurmWord,
    Strict,
)
from .grace import (
    DEFAULT_CHECKPOINT_S,
    GraceChain,
    Preemption,
    chain_margin,
    chain_problem,
    checkpoint_within,
    grace_chain,
)
from .image import (
    APPTAINER_SCHEME,
    DOCKER_HUB_HOSTS,
    ENROOT_SCHEMES,
    ENROOT_URI,
    SQUASHFS_SUFFIXES,
    apptainer_image,
    container_image,
    enroot_image,
)
from .job import JobSpec
from .k8s import (
    K8S_RESERVED_VOLUMES,
    VOLCANO_GROUP_ANNOTATION,
    VOLUME_SOURCES,
    EmptyDirSource,
    K8sOptions,
    K8sVolume,
    NfsSource,
    RdmaOptions,
    Toleration,
    VolumeSource,
    kubernetes_volume_spelling,
)
from .resources import Resources, deprecation_notes, docker_size, slurm_size
from .secrets import K8sSecretRef, Secret, env_warnings, token_like_env
from .sections import (
    ELASTIC_MAX_RESTARTS,
    MAX_GPUS_PER_NODE,
    Backend,
    Command,
    Elastic,
    Network,
    Rendezvous,
    WatchdogOptions,
)
from .slurm import (
    SBATCH_OWNED,
    SLURM_CONSTRAINT,
    SLURM_DEPENDENCY_TYPES,
    SLURM_HOSTLIST,
    SlurmConstraint,
    SlurmContainer,
    SlurmDependency,
    SlurmHostList,
    SlurmOptions,
    sbatch_directive_problem,
)
from .ssh import SshOptions

__all__ = [
    "APPTAINER_SCHEME", "DEFAULT_CHECKPOINT_S", "DNS1035", "DNS1123_LABEL", "DNS1123_SUBDOMAIN", "DOCKER_HUB_HOSTS",
    "ELASTIC_MAX_RESTARTS", "ENROOT_SCHEMES", "ENROOT_URI", "ENV_NAME", "IFNAME", "JOB_ENV_SETTINGS", "K8S_QUANTITY",
    "K8S_RESERVED_VOLUMES", "MAX_GPUS_PER_NODE", "MODULE_NAME", "RESERVED_ENV_EXACT", "RESERVED_ENV_PREFIXES",
    "SBATCH_OWNED", "SLURM_CONSTRAINT", "SLURM_DEPENDENCY_TYPES", "SLURM_HOSTLIST", "SLURM_MEM", "SLURM_TIME",
    "SLURM_WORD", "SQUASHFS_SUFFIXES", "TRAIN_MODULE", "VOLCANO_GROUP_ANNOTATION", "VOLUME_SOURCES", "Backend",
    "Command", "ComposeNetworkName", "ComposeOptions", "Elastic", "EmptyDirSource", "GraceChain", "ImageRef",
    "JobName", "JobSpec", "K8sNamespace", "K8sObjectName", "K8sOptions", "K8sQuantity", "K8sSecretRef", "K8sSize",
    "K8sVolume", "Network", "NfsSource", "NodePath", "Preemption", "PythonModule", "RdmaOptions", "Rendezvous",
    "Secret", "SlurmConstraint", "SlurmContainer", "SlurmDependency", "SlurmHostList", "SlurmMem", "SlurmOptions",
    "SlurmTime", "SlurmWord", "SshOptions", "Strict", "Toleration", "VolumeSource", "WatchdogOptions",
    "apptainer_image", "chain_margin", "chain_problem", "checkpoint_within", "container_image", "enroot_image",
    "env_warnings", "grace_chain", "kubernetes_volume_spelling", "sbatch_directive_problem", "token_like_env"
]
__all__ += ["DOCTOR_MODULE", "doctor_mode", "Resources", "deprecation_notes", "docker_size", "slurm_size"]
