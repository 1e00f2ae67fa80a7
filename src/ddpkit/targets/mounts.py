"""The job's `mounts:` on every target: bound into each container where
there is one, refused where a target cannot honour them, and the warning
when a resumable job's checkpoints would die with its container.

One rule per kind of target, so that one spec with mounts renders the same
way everywhere:
- a target with containers (compose, launch docker, ssh.docker, Slurm with
  pyxis or Apptainer) binds every mount;
- a target without one (launch local, plain launch ssh, plain Slurm) sees the
  host's folders as they are: a mount whose source is its target is
  honoured as it stands, one that moves a folder is refused;
- Kubernetes mounts volumes, not host folders: each mount's target must be
  a k8s.volumes mount_path (`refusal` asks `k8s_unmatched` for the
  Kubernetes kinds).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import PurePosixPath

from .. import records
from ..contract import RowKey
from ..shared import envnames
from ..shared.agreed import CHECKPOINT_DIR_FLAG, RESUME_FLAG, flag_value
from ..spec import JobSpec
from ..spec.fields import MountParts
from .program_paths import ContainerView, mount_fix, program_warnings


def parts(spec: JobSpec) -> list[MountParts]:
    return [MountParts.of(m) for m in spec.mounts]


K8S_TARGETS = frozenset({RowKey.PYTORCHJOB, RowKey.INDEXED_JOB, RowKey.TRAINJOB, RowKey.JOBSET})


def refusal(spec: JobSpec, target: RowKey) -> str | None:
    """Why `target` cannot honour the job's mounts (None: it can), raised by
    the target or launcher as an input error before anything is written or started."""
    if target in K8S_TARGETS:
        return k8s_unmatched(spec)
    if target in (RowKey.SLURM, RowKey.SLURM_SRUN) and spec.slurm.container.runtime == "none":
        return remap_refusal(spec, "Slurm without slurm.container.runtime")
    if target == RowKey.SSH and not spec.ssh.docker:
        return remap_refusal(spec, "SSH without ssh.docker")
    if target == RowKey.LOCAL:
        return remap_refusal(spec, "launch local")
    return None


def binds(spec: JobSpec) -> list[str]:
    """The mounts as Docker's `-v` / compose's `volumes:` / the SDK's binds write them."""
    return list(spec.mounts)


def remap_refusal(spec: JobSpec, where: str) -> str | None:
    """Why `where` (a target without containers) cannot run the job's mounts, or None."""
    for m in parts(spec):
        if m.source != m.target:
            return (f"mounts: {m.source}:{m.target} moves a folder, which {where} cannot do (its processes "
                    f"run on the host, not in a container); write {m.target}:{m.target} and keep the data "
                    f"there, or run the job in a container")
    return None


def k8s_unmatched(spec: JobSpec) -> str | None:
    """Why Kubernetes cannot honour a mount, or None: a pod sees volumes, so
    each mount's target needs a k8s.volumes entry mounted there."""
    mounted = {v.mount_path for v in spec.k8s.volumes}
    for m in parts(spec):
        if m.target not in mounted:
            return (f"mounts: {m.target} on Kubernetes needs a volume there: add to k8s.volumes "
                    f"{{name: ..., mount_path: {m.target}, persistent_volume_claim: <claim>}} (or host_path: "
                    f"{m.source}, nfs, ...)")
    return None


def unmounted_checkpoint(spec: JobSpec, writable: Iterable[str]) -> str | None:
    """The checkpoint folder of a `--resume auto` job that is at or under
    none of the `writable` paths (it dies with the container), or None."""
    args = list(spec.command.args)
    if flag_value(args, RESUME_FLAG) != "auto":
        return None
    ckpt = flag_value(args, CHECKPOINT_DIR_FLAG)
    if ckpt is None:
        return None
    folder = PurePosixPath(ckpt)
    for path in map(PurePosixPath, writable):
        if folder == path or path in folder.parents:
            return None
    return ckpt


def checkpoint_parent(ckpt: str) -> str:
    """Where a fix should mount storage for checkpoint folder `ckpt`: its
    parent, or the folder itself when that is /."""
    folder = PurePosixPath(ckpt)
    return str(folder.parent) if str(folder.parent) != "/" else str(folder)


def container_checkpoint_warning(spec: JobSpec, where: str) -> str | None:
    """The warning for a container target whose resumable job keeps its
    checkpoints inside the container."""
    ckpt = unmounted_checkpoint(spec, [m.target for m in parts(spec) if not m.read_only])
    if ckpt is None:
        return None
    parent = checkpoint_parent(ckpt)
    return (f"warning: {where}: --resume auto but no writable mount holds --checkpoint-dir {shlex.quote(ckpt)}: "
            f"the checkpoints go when the container does, and a restart starts again. "
            f"Fix: add to mounts '/host/ckpt:{parent}' (a folder every node shares, for more than one host)")


def container_warnings(spec: JobSpec, where: str) -> list[str]:
    """Every warning for a target whose nodes are containers that bind the job's
    mounts (compose, launch docker, ssh.docker): checkpoints and outputs kept
    inside the container, host paths the container does not have."""
    warning = container_checkpoint_warning(spec, where)
    targets = [m.target for m in parts(spec)]
    kept = [m.target for m in parts(spec) if not m.read_only]
    view = ContainerView(where, seen=targets, kept=kept, fix=mount_fix)
    return [*([warning] if warning else []), *program_warnings(spec, view)]


def records_in_container(env: dict[str, str]) -> dict[str, str]:
    """The job env of a rendered compose container with its records (and its
    node's log) sent to a folder in the container (ddpkit.records' channel,
    records.COMPOSE_FOLDER), not into the output `docker compose logs` shows,
    which no ddpkit launcher reads (`launch docker`, which does, runs without it)."""
    return env | {envnames.DDPKIT_RECORDS: records.COMPOSE_FOLDER}
