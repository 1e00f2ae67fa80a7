"""How was this process started? Pure functions over the environment.

Every launcher tells a process its place in the job through different
variables (docs/CONTRACT.md, "The rank contract"). `detect_launch` reads them, in
order of precedence, and returns one LaunchInfo. No torch, no process group:
`ddpkit env` uses this alone, and it is tested with fake environments.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...host import scontrol
from ...shared import envnames as E
from ...shared.agreed import DEFAULT_PORT, slurm_port_for_job
from ..config.values import Options

HostlistExpander = Callable[[str], list[str]]


class StartupError(ValueError):
    """The launch environment is inconsistent or incomplete. Exit 2."""


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # torchrun | slurm | mpi | pytorchjob | spawn | manual | single
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int | None  # None: not told (manual); derived from hosts after init
    master_addr: str | None
    master_port: int | None
    init_method: str  # env:// for launchers; tcp://, file:// for manual

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise StartupError(f"rank {self.rank} is outside 0..{self.world_size - 1} (world size {self.world_size})")
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise StartupError(f"local rank {self.local_rank} is outside 0..{self.local_world_size - 1}")


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise StartupError(f"{name}={raw!r} is not an integer; the launcher must set it to a number") from None


def _opt_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if name in env:
            return _int(env, name)
    return None


def _port(env: Mapping[str, str], default: int | None) -> int | None:
    return _int(env, E.MASTER_PORT) if E.MASTER_PORT in env else default


def _torchrun(env: Mapping[str, str]) -> LaunchInfo:
    """torchrun sets RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/GROUP_RANK and
    MASTER_ADDR/PORT in each worker. Under Kubeflow, PET_NODE_RANK is the node."""
    local_world = _opt_int(env, E.LOCAL_WORLD_SIZE) or 1
    rank = _int(env, E.RANK)
    node_rank = _opt_int(env, E.GROUP_RANK, E.PET_NODE_RANK)
    return LaunchInfo(
        launcher="torchrun",
        rank=rank,
        local_rank=_int(env, E.LOCAL_RANK),
        world_size=_int(env, E.WORLD_SIZE),
        local_world_size=local_world,
        node_rank=node_rank if node_rank is not None else rank // local_world,
        master_addr=env.get(E.MASTER_ADDR),
        master_port=_port(env, None),
        init_method="env://",
    )


def expand_hostlist(nodelist: str) -> list[str]:
    """`scontrol show hostnames` when Slurm's tools are here, else a parser for
    the common forms (node[01-03,7],gpu5)."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True).stdout
        return scontrol.hostnames(out)
    return parse_hostlist(nodelist)


def parse_hostlist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, e.g. node[01-03,7],gpu5 (one bracket level)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM_TASKS_PER_NODE looks like '2(x3),1': expand and pick this node."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise StartupError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not in Slurm's 'N(xM),...' form")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else counts[-1]


def slurm_task(env: Mapping[str, str], expand: HostlistExpander = expand_hostlist) -> LaunchInfo:
    """One srun task per process (GPU): SLURM_PROCID is the rank."""
    node_id = _opt_int(env, E.SLURM_NODEID) or 0
    if E.SLURM_NTASKS_PER_NODE in env:
        local_world = _int(env, E.SLURM_NTASKS_PER_NODE)
    elif E.SLURM_TASKS_PER_NODE in env:
        local_world = _tasks_on_node(env[E.SLURM_TASKS_PER_NODE], node_id)
    else:
        local_world = 1
    master = env.get(E.MASTER_ADDR)
    if master is None:
        nodelist = env.get(E.SLURM_JOB_NODELIST) or env.get(E.SLURM_NODELIST)
        if not nodelist:
            raise StartupError("under srun but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; export MASTER_ADDR")
        master = expand(nodelist)[0]
    default_port = slurm_port_for_job(_int(env, E.SLURM_JOB_ID)) if E.SLURM_JOB_ID in env else DEFAULT_PORT
    return LaunchInfo(
        launcher="slurm",
        rank=_int(env, E.SLURM_PROCID),
        local_rank=_opt_int(env, E.SLURM_LOCALID) or 0,
        world_size=_int(env, E.SLURM_NTASKS),
        local_world_size=local_world,
        node_rank=node_id,
        master_addr=master,
        master_port=_port(env, default_port),
        init_method="env://",
    )


def _mpi(env: Mapping[str, str], backend: str) -> LaunchInfo:
    """Open MPI's mpirun. The mpi backend needs no master; the others need
    MASTER_ADDR passed through (mpirun -x MASTER_ADDR=host)."""
    master = env.get(E.MASTER_ADDR)
    if master is None and backend != "mpi":
        raise StartupError(
            "started by mpirun with a TCP backend but MASTER_ADDR is not set; "
            "pass it with `mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500`, or use --backend mpi"
        )
    return LaunchInfo(
        launcher="mpi",
        rank=_int(env, E.OMPI_COMM_WORLD_RANK),
        local_rank=_opt_int(env, E.OMPI_COMM_WORLD_LOCAL_RANK) or 0,
        world_size=_int(env, E.OMPI_COMM_WORLD_SIZE),
        local_world_size=_opt_int(env, E.OMPI_COMM_WORLD_LOCAL_SIZE) or 1,
        node_rank=_opt_int(env, E.OMPI_COMM_WORLD_NODE_RANK) or 0,
        master_addr=master,
        master_port=_port(env, DEFAULT_PORT),
        init_method="env://",
    )


def _pytorchjob(env: Mapping[str, str]) -> LaunchInfo:
    """A Kubeflow PyTorchJob pod running the entrypoint directly (no
    torchrun): one process per pod, RANK is the pod index."""
    nproc = _opt_int(env, E.PET_NPROC_PER_NODE) or 1
    if nproc > 1:
        raise StartupError(
            f"PET_NPROC_PER_NODE={nproc} but this pod runs one process without torchrun; "
            "start the container with torchrun, or set nprocPerNode: 1"
        )
    rank = _int(env, E.RANK)
    return LaunchInfo(
        launcher="pytorchjob",
        rank=rank,
        local_rank=0,
        world_size=_int(env, E.WORLD_SIZE),
        local_world_size=1,
        node_rank=rank,
        master_addr=env[E.MASTER_ADDR],
        master_port=_port(env, DEFAULT_PORT),
        init_method="env://",
    )


def _manual(env: Mapping[str, str], args: Options) -> LaunchInfo:
    """--init-method with --rank/--world-size (or RANK/WORLD_SIZE for env://)."""
    method = args.init_method or "env://"
    if not method.startswith(("tcp://", "file://", "env://")):
        raise StartupError(f"--init-method {method!r}: use tcp://HOST:PORT, file:///PATH or env://")
    rank = args.rank if args.rank is not None else _opt_int(env, E.RANK)
    world = args.world_size if args.world_size is not None else _opt_int(env, E.WORLD_SIZE)
    if rank is None or world is None:
        raise StartupError(f"--init-method {method} needs --rank R and --world-size W (or RANK and WORLD_SIZE)")
    addr, port = env.get(E.MASTER_ADDR), _port(env, None)
    if method.startswith("tcp://"):
        m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", method)
        if not m:
            raise StartupError(f"--init-method {method!r}: write tcp://HOST:PORT")
        addr, port = m.group(1), int(m.group(2))
    elif method.startswith("env://") and (addr is None or port is None):
        raise StartupError("--init-method env:// needs MASTER_ADDR and MASTER_PORT in the environment")
    local_rank = _opt_int(env, E.LOCAL_RANK)
    return LaunchInfo(
        launcher="manual",
        rank=rank,
        local_rank=local_rank or 0,
        world_size=world,
        local_world_size=_opt_int(env, E.LOCAL_WORLD_SIZE) or (local_rank or 0) + 1,
        node_rank=_opt_int(env, E.DDPKIT_NODE_RANK, E.NODE_RANK, E.GROUP_RANK),
        master_addr=addr,
        master_port=port,
        init_method=method,
    )


def _single() -> LaunchInfo:
    return LaunchInfo("single", 0, 0, 1, 1, 0, None, None, "env://")


def in_srun_step(env: Mapping[str, str]) -> bool:
    """A task of an srun step, not the batch script (whose SLURM_NTASKS describes tasks it never started)."""
    return E.SLURM_PROCID in env and E.SLURM_NTASKS in env and (E.SLURM_STEP_ID in env or E.SLURM_STEPID in env)


def detect_launch(env: Mapping[str, str], args: Options,
                  expand: HostlistExpander = expand_hostlist) -> LaunchInfo:
    """Precedence: explicit flags, then torchrun (it may run under Slurm, MPI
    or a PyTorchJob pod, and its variables are the most specific), then the
    per-process launchers, then one process alone."""
    if args.init_method or args.rank is not None or args.world_size is not None:
        return _manual(env, args)
    if E.LOCAL_RANK in env and E.RANK in env and E.WORLD_SIZE in env:
        return _torchrun(env)
    if in_srun_step(env):
        return slurm_task(env, expand)
    if E.OMPI_COMM_WORLD_RANK in env:
        return _mpi(env, getattr(args, "backend", "auto"))
    if E.RANK in env and E.WORLD_SIZE in env and E.MASTER_ADDR in env:
        if E.PET_NNODES in env or E.PET_NODE_RANK in env:
            return _pytorchjob(env)
        return _manual(env, args)
    return _single()


@dataclass(frozen=True)
class AgentRestarts:
    """How often the elastic agent restarted this set of workers, and its cap (torchrun's variables)."""

    restart: int  # 0: the first set of workers; n: after the n-th restart
    max_restarts: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentRestarts | None:
        """None when no elastic agent started this process (max restarts 0, or no torchrun)."""
        env = os.environ if env is None else env
        try:
            max_restarts = int(env.get(E.TORCHELASTIC_MAX_RESTARTS, "0"))
            restart = int(env.get(E.TORCHELASTIC_RESTART_COUNT, "0"))
        except ValueError:
            return None
        return cls(restart, max_restarts) if max_restarts > 0 else None
