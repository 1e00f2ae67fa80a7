"""The part of the doctor that runs once every rank has joined: rank
report, correctness per backend, barrier latency, bandwidth, and the gather
of every rank's rows to rank 0."""

from __future__ import annotations

import argparse

from ..train.startup.distributed import DistContext
from ..train.startup.rank_report import RankReportError, report
from .bench import bandwidth
from .collectives import Group, barrier_latency, correctness
from .results import BenchRow, Check, DoctorResult, Status
from .sizes import message_sizes

SECTION = "distributed"
BARRIER_WARN_US = 100_000.0  # 100 ms per barrier: something between the nodes is badly wrong
CPU_MAX_SIZE = 64 * 1024 * 1024
GPU_MAX_SIZE = 1024 * 1024 * 1024


def groups(ctx: DistContext, with_gloo: bool) -> list[Group]:
    """The job's own backend, plus gloo on CPU when the job uses NCCL: the
    comparison tells a GPU transport problem from a network problem."""
    import torch
    import torch.distributed as dist

    out = [Group(ctx.backend, ctx.device)]
    if ctx.backend != "gloo" and with_gloo:
        gloo = dist.new_group(backend="gloo")
        assert isinstance(gloo, dist.ProcessGroup)  # every rank is a member: never GroupMember.NON_GROUP_MEMBER
        out.append(Group("gloo", torch.device("cpu"), gloo))
    return out


def _rendezvous_row(ctx: DistContext) -> Check:
    where = f"{ctx.master_addr}:{ctx.master_port}" if ctx.master_port else "the launcher's store"
    return Check(SECTION, "rendezvous", Status.PASS, f"{ctx.world_size} ranks joined through {where}",
                 rank=ctx.rank, host=ctx.host)


def _rank_report_row(ctx: DistContext, quiet: bool) -> Check:
    try:
        rr = report(ctx, quiet=quiet)
    except RankReportError as exc:
        return Check(SECTION, "rank report", Status.FAIL, str(exc),
                     "run one image on every node and let the launcher assign ranks (see the rank report table)",
                     rank=None, host="")
    return Check(SECTION, "rank report", Status.PASS, f"{len(rr.rows)} ranks, one consistent job")


def _barrier_row(g: Group, us: float) -> Check:
    name = f"barrier latency ({g.backend})"
    if us > BARRIER_WARN_US:
        return Check(SECTION, name, Status.WARN, f"{us:.0f} us per barrier (over {BARRIER_WARN_US:.0f} us)",
                     "check the interface in use (a slow management network?) and host load")
    return Check(SECTION, name, Status.PASS, f"{us:.0f} us per barrier")


def _gather(ctx: DistContext, rows: list[Check]) -> list[Check]:
    import torch.distributed as dist

    out: list[list[Check] | None] = [None] * ctx.world_size if ctx.is_main else []
    dist.gather_object(rows, out if ctx.is_main else None, dst=0)
    return [c for part in out or [] for c in (part or [])]


def _bench(args: argparse.Namespace, ctx: DistContext, gs: list[Group]) -> list[BenchRow]:
    ops = [o for o in args.ops.split(",") if o]
    rows: list[BenchRow] = []
    for g in gs:
        top = args.max_size or (GPU_MAX_SIZE if g.device.type == "cuda" else CPU_MAX_SIZE)
        sizes = message_sizes(args.min_size, max(top, args.min_size))
        rows += bandwidth(g, ops, sizes, ctx.world_size, args.bench_seconds)
    return rows


def run_distributed(args: argparse.Namespace, ctx: DistContext, preflight: list[Check]) -> DoctorResult | None:
    """Returns the whole job's result on rank 0, None elsewhere."""
    mine = list(preflight) + [_rendezvous_row(ctx)]
    shared = [_rank_report_row(ctx, quiet=args.json)]
    gs = groups(ctx, with_gloo=not args.no_gloo)
    barrier_us: dict[str, float] = {}
    for g in gs:
        mine += correctness(g, ctx.rank, ctx.world_size, ctx.host)
        barrier_us[g.backend] = barrier_latency(g)
    if ctx.is_main:
        shared += [_barrier_row(g, barrier_us[g.backend]) for g in gs]
    bench = _bench(args, ctx, gs) if args.bench else []
    everyone = _gather(ctx, mine)
    if not ctx.is_main:
        return None
    return DoctorResult(ctx.world_size, everyone + shared, bench, barrier_us)
