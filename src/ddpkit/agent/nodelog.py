"""A Slurm node's log: what its processes write for the record, not for the
people who read the job's output file (`tail -f slurm-<id>.out`).

Under a ddpkit launcher the node's whole output goes to the launcher, which
shows its people's lines and keeps the rest in the node's log. A Slurm job has
no launcher: srun copies every task's output into the one file people read.
There, what a launcher would have kept goes to `<node>.log` in the job's
records folder (beside the node's `<node>.jsonl` records, on the file system
the submit host shares): a worker's whole traceback, torch's report on a
failed worker (its ChildFailedError and summary box), torch's shutdown
warnings on a stop, and c10d's warning that it could not look up a peer's
name. The output keeps one line for each, which says where the rest is.

A Kubernetes job whose pods share a volume (targets/kubernetes/storage.py:
`records_folder`) has no launcher either: `kubectl logs` of each pod is what
people read. Its records folder is then on that volume, and each pod's log
beside its records there (`<pod's hostname>.log`), as a Slurm node's. A
compose job's folder is in each container (records.COMPOSE_FOLDER), which
keeps it as long as `docker compose logs` keeps the output: until `docker
compose down` (`docker compose cp` reads an exited container's files, and
`ddpkit report` and `status` copy them into the run folder).

One file per node, each piece in one append (O_APPEND keeps the writes of a
host's processes whole; nothing on another host writes to it). Where no
records folder outlives the node (a ddpkit launcher reads the stream; a
Kubernetes job's without a shared volume is in each pod's container,
records.CONTAINER_FOLDER, gone with the pod), `path` is None and
everything is printed as before: a traceback kept in a folder that dies with
its pod would be lost with the pod's output."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from .. import records
from ..shared import envnames


def slurm_node_file(env: Mapping[str, str]) -> Path | None:
    """This node's records file in a Slurm job's records folder, which names
    the node's other files there (its log, its failure file); None where there is none."""
    folder = records.channel(dict(env))
    if folder is None or not env.get(envnames.SLURM_JOB_ID):
        return None
    return records.node_file(folder, env.get(envnames.SLURMD_NODENAME))


def kept_node_file(env: Mapping[str, str]) -> Path | None:
    """This node's records file where its folder outlives the node: a Slurm
    job's, one on a volume a Kubernetes job's pods share, a compose
    container's (any folder but a pod's own, records.CONTAINER_FOLDER); None
    where there is none."""
    folder = records.channel(dict(env))
    if folder is None or folder == Path(records.CONTAINER_FOLDER):
        return None
    return records.node_file(folder, env.get(envnames.SLURMD_NODENAME))


def path(env: Mapping[str, str] | None = None) -> Path | None:
    """This node's log in a records folder that outlives it; None where there is none."""
    node_file = kept_node_file(os.environ if env is None else env)
    return None if node_file is None else node_file.with_suffix(".log")


def keep(text: str, what: str, env: Mapping[str, str] | None = None) -> Path | None:
    """Append `text` to the node's log under one heading line (`what`, when,
    this process); the log's path, or None where there is none or it cannot be
    written (the caller then prints `text` where it would have)."""
    where = path(env)
    if where is None:
        return None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    body = text if text.endswith("\n") else text + "\n"
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(where, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"==== {stamp} pid {os.getpid()}: {what}\n{body}".encode("utf-8", "replace"))
        finally:
            os.close(fd)
    except OSError:
        return None
    return where
