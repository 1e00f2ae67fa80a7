"""The `resources:` section: what each node and each training process get,
in one spelling that every target maps (docs/EXTENDING.md, "How to add a
portable spec field"). GPUs are not here: the device rule
(`nproc_per_node x devices_per_process`, `JobSpec.gpus_per_node`) sizes
every GPU request already.

- cpus_per_process: Slurm --cpus-per-task (x nproc_per_node in torchrun
  mode); a Kubernetes pod's cpu request = limit and compose's / launch
  docker's / ssh.docker's cpus, each x nproc_per_node; OMP_NUM_THREADS on
  every target.
- memory_per_node: Slurm --mem; a pod's memory request = limit; compose's
  and launch docker's mem_limit; ssh.docker's --memory.
- shm_size: a pod's /dev/shm emptyDir sizeLimit; compose's and launch
  docker's shm_size. Slurm and ssh.docker use the host's /dev/shm.

The older per-target spellings with the same meaning (`slurm.cpus_per_process`,
`k8s.memory`, `k8s.shm_size`) are still read, moved here, and named in a
one-line deprecation note. Three per-target fields stay because they say
what the portable ones cannot, and win on their target: `k8s.cpu` (a pod's
CPU, e.g. 500m), `compose.cpus_per_node` (a fraction of the host's CPUs),
`slurm.mem` (Slurm's own syntax: 0 is all of the node's memory).
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal
from typing import Any, Protocol

from pydantic import Field, model_validator

from .fields import K8sSize, Strict, quantity_value
from .k8s import K8sOptions
from .slurm import SlurmOptions

DEFAULT_SHM = "8Gi"
# Old spelling -> the field here; the same meaning, so the value moves as it is.
MOVED = {"slurm.cpus_per_process": "cpus_per_process", "k8s.memory": "memory_per_node", "k8s.shm_size": "shm_size"}
# A binary Kubernetes suffix and the same unit in Slurm's and Docker's syntax (both count in 1024s).
_BINARY = {"Ki": "K", "Mi": "M", "Gi": "G", "Ti": "T"}


class Resources(Strict):
    cpus_per_process: int | None = Field(
        default=None, ge=1, le=1024,
        description="CPUs for each training process (every target derives its per-node or per-task count)")
    memory_per_node: K8sSize | None = Field(
        default=None, description="memory of one node (a pod, a container, a Slurm node's share), e.g. 64Gi")
    shm_size: K8sSize = Field(default=DEFAULT_SHM, description="size of each node's memory-backed /dev/shm")

    @model_validator(mode="after")
    def _shm_within_memory(self) -> Resources:
        if self.memory_per_node is not None and quantity_value(self.shm_size) > quantity_value(self.memory_per_node):
            given = "" if "shm_size" in self.model_fields_set else " (the default)"
            raise ValueError(
                f"shm_size {self.shm_size}{given} is more than memory {self.memory_per_node}: a memory-backed "
                "/dev/shm counts against the pod's memory limit; lower shm_size or raise memory_per_node")
        return self


def _old_values(slurm: SlurmOptions, k8s: K8sOptions) -> dict[str, Any]:
    """The old spellings' values, by their names in MOVED (None: not given)."""
    return {"slurm.cpus_per_process": slurm.cpus_per_process, "k8s.memory": k8s.memory, "k8s.shm_size": k8s.shm_size}


def with_old_spellings(res: Resources, slurm: SlurmOptions, k8s: K8sOptions) -> Resources:
    """`res` with each old spelling's value moved in; refused (ValueError)
    when both spellings are given with different values."""
    moved = {}
    for old, value in _old_values(slurm, k8s).items():
        new = MOVED[old]
        if value is None:
            continue
        if new in res.model_fields_set and getattr(res, new) not in (None, value):
            raise ValueError(f"{old} {value} and resources.{new} {getattr(res, new)} disagree; "
                             f"keep resources.{new} only ({old} is its old spelling)")
        moved[new] = value
    if not moved:
        return res
    return Resources.model_validate({**res.model_dump(exclude_unset=True), **moved})


def deprecation_notes(slurm: SlurmOptions, k8s: K8sOptions) -> list[str]:
    """One line for each old spelling the spec uses."""
    return [f"note: {old} is deprecated; write resources.{MOVED[old]} (one spelling that every target maps)"
            for old, value in _old_values(slurm, k8s).items() if value is not None]


class WithResources(Protocol):
    """What move_old_spellings reads and writes of a JobSpec (job.py imports this module)."""

    slurm: SlurmOptions
    k8s: K8sOptions
    resources: Resources


def move_old_spellings(spec: WithResources) -> list[str]:
    """Move each old spelling's value into spec.resources and clear the old
    field, so that targets read one place and the run folder's spec.yaml has
    one spelling; the notes for the user (JobSpec.deprecations)."""
    notes = deprecation_notes(spec.slurm, spec.k8s)
    if notes:
        merged = with_old_spellings(spec.resources, spec.slurm, spec.k8s)
        spec.slurm.cpus_per_process = spec.k8s.memory = spec.k8s.shm_size = None
        spec.resources = merged
    return notes


def slurm_size(quantity: str) -> str:
    """A size for sbatch --mem: Slurm's K/M/G/T are binary, so 64Gi is 64G;
    any other quantity in whole MiB, rounded up."""
    for suffix, slurm in _BINARY.items():
        if quantity.endswith(suffix) and quantity[: -len(suffix)].isdigit():
            return quantity[: -len(suffix)] + slurm
    return f"{_mib(quantity)}M"


def docker_size(quantity: str) -> str:
    """A size for Docker and compose (shm_size, mem_limit): binary units
    k/m/g written as such (8Gi is 8g), anything else in bytes."""
    for suffix, unit in _BINARY.items():
        if quantity.endswith(suffix) and quantity[: -len(suffix)].isdigit() and unit != "T":
            return quantity[: -len(suffix)] + unit.lower()
    return f"{int(quantity_value(quantity).to_integral_value(ROUND_CEILING))}b"


def _mib(quantity: str) -> int:
    return int((quantity_value(quantity) / Decimal(2**20)).to_integral_value(ROUND_CEILING))
