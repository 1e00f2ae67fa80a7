"""The job core: JobSpec and the sections every target shares (rendezvous,
network, command, elastic membership, the hang watchdog), with the checks
that span sections. Each target's own options are a module beside this one.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .. import envnames
from ..wire import (
    DEVICES_PER_PROCESS_FLAG,
    LOSS_FLOOR_S,
    LOSS_S,
    PREAMBLE_PARTS,
    STRAGGLER_FACTOR,
    STRATEGY_FLAG,
    TRAIN_MODULE,
    flag_value,
)
from .compose import ComposeOptions
from .fields import ENV_NAME, IFNAME, Argv, ImageRef, JobName, Mounts, NodePath, PythonModule, Strict, no_nul
from .grace import GraceChain, Preemption, chain_problem, grace_chain
from .image import container_image
from .k8s import K8sOptions
from .resources import Resources, move_old_spellings
from .secrets import Secret, SecretEntry, duplicate_names
from .slurm import SlurmOptions
from .ssh import SshOptions

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
# ddpkit's variables that are the user's to set in env: (the agent's worker start), not the launcher's.
USER_DDPKIT_ENV = frozenset({envnames.DDPKIT_AGENT_FORK, envnames.DDPKIT_AGENT_PRELOAD})
# Settings ddpkit's job environment writes (contract.target_env) unless env:
# sets them: a secret of that name would be a second, hidden value for it.
JOB_ENV_SETTINGS = frozenset(
    {
        envnames.PYTHONUNBUFFERED,
        envnames.OMP_NUM_THREADS,
        envnames.TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
        envnames.TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
        envnames.TORCH_NCCL_TRACE_BUFFER_SIZE,
        envnames.TORCH_NCCL_DUMP_ON_TIMEOUT,
        envnames.TORCH_FR_DUMP_TEMP_FILE,
    }
)

MAX_GPUS_PER_NODE = 64


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

    module: PythonModule | None = Field(default=None, description="python module run with -m (default ddpkit.train)")
    script: NodePath | None = Field(default=None, description="path of a python script, as seen on the nodes")
    args: Argv = Field(default_factory=list, description="arguments after the module or script")
    python: NodePath = Field(default="python3", description="interpreter on the nodes / in the image")

    @model_validator(mode="after")
    def _one_of(self) -> Command:
        if self.module and self.script:
            raise ValueError("set either command.module or command.script, not both")
        if self.module is None and self.script is None:
            self.module = TRAIN_MODULE
        return self

    def argv(self) -> list[str]:
        """The program part of the launch line: ['-m', mod, *args] or [script, *args]."""
        if self.module:
            return ["-m", self.module, *self.args]
        return [str(self.script), *self.args]


# ---- Elastic membership and the hang watchdog ------------------------------------

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
                    "(default: half of watchdog.loss_s, at least 3, or 90 on PyTorchJob); the first rendezvous "
                    "pays it, a re-formation after a loss only where ddpkit's rendezvous cannot tell who will come")
    rendezvous: Literal["ddpkit", "torchrun"] = Field(
        default="ddpkit",
        description="ddpkit: torch's c10d rendezvous with ddpkit's rule (the round after a loss starts once every "
                    "node that left the last one is back, without the last call; nodes that run a job's own "
                    "command get plain c10d) and a keep-alive from the node count; torchrun: plain c10d with "
                    "torchrun's own keep-alive (5 s x 3) and last call (30 s), as a baseline")
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
    straggler_factor: float = Field(
        default=STRAGGLER_FACTOR, ge=0, le=100,
        description="a rank whose own work per step (data, forward, backward compute; not waiting) is more than "
                    "this many times the job's median is named a straggler (0: off)")

    loss_s: float = Field(
        default=LOSS_S, ge=LOSS_FLOOR_S, le=3600,
        description="seconds a node's ranks may send no heartbeat before the others act on it: an elastic job "
                    "re-forms without it, a static job stops naming it (exit 14); the rendezvous' last call "
                    "derives from it, and it caps the keep-alive (docs/ELASTIC.md)")

    @field_validator("straggler_factor")
    @classmethod
    def _factor_above_one(cls, value: float) -> float:
        if 0 < value <= 1:
            raise ValueError("give a factor above 1 (e.g. 1.33): at or below 1 half the job would be stragglers; "
                             "0 turns straggler detection off")
        return value

    def script_note(self, command: Command, progress_reported: bool) -> str | None:
        """What a launcher says at start-up when the job runs the user's own
        script with the preamble's progress turned off (which reports every
        optimizer step for it)."""
        if not command.script or not self.enabled or progress_reported:
            return None
        return ("stall detection is off: preamble.progress is false, so only a script that calls "
                "ddpkit.watchdog.progress(step) is watched (docs/WATCHDOG.md); without it a hang lasts "
                "until the collective timeout")


class Preamble(Strict):
    """What a program of the user's own gets before its first line
    (ddpkit/preamble; ddpkit's own trainer does all of it itself). Each part
    is on unless turned off here."""

    interface: bool = Field(default=True, description="network.interface set as NCCL/GLOO_SOCKET_IFNAME")
    rank_report: bool = Field(default=True, description="the rank table and checks after init_process_group")
    progress: bool = Field(default=True, description="optimizer steps, torch.save and the main thread's calls "
                                                     "reported to the hang watchdog")
    metrics: bool = Field(default=True, description="step times, samples/s and the loss as metrics records, "
                                                    "where the launcher names a file (ddpkit report)")
    stop: bool = Field(default=True, description="a stop signal runs the program's stop handlers (ddpkit.on_stop, "
                                                 "ddpkit.frameworks' callbacks) at one optimizer step on every rank")

    def off(self) -> list[str]:
        """The parts turned off, as DDPKIT_PREAMBLE names them."""
        return [part for part in PREAMBLE_PARTS if not getattr(self, part)]


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
            if key in RESERVED_ENV_EXACT or (key.startswith(RESERVED_ENV_PREFIXES) and key not in USER_DDPKIT_ENV):
                raise ValueError(
                    f"{key!r} is set by the launcher from the rank contract (nodes, nproc_per_node, "
                    "master_port, network.interface); set those fields instead of the variable"
                )
            no_nul(val)
        return value

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, value: list[Secret]) -> list[Secret]:
        twice = duplicate_names(value)
        if twice:
            raise ValueError(f"{twice} listed twice; list each secret once")
        for s in value:
            if s.name in RESERVED_ENV_EXACT or s.name.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"{s.name!r} is set by the launcher from the rank contract; a secret needs a "
                                 "name of its own")
            if s.name in JOB_ENV_SETTINGS:
                raise ValueError(f"{s.name!r} is a setting of ddpkit's job environment, not a secret; set it "
                                 "in env:")
        return value

    @model_validator(mode="after")
    def _secrets_apart_from_env(self) -> JobSpec:
        both = sorted({s.name for s in self.secrets} & set(self.env))
        if both:
            raise ValueError(f"secrets: {both} also set in env:, where the value is written in plain text; "
                             "remove them from env:")
        problem = _export_problem(self)
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
        problems = _elastic_problems(self)
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


def _export_problem(spec: JobSpec) -> str | None:
    """A secret reaches a Slurm job through sbatch's export of the submitting
    environment: an --export in extra_sbatch that leaves it out would start
    the job without it."""
    names = spec.secret_names
    exports = [o.partition("=")[2] for o in spec.slurm.extra_sbatch if o.startswith("--export=")]
    if not names or not exports:
        return None
    items = {item.partition("=")[0] for item in exports[-1].split(",")}  # sbatch keeps the last
    missing = [n for n in names if n not in items]
    if "ALL" in items or not missing:
        return None
    kept = [item for item in exports[-1].split(",") if item not in ("NONE", "NIL", "")]  # neither takes names
    return (f"slurm.extra_sbatch --export={exports[-1]} keeps secrets {missing} from the job; "
            f"add them to the list (--export={','.join([*kept, *missing])}) or remove --export")


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
        out.append(f"command.args has {DEVICES_PER_PROCESS_FLAG} {dpp or 1} but devices_per_process is "
                   f"{spec.devices_per_process}; make them equal (the field sizes every GPU request)")
    return out
