"""JobSpec: the job core, holding the sections every target shares
(sections.py) and each target's own options, with the validators that tie
them together (the rules: environment.py, consistency.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ..shared.agreed import DEVICES_PER_PROCESS_FLAG, TRAIN_MODULE, flag_value
from .compose import ComposeOptions
from .consistency import elastic_problems, export_problem, layout_problems
from .environment import checked_env, checked_secrets, env_numbers
from .fields import ImageRef, JobName, Mounts, Strict
from .grace import GraceChain, Preemption, chain_problem, grace_chain
from .image import container_image
from .k8s import K8sOptions
from .resources import Resources, move_old_spellings
from .secrets import Secret, SecretEntry
from .sections import (
    MAX_GPUS_PER_NODE,
    Backend,
    Command,
    Elastic,
    Network,
    Preamble,
    Rendezvous,
    WatchdogOptions,
)
from .slurm import SlurmOptions
from .ssh import SshOptions

DEFAULT_NAME = "ddp-job"  # a job spec without a name: the schema says so, not only the CLI
# The tags docker/build.sh gives the images it builds.
CUDA_IMAGE, CPU_IMAGE = "ddpkit:cuda", "ddpkit:cpu"


class JobSpec(Strict):
    """One DDP job. world_size = nodes * nproc_per_node."""

    name: JobName = Field(default=DEFAULT_NAME, description=(
        "DNS-1035 label: lower case, digits, '-', starts with a letter, max 63; it names the Slurm job, the "
        f"Kubernetes objects and the rendered files (default {DEFAULT_NAME})"))
    image: ImageRef = Field(default=CUDA_IMAGE, description="container image with ddpkit installed (default: "
                            f"{CUDA_IMAGE}, or {CPU_IMAGE} for device: cpu, the tags `make image` / `make image-cpu` build)")
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
    secrets: list[SecretEntry] = Field(
        default_factory=list,
        description="variables every rank gets whose values are written nowhere: from the submitting or launching "
                    "environment (Slurm, SSH, compose, launch), or a Kubernetes Secret (each entry's k8s, or "
                    "k8s.secret)")
    slurm: SlurmOptions = Field(default_factory=SlurmOptions)
    k8s: K8sOptions = Field(default_factory=K8sOptions)
    ssh: SshOptions = Field(default_factory=SshOptions)
    mounts: Mounts = Field(default_factory=list, description=(
        "'SRC:DST[:ro]' host folders (or Docker volumes) the job's containers see at DST, both absolute: "
        "compose, launch docker, ssh.docker and Slurm's container runtimes bind them; Kubernetes needs a "
        "k8s.volumes entry at each DST; targets without a container accept only SRC equal to DST"))
    compose: ComposeOptions = Field(default_factory=ComposeOptions)
    resources: Resources = Field(default_factory=Resources, description=(
        "CPUs per process, memory and /dev/shm per node, mapped by every target (GPUs: the device rule)"))
    elastic: Elastic | None = Field(default=None, description="absent: a fixed set of nodes (a lost node ends the job)")
    watchdog: WatchdogOptions = Field(default_factory=WatchdogOptions)
    preamble: Preamble = Field(default_factory=Preamble)
    preemption: Preemption = Field(default_factory=Preemption)

    @model_validator(mode="before")
    @classmethod
    def _image_for_the_device(cls, data: Any) -> Any:
        """No image given: the one `make image` (CUDA) or `make image-cpu` builds, by the device."""
        if isinstance(data, dict) and "image" not in data:
            return {**data, "image": CPU_IMAGE if data.get("device") == "cpu" else CUDA_IMAGE}
        return data

    @field_validator("env", mode="before")
    @classmethod
    def _env_numbers(cls, value: Any) -> Any:
        return env_numbers(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return checked_env(value)

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, value: list[Secret]) -> list[Secret]:
        return checked_secrets(value)

    @model_validator(mode="after")
    def _secrets_apart_from_env(self) -> JobSpec:
        both = sorted({s.name for s in self.secrets} & set(self.env))
        if both:
            raise ValueError(f"secrets: {both} also set in env:, where the value is written in plain text; "
                             "remove them from env:")
        problem = export_problem(self.secret_names, self.slurm.extra_sbatch)
        if problem:
            raise ValueError(problem)
        return self

    _deprecations: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _resources(self) -> JobSpec:
        self._deprecations = move_old_spellings(self) or self._deprecations  # targets read spec.resources only
        return self

    @property
    def deprecations(self) -> list[str]:
        """A note for each old spelling the input used (printed by specfile.warn_env)."""
        return list(self._deprecations)

    @property
    def secret_names(self) -> list[str]:
        return [s.name for s in self.secrets]

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
        problem = chain_problem(self.grace)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def grace(self) -> GraceChain:
        """The pre-emption grace chain (GraceChain): what each target waits."""
        return grace_chain(self.preemption.checkpoint_s, self.slurm.signal_seconds, self.k8s.termination_grace_s)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @model_validator(mode="after")
    def _elastic(self) -> JobSpec:
        problems = elastic_problems(self.elastic, self.nodes, self.rendezvous, self.command)
        if problems:
            raise ValueError("; ".join(problems))
        if self.elastic is not None and self.rendezvous.backend != "c10d":
            # elastic implies c10d (only the default is left to change: an explicit static was refused above)
            self.rendezvous = Rendezvous(backend="c10d", timeout_s=self.rendezvous.timeout_s)
        return self

    @model_validator(mode="after")
    def _device_layout(self) -> JobSpec:
        args = self.command.args
        if (self.command.module == TRAIN_MODULE and self.strategy == "ddp" and self.devices_per_process > 1
                and flag_value(args, DEVICES_PER_PROCESS_FLAG) is None):
            # The field sizes every GPU request; the trainer reads the same
            # number from its flag, so the spec says it once.
            self.command.args = [*args, DEVICES_PER_PROCESS_FLAG, str(self.devices_per_process)]
        problems = layout_problems(self.strategy, self.nodes, self.nproc_per_node, self.devices_per_process,
                                   self.command)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def gpus_per_node(self) -> int:
        """GPUs every target requests per node: processes per node x devices
        per process (agreed.device_block says which ones each process owns)."""
        return self.nproc_per_node * self.devices_per_process if self.device == "cuda" else 0

    @property
    def resolved_backend(self) -> str:
        """The backend rendered into launch lines ('auto' follows the device)."""
        if self.backend != Backend.AUTO.value:
            return str(self.backend)
        return "nccl" if self.device == "cuda" else "gloo"
