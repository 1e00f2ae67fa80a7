"""A pod that reads what a Kubernetes job kept on its shared volume (its
records folder, storage.records_folder) for `kubectl cp`: the job's own pods
may be gone (completed pods cannot be exec'd into; a TTL deletes them)."""

from __future__ import annotations

from typing import Any

from ...spec import JobSpec
from .pod import security_context, volume_manifest
from .storage import shared_volume

READER_DEADLINE_S = 600  # a reader pod left behind (ddpkit interrupted) ends by itself after this


def reader_pod(spec: JobSpec, name: str, namespace: str | None) -> dict[str, Any] | None:
    """A pod that mounts the job's shared volume read-only and waits, for
    `kubectl cp` to read its records folder from while the job runs or after
    its pods are gone (ddpkit report, backends/kubectl.copy_records); None
    where the job has no shared volume. Its security context is the job
    container's: a namespace's Pod Security admits it as it admits the job.
    The claim must be one the job's pods on several nodes mount at once
    (ReadWriteMany), as the job needs anyway."""
    volume = shared_volume(spec)
    if volume is None:
        return None
    source = volume_manifest(volume)
    if "persistentVolumeClaim" in source:
        source["persistentVolumeClaim"] = {**source["persistentVolumeClaim"], "readOnly": True}
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "ddpkit",
                                                     "ddpkit.io/records-of": spec.name}}
    if namespace:
        meta["namespace"] = namespace
    container = {"name": "records", "image": spec.image, "command": ["sleep", str(READER_DEADLINE_S)],
                 "securityContext": security_context(spec),
                 "volumeMounts": [{"name": volume.name, "mountPath": volume.mount_path, "readOnly": True}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"restartPolicy": "Never", "activeDeadlineSeconds": READER_DEADLINE_S,
                     "securityContext": {"fsGroup": spec.k8s.run_as_user},
                     "containers": [container], "volumes": [source]}}
