"""Bandwidth over message sizes, nccl-tests style: algbw = bytes / time,
busbw = algbw x the op's bus factor (sizes.bus_factor).

Iterations adapt to the size so the whole table takes seconds: one warm-up
call is timed, every rank agrees on the slowest figure (all ranks must run
the same number of collectives, or they deadlock), and the count fills
--bench-seconds per size, between 1 and MAX_ITERS."""

from __future__ import annotations

import time
from collections.abc import Callable

from .collectives import Group
from .results import BenchRow
from .sizes import algbw, bus_factor

MAX_ITERS = 200
FLOAT32_BYTES = 4


def _sync(g: Group) -> None:
    import torch

    if g.device.type == "cuda":
        torch.cuda.synchronize(g.device)


def _slowest(g: Group, seconds: float) -> float:
    """The slowest rank's time: a collective is as fast as its last rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=g.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.group)
    return float(t.item())


def _runner(g: Group, op: str, size_bytes: int, world: int) -> Callable[[], object]:
    """A closure that runs `op` once on preallocated buffers."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        buf = torch.ones(size_bytes // FLOAT32_BYTES, dtype=torch.float32, device=g.device)
        return lambda: dist.all_reduce(buf, group=g.group)
    if op == "broadcast":
        buf = torch.ones(size_bytes // FLOAT32_BYTES, dtype=torch.float32, device=g.device)
        return lambda: dist.broadcast(buf, src=dist.get_global_rank(g.group, 0) if g.group else 0, group=g.group)
    if op == "all_gather":
        # nccl-tests' size for all_gather is the whole output buffer.
        per_rank = max(size_bytes // FLOAT32_BYTES // world, 1)
        out = torch.empty(per_rank * world, dtype=torch.float32, device=g.device)
        inp = torch.ones(per_rank, dtype=torch.float32, device=g.device)
        return lambda: dist.all_gather_into_tensor(out, inp, group=g.group)
    raise ValueError(f"unknown op {op!r}")


def _timed(g: Group, fn: Callable[[], object], iters: int) -> float:
    import torch.distributed as dist

    dist.barrier(group=g.group)
    _sync(g)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(g)
    return _slowest(g, (time.perf_counter() - start) / iters)


def bench_one(g: Group, op: str, size_bytes: int, world: int, budget_s: float) -> BenchRow:
    bus_factor(op, world)  # reject an unknown op before allocating
    fn = _runner(g, op, size_bytes, world)
    if op == "all_gather":  # the bytes actually moved after splitting over ranks
        size_bytes = max(size_bytes // FLOAT32_BYTES // world, 1) * world * FLOAT32_BYTES
    warm = _timed(g, fn, 1)
    iters = int(min(max(budget_s / max(warm, 1e-9), 1), MAX_ITERS))
    per_iter = _timed(g, fn, iters)
    alg = algbw(size_bytes, per_iter)
    return BenchRow(g.backend, op, size_bytes, "float32", iters, per_iter * 1e6, alg, alg * bus_factor(op, world))


def bandwidth(g: Group, ops: list[str], sizes: list[int], world: int, budget_s: float) -> list[BenchRow]:
    return [bench_one(g, op, size, world, budget_s) for op in ops for size in sizes]
