"""Checkpoint files: atomic writes, last-K rotation, a `latest` pointer.

Layout of --checkpoint-dir:
    ckpt-00000120.pt   one complete checkpoint per saved step
    latest             text: the file name of the newest complete checkpoint

A file only gets its final name after its bytes are on disk (write to a
temporary name, fsync, rename, fsync the folder), and `latest` is replaced the
same way afterwards, so a kill at any instant leaves `latest` naming a
complete checkpoint (or no `latest` at all before the first save).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

LATEST = "latest"
NAME_RE = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or read; the message names the file."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    """`write(fileobj)` into a temporary sibling, fsync it, rename over `path`, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def complete_checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoint files, oldest first (temporary files never match)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if NAME_RE.match(p.name))


def write_checkpoint(directory: Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Rank 0 only. Returns the path written."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / checkpoint_name(step)
    _atomic_write(path, lambda f: torch.save(payload, f))
    _atomic_write(directory / LATEST, lambda f: f.write(path.name.encode() + b"\n"))
    _prune(directory, keep, path)
    return path


def _prune(directory: Path, keep: int, newest: Path) -> None:
    for old in complete_checkpoints(directory)[:-keep]:
        if old != newest:
            old.unlink(missing_ok=True)
    for stale in directory.glob(".ckpt-*.tmp-*"):  # left by a writer that was killed
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            stale.unlink(missing_ok=True)


def latest_checkpoint(directory: Path) -> Path | None:
    """The file `latest` names; without a readable pointer, the newest complete file."""
    pointer = directory / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if NAME_RE.match(name) and (directory / name).is_file():
            return directory / name
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def resolve_resume(resume: str | None, directory: Path | None) -> Path | None:
    """--resume auto: the latest checkpoint if there is one (a fresh start otherwise);
    --resume PATH: that file."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(directory) if directory else None
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {resume}: no such file")
    return path


FINGERPRINT_SPAN = 1 << 20


def fingerprint(path: Path) -> str:
    """sha256 of the file's size, first MiB and last MiB: tells two files apart
    (the pickled header with the position comes first) without reading a
    multi-GB checkpoint whole on every rank. Raises OSError when unreadable."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode())
        digest.update(f.read(FINGERPRINT_SPAN))
        f.seek(max(size - FINGERPRINT_SPAN, 0))
        digest.update(f.read(FINGERPRINT_SPAN))
    return digest.hexdigest()


def step_of(path: Path) -> int | None:
    """The step in a checkpoint's file name (None for a file named otherwise)."""
    match = NAME_RE.match(path.name)
    return int(match.group(1)) if match else None


def read_checkpoint(path: Path, map_location: torch.device | str) -> dict[str, Any]:
    try:
        # our own files: they hold numpy/python RNG states, which weights_only would refuse
        saved: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=False)  # write_checkpoint's payload
        return saved
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
