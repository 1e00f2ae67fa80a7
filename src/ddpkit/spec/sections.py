"""The sections every target shares: the backend, rendezvous, network,
command, elastic membership, the hang watchdog and the preamble of a
program of the user's own. Each target's own options are a module beside
this one; JobSpec (job.py) holds them all.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..shared.agreed import LOSS_FLOOR_S, LOSS_S, PREAMBLE_PARTS, STRAGGLER_FACTOR, TRAIN_MODULE
from .fields import IFNAME, Argv, NodePath, PythonModule, Strict

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
    workdir: NodePath | None = Field(
        default=None, description="the directory every process starts in, on the nodes / in the container: made "
                                  "if missing, by the job's user; relative paths in args are relative to it "
                                  "(default: where the target starts them)")

    @model_validator(mode="after")
    def _one_of(self) -> Command:
        if self.module and self.script:
            raise ValueError("set either command.module or command.script, not both")
        if self.module is None and self.script is None:
            self.module = TRAIN_MODULE
        if self.workdir is not None and not str(self.workdir).startswith("/"):
            # Relative to what would differ by target (a home, a submit folder, an image's WORKDIR).
            raise ValueError(f"command.workdir {self.workdir!r} is not an absolute path; write it as the nodes "
                             "(or the container) see it, e.g. /scratch/my-job")
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
    checkpoint with the new world size (docs/guides/elastic.md)."""

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
                    "(default: half of watchdog.loss_s, at least 3, or 90 on PyTorchJob); a first rendezvous "
                    "without every node waits the longer of it and first_round_s, a re-formation after a loss "
                    "only where ddpkit's rendezvous cannot tell who will come")
    first_round_s: int | None = Field(
        default=None, ge=0, le=86400,
        description="ddpkit's rendezvous: seconds the first rendezvous, once min_nodes are in, waits for the "
                    "job's other nodes still starting, so that a slow start costs no restart (default 120; "
                    "never past rendezvous.timeout_s; 0: the last call alone, as torch's c10d); a node later "
                    "than that joins at the next membership change; it also bounds how long a node waiting for "
                    "a round may miss keep-alives before the others drop it (30 s at most)")
    rendezvous: Literal["ddpkit", "torchrun"] = Field(
        default="ddpkit",
        description="ddpkit: torch's c10d rendezvous with ddpkit's rule (the round after a loss starts once every "
                    "node that left the last one is back, without the last call; nodes that run a job's own "
                    "command get plain c10d), a keep-alive from the node count, a longer expiry for nodes waiting "
                    "for a round and a back-off after a failed write of the state; torchrun: plain c10d with "
                    "torchrun's own keep-alive (5 s x 3) and last call (30 s), as a baseline")
    max_node_failures: int = Field(
        default=2, ge=1, le=100,
        description="launch ssh and launch local: a node that failed this many times is left out for the rest of the run; "
                    "before that, ddpkit restarts its agent once its host answers again and it joins at the "
                    "next rendezvous (1: left out at its first failure, as launch.sh does)")


class WatchdogOptions(Strict):
    """The hang watchdog (docs/guides/hangs.md): a rank without progress for
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
                    "derives from it, and it caps the keep-alive (docs/guides/elastic.md)")

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
                "ddpkit.watchdog.progress(step) is watched (docs/guides/hangs.md); without it a hang lasts "
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
    stragglers: bool = Field(default=True, description="each rank's own work per optimizer step (its DDP model's "
                                                       "forward and backward) timed for the straggler judge "
                                                       "(watchdog.straggler_factor)")
    stop: bool = Field(default=True, description="a stop signal runs the program's stop handlers (ddpkit.on_stop, "
                                                 "ddpkit.frameworks' callbacks) at one optimizer step on every rank")

    def off(self) -> list[str]:
        """The parts turned off, as DDPKIT_PREAMBLE names them."""
        return [part for part in PREAMBLE_PARTS if not getattr(self, part)]
