"""What the cluster can run, read before `sbatch`, so a job that can never
start is refused with the numbers and the fix instead of pending forever.

The facts come from `scontrol show partition -o` and `scontrol show node -o`
(one record a line, `Key=Value` fields), which every Slurm since 2.x prints
the same way and which need no accounting database. `ddpkit render slurm`
never calls this: rendering stays offline.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...host.scontrol import fields
from ...spec import JobSpec
from ...targets.slurm import cpus_per_task, tasks_per_node
from ...targets.slurm import mem as slurm_mem

Runner = Callable[[list[str]], str]

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")
UNLIMITED = ("INFINITE", "UNLIMITED")


def slurm_seconds(text: str) -> int | None:
    """Slurm's time syntax (`--time`, MaxTime) in seconds; None for no limit.

    Forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1), --time)."""
    if text.upper() in UNLIMITED:
        return None
    m = _TIME.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a Slurm time")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-H[:M[:S]]
        return days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a or 0) * 3600 + (b or 0) * 60 + c
    if b is not None:  # M:S
        return (a or 0) * 60 + b
    return (a or 0) * 60  # M


def megabytes(text: str) -> int:
    """`--mem` syntax (default unit M) in MiB, as RealMemory is written."""
    m = _MEM.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a Slurm memory size")
    scale = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2).upper()]
    return int(int(m.group(1)) * scale)


def gpu_count(gres: str) -> int:
    """GPUs in a node's Gres field: `gpu:8`, `gpu:a100:4(S:0-1)`, `(null)`."""
    return sum(int(n) for n in _GPU_GRES.findall(gres))


@dataclass(frozen=True)
class SlurmNode:
    name: str
    cpus: int
    memory_mb: int
    gpus: int
    partitions: frozenset[str]

    @classmethod
    def parse(cls, line: str) -> SlurmNode:
        f = fields(line)
        return cls(f.get("NodeName", "?"), int(f.get("CPUTot", "0") or 0), int(f.get("RealMemory", "0") or 0),
                   gpu_count(f.get("Gres", "(null)")), frozenset(f.get("Partitions", "").split(",")) - {""})


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    total_nodes: int
    max_nodes: int | None
    max_time_s: int | None

    @classmethod
    def parse(cls, line: str) -> Partition:
        f = fields(line)
        max_nodes = f.get("MaxNodes", "UNLIMITED")
        return cls(f.get("PartitionName", "?"), f.get("Default") == "YES", int(f.get("TotalNodes", "0") or 0),
                   None if max_nodes.upper() in UNLIMITED else int(max_nodes),
                   slurm_seconds(f.get("MaxTime", "UNLIMITED")))


@dataclass(frozen=True)
class Cluster:
    partitions: list[Partition]
    nodes: list[SlurmNode]

    def partition(self, name: str | None) -> Partition | None:
        for p in self.partitions:
            if p.name == name or (name is None and p.default):
                return p
        return None

    def nodes_of(self, partition: Partition) -> list[SlurmNode]:
        return [n for n in self.nodes if partition.name in n.partitions]


# Slurm's own words when this host has Slurm's client but no cluster to talk
# to: no slurm.conf and no DNS SRV record for slurmctld, or slurmctld down or
# out of reach. Then every sbatch/scontrol fails, whatever the job.
_NOT_CONFIGURED = ("Could not establish a configuration source", "_establish_config_source",
                   "Unable to process configuration file", "resolve_ctls_from_dns_srv")
_UNREACHABLE = ("Unable to contact slurm controller", "Unable to establish controller machine",
                "Socket timed out on send/recv", "Zero Bytes were transmitted or received")


def slurm_words(stderr: str) -> str:
    """The one sentence of a Slurm tool's stderr that says why: its `fatal:`
    line, else its last `error:` line, else its last line, without the
    `tool: fatal: ` prefix."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return ""
    fatal = [ln for ln in lines if ": fatal: " in ln]
    errors = [ln for ln in lines if ": error: " in ln]
    line = (fatal or errors or lines)[-1]
    for mark in (": fatal: ", ": error: "):
        if mark in line:
            return line.split(mark, 1)[1]
    return line


def missing_tool(tool: str) -> str:
    """One line when a Slurm command is not on PATH."""
    return (f"ddpkit: {tool} is not on PATH: this host has no Slurm client (nothing was written or submitted); "
            "run ddpkit submit slurm on a login node of the cluster, or `ddpkit render slurm -o DIR` and sbatch "
            "the script there")


def unavailable(tool: str, stderr: str) -> str | None:
    """One line when a Slurm tool's stderr says this host cannot use any
    cluster (not configured, controller out of reach); None when it is about
    the job itself."""
    words = slurm_words(stderr)
    if any(m in stderr for m in _NOT_CONFIGURED):
        return (f"ddpkit: Slurm is installed on this host but not configured ({tool}: {words}); nothing was "
                "submitted: run on a login node of the cluster, or set SLURM_CONF to the cluster's slurm.conf")
    if any(m in stderr for m in _UNREACHABLE):
        return (f"ddpkit: {tool} cannot reach the Slurm controller ({tool}: {words}); nothing was submitted: "
                "check that slurmctld is up and reachable from this host (scontrol ping), then submit again")
    return None


def _scontrol(argv: list[str]) -> str:
    out = subprocess.run(["scontrol", *argv], capture_output=True, text=True, check=False, timeout=30)
    if out.returncode != 0:
        raise OSError(out.stderr.strip() or f"scontrol {' '.join(argv)} exited {out.returncode}")
    return out.stdout


def read_cluster(run: Runner = _scontrol) -> Cluster:
    def records(text: str) -> Iterable[str]:
        return (line for line in text.splitlines() if "=" in line)

    return Cluster([Partition.parse(x) for x in records(run(["show", "partition", "-o"]))],
                   [SlurmNode.parse(x) for x in records(run(["show", "node", "-o"]))])


def _cpus_per_node(spec: JobSpec) -> int:
    return tasks_per_node(spec) * (cpus_per_task(spec) or 1)


def problems(spec: JobSpec, cluster: Cluster) -> list[str]:
    """Why this job can never run on this cluster, each with the fix; [] if it can.

    An unknown partition is left to sbatch, whose own message names it."""
    part = cluster.partition(spec.slurm.partition)
    if part is None:
        return []
    nodes = cluster.nodes_of(part)
    where = f"partition {part.name!r}"
    found: list[str] = []
    limit = min(part.total_nodes, part.max_nodes or part.total_nodes)
    if spec.nodes > limit:
        found.append(f"nodes: the job asks for {spec.nodes} nodes but {where} has {part.total_nodes}"
                     + (f" and allows {part.max_nodes} per job" if part.max_nodes is not None else "")
                     + f"; pass --nodes {limit} or choose a larger partition (--set slurm.partition=NAME)")
    found += _gpu_problems(spec, nodes, where)
    if spec.slurm.time and part.max_time_s is not None:
        asked = slurm_seconds(spec.slurm.time)
        if asked is not None and asked > part.max_time_s:
            found.append(f"slurm.time: {spec.slurm.time} is above {where}'s limit of {_hms(part.max_time_s)};"
                         f" pass --set slurm.time={_hms(part.max_time_s)} or choose another partition")
    found += _size_problems(spec, nodes, where)
    return found


def _gpu_problems(spec: JobSpec, nodes: list[SlurmNode], where: str) -> list[str]:
    want = spec.gpus_per_node
    if not want or not nodes:
        return []
    most = max(n.gpus for n in nodes)
    if most == 0:
        return [f"device: the job asks for {want} GPU(s) per node but no node of {where} has GPU gres;"
                " use a GPU partition (--set slurm.partition=NAME) or run on CPU (--set device=cpu)"]
    if want > most:
        return [f"nproc_per_node: the job asks for {want} GPUs per node but the nodes of {where} have at most"
                f" {most}; pass --gpus-per-node {most}"]
    return []


def _size_problems(spec: JobSpec, nodes: list[SlurmNode], where: str) -> list[str]:
    if not nodes:
        return []
    found = []
    cpus, most_cpus = _cpus_per_node(spec), max(n.cpus for n in nodes)
    if cpus > most_cpus:
        found.append(f"resources.cpus_per_process: the job asks for {cpus} CPUs per node but the nodes of {where} "
                     f"have at most {most_cpus}; lower resources.cpus_per_process")
    most_mem = max(n.memory_mb for n in nodes)
    # RealMemory=1 is Slurm's "not configured": nothing to compare with.
    mem, field = slurm_mem(spec), "slurm.mem" if spec.slurm.mem is not None else "resources.memory_per_node"
    if mem and most_mem > 1 and megabytes(mem) > most_mem:
        found.append(f"{field}: {mem} per node is more than any node of {where} has"
                     f" ({most_mem}M); pass --set {field}={most_mem}{'M' if field == 'slurm.mem' else 'Mi'} or less")
    return found


def _hms(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


# Pending reasons that no amount of waiting clears: the job breaks a limit of
# its partition, QOS or association (squeue(1), "JOB REASON CODES").
HOPELESS_REASONS = frozenset({
    "PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidQOS",
    "InvalidAccount", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit", "QOSMaxCpuPerJobLimit",
    "QOSMaxGRESPerJob", "AssocMaxNodesPerJobLimit", "AssocMaxWallDurationPerJobLimit", "AssocMaxCpuPerJobLimit",
    "AssocMaxGRESPerJob",
})
