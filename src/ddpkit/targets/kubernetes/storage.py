"""What a Kubernetes job keeps on the storage its pods share (a claim or
NFS that outlives a pod): its checkpoints for `--resume auto`, and its
records folder with each pod's records and log."""

from __future__ import annotations

import shlex

from ... import records
from ...shared import envnames
from ...shared.agreed import METRICS_TO_LAUNCHER, is_ddpkit_module
from ...spec import JobSpec, K8sVolume
from .. import mounts

# Shared storage that outlives a pod: where a checkpoint for `--resume auto` can live.
SHARED_SOURCES = frozenset({"persistent_volume_claim", "nfs"})
# The job's records and its pods' logs, under a volume they share (records_folder).
RECORDS_SUBFOLDER = "ddpkit-records"


def shared_volumes(spec: JobSpec) -> list[K8sVolume]:
    """The volumes of k8s.volumes that every pod shares and may write (a claim or NFS)."""
    return [v for v in spec.k8s.volumes if v.source in SHARED_SOURCES and not v.read_only]


def shared_volume(spec: JobSpec) -> K8sVolume | None:
    """The first shared writable volume (the checkpoint's, in the examples), or None."""
    return next(iter(shared_volumes(spec)), None)


def records_folder(spec: JobSpec) -> str:
    """The job's records folder (DDPKIT_RECORDS): on its shared volume,
    `<mount>/ddpkit-records/<job>`, where each pod appends its records and its
    log (`<pod's hostname>.jsonl`, `.log`: agent/nodelog.py), which outlive
    the pod and `ddpkit report` reads (backends/kubectl.copy_records). Without
    one, a folder in each container (records.CONTAINER_FOLDER): its records go
    with the pod, and the agent keeps tracebacks on the pod's output."""
    volume = shared_volume(spec)
    if volume is None:
        return records.CONTAINER_FOLDER
    return f"{volume.mount_path.rstrip('/')}/{RECORDS_SUBFOLDER}/{spec.name}"


def records_env(spec: JobSpec) -> dict[str, str]:
    """What the training container adds to the job env for its records: the
    folder, and for a program of the user's own its metrics on that channel
    (its preamble's step times, loss, throughput, as compose's services;
    ddpkit train writes where its --metrics names: `--metrics -` is the channel)."""
    own = {} if is_ddpkit_module(spec.command.module) else {envnames.DDPKIT_METRICS: METRICS_TO_LAUNCHER}
    return {envnames.DDPKIT_RECORDS: records_folder(spec), **own}


def resume_warning(spec: JobSpec) -> str | None:
    """`--resume auto` needs the checkpoint directory on storage that outlives
    the pod; without one a restarted pod starts again from step 0."""
    ckpt = mounts.unmounted_checkpoint(spec, [v.mount_path for v in shared_volumes(spec)])
    if ckpt is None:
        return None
    parent = mounts.checkpoint_parent(ckpt)
    return (
        f"warning: k8s: --resume auto but no shared writable volume is mounted at or above "
        f"--checkpoint-dir {shlex.quote(ckpt)}: a restarted pod finds no checkpoint and starts again. "
        f"Fix: add to k8s.volumes {{name: ckpt, mount_path: {parent}, persistent_volume_claim: <claim>}} "
        f"(a ReadWriteMany PVC or nfs)"
    )

