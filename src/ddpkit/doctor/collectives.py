"""Collective correctness with exact expected values, and barrier latency.

Values are small integers so every dtype carries them exactly: the sum over
n ranks of (i + r) % m stays <= n * (m - 1), and 16-bit floats use m = 2 so
sums stay far below 256, the largest run of integers bfloat16 holds exactly."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .results import Check, Status

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

SECTION = "distributed"
COUNTS = (1, 1000, 65537)  # a scalar, a small odd size, a size above typical chunk boundaries
FIX = ("a collective returned wrong values: make every node use the same image (torch/NCCL), "
       "set NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1 to rule out a faulty transport, and check GPU health")


@dataclass(frozen=True)
class Group:
    """A process group to test and the device its tensors live on."""

    backend: str
    device: torch.device
    group: ProcessGroup | None = None  # None: the default group


def dtypes_for(backend: str) -> list[torch.dtype]:
    import torch

    common = [torch.float32, torch.float64, torch.int64, torch.float16]
    return common + [torch.bfloat16] if backend == "nccl" else common


def _modulus(dtype: torch.dtype) -> int:
    import torch

    return 2 if dtype in (torch.float16, torch.bfloat16) else 7


def pattern(count: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    import torch

    idx = torch.arange(count, dtype=torch.int64)
    return ((idx + rank) % _modulus(dtype)).to(dtype=dtype, device=device)


def expected_sum(count: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    import torch

    idx = torch.arange(count, dtype=torch.int64)
    total = torch.zeros(count, dtype=torch.int64)
    for r in range(world):
        total += (idx + r) % _modulus(dtype)
    return total.to(dtype)


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    import torch

    got = got.cpu()
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()
    first = int(bad[0][0]) if bad.dim() > 1 else int(bad[0])
    return f"{len(bad)} wrong element(s); first at {first}: got {got.flatten()[first].item()}, " \
           f"expected {want.flatten()[first].item()}"


def _all_reduce(g: Group, count: int, dtype: torch.dtype, rank: int, world: int) -> str | None:
    import torch.distributed as dist

    t = pattern(count, rank, dtype, g.device)
    dist.all_reduce(t, group=g.group)
    return _mismatch(t, expected_sum(count, world, dtype))


def _broadcast(g: Group, count: int, dtype: torch.dtype, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist

    src = world - 1  # not rank 0: a wrong source shows up
    t = pattern(count, src, dtype, g.device) if rank == src else torch.zeros(count, dtype=dtype, device=g.device)
    dist.broadcast(t, src=dist.get_global_rank(g.group, src) if g.group else src, group=g.group)
    return _mismatch(t, pattern(count, src, dtype, torch.device("cpu")))


def _all_gather(g: Group, count: int, dtype: torch.dtype, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(count, dtype=dtype, device=g.device) for _ in range(world)]
    dist.all_gather(out, pattern(count, rank, dtype, g.device), group=g.group)
    for r, t in enumerate(out):
        problem = _mismatch(t, pattern(count, r, dtype, torch.device("cpu")))
        if problem:
            return f"slot of rank {r}: {problem}"
    return None


OPS = {"all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather}


def correctness(g: Group, rank: int, world: int, host: str) -> list[Check]:
    """One row per op and dtype on this rank (all sizes in it)."""
    rows = []
    for op, fn in OPS.items():
        for dtype in dtypes_for(g.backend):
            name = f"{op} {str(dtype).removeprefix('torch.')} ({g.backend})"
            problems = []
            for count in COUNTS:
                try:
                    problem = fn(g, count, dtype, rank, world)
                except RuntimeError as exc:  # e.g. a dtype this backend cannot reduce
                    problem = f"raised {exc}".splitlines()[0]
                if problem:
                    problems.append(f"{count} elements: {problem}")
            sizes = "/".join(str(c) for c in COUNTS)
            if problems:
                rows.append(Check(SECTION, name, Status.FAIL, "; ".join(problems), FIX, rank, host))
            else:
                rows.append(Check(SECTION, name, Status.PASS, f"exact for {sizes} elements", rank=rank, host=host))
    return rows


def barrier_latency(g: Group, repeats: int = 20) -> float:
    """Mean microseconds per barrier, after one warm-up."""
    import torch.distributed as dist

    dist.barrier(group=g.group)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.barrier(group=g.group)
    return (time.perf_counter() - start) / repeats * 1e6
