"""Checks one process can make about its own host before joining the job:
versions, GPUs, /dev/shm, memlock, free disk. Each check is a function of
explicit inputs so a test can point it at a small tmpfs or a low limit."""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from .results import Check, Status
from .sizes import GIB, MIB, format_size

# DataLoader workers hand every batch to the main process through /dev/shm.
# Need per training process ~ workers x prefetch_factor x batch bytes; 4
# workers x 2 batches x a 32 MiB batch (64 images of 3x224x224 float32 is
# 38 MiB) gives 256 MiB. Docker's default /dev/shm is 64 MiB, the classic
# "bus error / insufficient shared memory" failure. Override with --shm-min.
SHM_PER_PROCESS = 256 * MIB
DEFAULT_DISK_MIN = 1 * GIB
SECTION = "local"


@dataclass(frozen=True)
class Where:
    rank: int
    host: str

    def check(self, name: str, status: Status, detail: str, fix: str = "", *, blocking: bool = False) -> Check:
        return Check(SECTION, name, status, detail, fix, self.rank, self.host, blocking)


def check_versions(where: Where) -> Check:
    from ..train.startup.rank_report import versions

    torch_v, cuda_v, nccl_v = versions()
    return where.check("versions", Status.PASS, f"torch {torch_v}, CUDA {cuda_v or '-'}, NCCL {nccl_v or '-'}")


def check_gpus(where: Where, *, wants_cuda: bool, visible: int, local_world_size: int) -> Check:
    """One GPU per local process: fewer GPUs than processes means two ranks
    share a GPU (NCCL refuses: 'Duplicate GPU detected')."""
    if not wants_cuda:
        return where.check("gpus", Status.SKIP, f"CPU run ({visible} GPU(s) visible, not used)")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{visible} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else "")
    if visible == 0:
        return where.check(
            "gpus", Status.FAIL, f"CUDA requested but {seen}",
            "request GPUs from the scheduler (--gres=gpu:N / nvidia.com/gpu: N / docker --gpus all) "
            "or run on CPU with --device cpu --backend gloo", blocking=True)
    if visible < local_world_size:
        return where.check(
            "gpus", Status.FAIL, f"{seen} for {local_world_size} processes on this node",
            f"set nproc_per_node to {visible}, or request {local_world_size} GPUs per node", blocking=True)
    if visible > local_world_size:
        return where.check("gpus", Status.WARN, f"{seen}, only {local_world_size} processes use them",
                           f"set nproc_per_node to {visible} to use every GPU")
    return where.check("gpus", Status.PASS, f"{seen} for {local_world_size} processes")


def check_shm(where: Where, path: Path, need: int) -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return where.check("shm", Status.FAIL, f"{path}: {exc.strerror}",
                           "mount a tmpfs at /dev/shm (docker --shm-size=8g or --ipc=host; "
                           "Kubernetes: an emptyDir with medium: Memory)")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{path}: {format_size(size)} size, {format_size(free)} free, need {format_size(need)}"
    fix = (f"give {path} at least {format_size(need)}: docker --shm-size / compose shm_size, "
           "Kubernetes emptyDir {medium: Memory} at /dev/shm, or fewer DataLoader workers (--shm-min to change "
           "the threshold)")
    if size < need:
        return where.check("shm", Status.FAIL, detail, fix)
    if free < need:
        return where.check("shm", Status.WARN, detail, f"free space in {path} (stale files?); " + fix)
    return where.check("shm", Status.PASS, detail)


def check_memlock(where: Where, *, rdma_or_gpu: bool, limit: int | None = None) -> Check:
    """NCCL and RDMA pin host memory; a low RLIMIT_MEMLOCK makes IB
    registration fail ('unable to allocate ... memory') or NCCL fall back."""
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    if soft == resource.RLIM_INFINITY:
        return where.check("memlock", Status.PASS, "unlimited")
    detail = f"limited to {format_size(soft)}"
    if not rdma_or_gpu:
        return where.check("memlock", Status.PASS, detail + " (matters only with GPUs or RDMA)")
    return where.check("memlock", Status.WARN, detail + " on a GPU/RDMA host",
                       "raise it to unlimited: `ulimit -l unlimited`, docker --ulimit memlock=-1, "
                       "Slurm PropagateResourceLimits / LimitMEMLOCK=infinity for slurmd")


def has_rdma() -> bool:
    ib = Path("/sys/class/infiniband")
    return ib.is_dir() and any(ib.iterdir())


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(where: Where, path: Path, need: int) -> Check:
    """Free space where checkpoints go (the folder, or its nearest existing
    parent when it will be created on first save)."""
    base = _existing_parent(path)
    usage = shutil.disk_usage(base)
    detail = f"{path}: {format_size(usage.free)} free" + ("" if base == path.absolute() else f" (on {base})")
    if not os.access(base, os.W_OK):
        return where.check("disk", Status.FAIL, detail + ", not writable",
                           f"make {base} writable for this user, or pass --checkpoint-dir to a writable folder")
    if usage.free < need:
        return where.check("disk", Status.FAIL, f"{detail}, need {format_size(need)}",
                           "free space or point --checkpoint-dir at a larger volume "
                           "(--disk-min to change the threshold)")
    return where.check("disk", Status.PASS, f"{detail}, need {format_size(need)}")


def driver_cuda_version() -> str | None:
    """The newest CUDA the host's driver supports ("13.2"), from libcuda's
    cuDriverGetVersion: no GPU context needed, so it answers even when torch
    cannot initialise CUDA. None without a driver."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    out = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(out)) != 0 or out.value <= 0:
        return None
    return f"{out.value // 1000}.{out.value % 1000 // 10}"


def _major_minor(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def check_cuda_driver(where: Where, *, wants_cuda: bool, runtime: str | None, driver: str | None) -> Check:
    """The CUDA torch was built with (the image's) against the newest the host
    driver supports. An older major cannot run at all (torch sees no GPU);
    an older minor runs under CUDA minor-version compatibility, but kernels
    that need the newer driver (PTX JIT) fail."""
    if not wants_cuda or runtime is None:
        return where.check("cuda driver", Status.SKIP, f"CPU run or CPU build of torch (CUDA {runtime or '-'})")
    if driver is None:
        return where.check("cuda driver", Status.WARN, f"torch built for CUDA {runtime}, no NVIDIA driver found",
                           f"install an NVIDIA driver for CUDA {runtime} on the host (and the container toolkit for images)")
    detail = f"torch built for CUDA {runtime}, host driver supports up to CUDA {driver}"
    fix = f"upgrade the host's NVIDIA driver to one for CUDA {runtime}, or use an image built for CUDA {driver}"
    have, need = _major_minor(driver), _major_minor(runtime)
    if have[0] < need[0]:
        return where.check("cuda driver", Status.FAIL, detail + ": the driver is a major version behind", fix)
    if have < need:
        return where.check("cuda driver", Status.WARN, detail + ": minor-version compatibility only", fix)
    return where.check("cuda driver", Status.PASS, detail)
