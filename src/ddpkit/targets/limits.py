"""What one node's container may use on a Docker host, from `resources:`:
the same limits for compose, `launch docker` and `ssh.docker`, each in
Docker's syntax (docs/EXTENDING.md, "How to add a portable spec field")."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import JobSpec, docker_size


@dataclass(frozen=True)
class Limits:
    shm_size: str  # the container's /dev/shm (where a target shares the host's IPC, unused)
    cpus: float | None  # CPUs of the whole node: its processes x resources.cpus_per_process
    memory: str | None

    @property
    def nano_cpus(self) -> int | None:
        """`cpus` as the Docker API takes it."""
        return None if self.cpus is None else int(self.cpus * 1e9)


def limits(spec: JobSpec) -> Limits:
    """compose.cpus_per_node, a fraction of the host's CPUs, wins over the
    portable count where it is set (compose only)."""
    per_process = spec.resources.cpus_per_process
    cpus = float(per_process * spec.nproc_per_node) if per_process else None
    memory = spec.resources.memory_per_node
    return Limits(docker_size(spec.resources.shm_size), cpus, docker_size(memory) if memory else None)


def compose_limits(spec: JobSpec) -> Limits:
    base = limits(spec)
    if spec.compose.cpus_per_node is None:
        return base
    return Limits(base.shm_size, spec.compose.cpus_per_node, base.memory)
