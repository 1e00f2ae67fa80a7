"""`ddpkit doctor`: preflight on every process, then (once the job has
joined) the rank report, collective correctness, barrier latency and, with
--bench, a bandwidth table. Rank 0 gathers every rank's rows and prints.

A process whose preflight finds a blocking failure (interface missing,
master unreachable, no GPU) cannot join: it prints its own table and exits
1 instead of hanging in a rendezvous that cannot complete."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..host import netif
from ..shared.exitcodes import ExitCode, exit_on
from ..train.startup.distributed import (
    DistContext,
    add_startup_arguments,
    hostname,
    init_distributed,
    run_spawned,
    shutdown,
)
from ..train.startup.launchinfo import LaunchInfo, StartupError, detect_launch
from ..train.startup.netproblem import NetCheckError
from . import exposure, local, network
from .distributed import CPU_MAX_SIZE, GPU_MAX_SIZE, run_distributed
from .results import Check, DoctorResult, Status
from .sizes import bus_factor, format_size, message_sizes, parse_size

WHO = "ddpkit doctor"
DOCTOR_DIST_TIMEOUT_S = 120  # a doctor should fail in minutes, not after the job's 30-minute timeout


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_startup_arguments(parser)
    parser.set_defaults(dist_timeout=DOCTOR_DIST_TIMEOUT_S)
    g = parser.add_argument_group("doctor")
    g.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    g.add_argument("--bench", action="store_true", help="also measure bandwidth over message sizes")
    g.add_argument("--ops", default="all_reduce", help="ops to benchmark, comma list of all_reduce, all_gather, "
                   "broadcast (default all_reduce)")
    g.add_argument("--min-size", type=_size, default=1024, help="smallest message (default 1KiB)")
    g.add_argument("--max-size", type=_size, help=f"largest message (default {format_size(GPU_MAX_SIZE)} on GPUs, "
                   f"{format_size(CPU_MAX_SIZE)} on CPU/gloo)")
    g.add_argument("--bench-seconds", type=float, default=0.2, help="time budget per message size (default 0.2)")
    g.add_argument("--no-gloo", action="store_true", help="on NCCL jobs, skip the gloo (CPU) comparison")
    # Generous: under srun/mpirun rank 0 opens the port only after its own
    # (possibly slow, shared-filesystem) torch import; a good port answers at once.
    g.add_argument("--connect-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long ranks that do not host the store retry the master's port (default 60)")
    g.add_argument("--shm-path", type=Path, default=Path("/dev/shm"), help="shared memory mount (default /dev/shm)")
    g.add_argument("--shm-min", type=_size, help=f"required size of --shm-path (default "
                   f"{format_size(local.SHM_PER_PROCESS)} per process on the node)")
    g.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                   help="where checkpoints go (default ./checkpoints)")
    g.add_argument("--disk-min", type=_size, default=local.DEFAULT_DISK_MIN,
                   help=f"required free space there (default {format_size(local.DEFAULT_DISK_MIN)})")


@dataclass(frozen=True)
class Place:
    """Where this process sits, before or after joining."""

    rank: int
    local_world_size: int
    launcher: str
    master: network.Master
    host: str


def _wants_cuda(args: argparse.Namespace) -> tuple[bool, int]:
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wants = args.device == "cuda" or args.backend == "nccl" or (args.device == "auto" and visible > 0)
    return wants, visible


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def preflight(args: argparse.Namespace, place: Place) -> list[Check]:
    where = local.Where(place.rank, place.host)
    wants_cuda, visible = _wants_cuda(args)
    checks = [
        local.check_versions(where),
        local.check_gpus(where, wants_cuda=wants_cuda, visible=visible, local_world_size=place.local_world_size),
        local.check_cuda_driver(where, wants_cuda=wants_cuda, runtime=_torch_cuda(), driver=local.driver_cuda_version()),
        local.check_shm(where, args.shm_path, args.shm_min or local.SHM_PER_PROCESS * place.local_world_size),
        local.check_memlock(where, rdma_or_gpu=wants_cuda or local.has_rdma()),
        local.check_disk(where, args.checkpoint_dir, args.disk_min),
    ]
    checks += interface_checks(args, place)  # one process too: a wrong name must not pass
    if place.launcher != "single":
        checks.append(network.check_resolves(place.master, place.rank, place.host))
        if not any(c.blocking and c.status is Status.FAIL for c in checks):
            checks.append(network.check_port(place.master, args.connect_timeout, place.rank, place.host))
    return checks


def interface_checks(args: argparse.Namespace, place: Place) -> list[Check]:
    return [network.check_interface(source, value, place.master.addr, place.rank, place.host)
            for source, value in network.interface_names(args.interface, dict(os.environ))]


def _place(info: LaunchInfo, host: str) -> Place:
    hosts = network.hosts_store(info.rank, info.launcher, dict(os.environ))
    return Place(info.rank, info.local_world_size, info.launcher,
                 network.Master(info.master_addr, info.master_port, hosts), host)


def _emit(args: argparse.Namespace, result: DoctorResult) -> None:
    from .report import print_json, print_tables

    (print_json if args.json else print_tables)(result)


def _alone(args: argparse.Namespace, place: Place, checks: list[Check], world: int) -> int:
    """Report this process's own rows: it could not join, or there is no job."""
    if place.launcher not in ("single", "spawn"):
        checks = checks + [Check("distributed", "rendezvous", Status.FAIL,
                                 f"rank {place.rank} did not join: see the failures above",
                                 "fix the failures above; the other ranks stop when their rendezvous times out",
                                 place.rank, place.host)]
    result = DoctorResult(world, checks)
    _emit(args, result)
    return ExitCode.FAILED if result.failed else ExitCode.OK


def run_process(args: argparse.Namespace) -> int:
    """One process started by a launcher (torchrun, srun, mpirun, a pod) or alone."""
    info = detect_launch(os.environ, args)
    place = _place(info, hostname())
    checks = preflight(args, place)
    if any(c.blocking and c.status is Status.FAIL for c in checks):
        return _alone(args, place, checks, info.world_size)
    if info.launcher == "single":
        checks.append(Check("distributed", "collectives", Status.SKIP,
                            "one process: run under torchrun/srun/mpirun, a rendered target "
                            "(ddpkit render ... --doctor), or with --spawn N", rank=0, host=place.host))
        return _alone(args, place, checks, 1)
    try:
        ctx = init_distributed(args)
    except NetCheckError as exc:  # the same pre-join checks as `ddpkit train`, with their own fix
        problem = exc.problem
        checks.append(Check(network.SECTION, problem.check, Status.FAIL, problem.cause, problem.fix,
                            place.rank, place.host, True))
        return _alone(args, place, checks, info.world_size)
    except (RuntimeError, StartupError, netif.InterfaceError) as exc:
        checks.append(Check("distributed", "rendezvous", Status.FAIL, str(exc).splitlines()[0],
                            "check MASTER_ADDR/MASTER_PORT, the interface, and that every node started",
                            place.rank, place.host))
        return _alone(args, place, checks, info.world_size)
    if place.rank == 0:  # on node 0, where the store listens once the job has met
        checks.append(exposure.check_exposure(place.master, place.rank, place.host))
    return joined(args, ctx, checks)


def joined(args: argparse.Namespace, ctx: DistContext, checks: list[Check]) -> int:
    try:
        result = run_distributed(args, ctx, checks)
        if result is not None:
            _emit(args, result)
        code = _verdict(ctx, result)
    finally:
        shutdown(ctx)
    return code


def _verdict(ctx: DistContext, result: DoctorResult | None) -> int:
    """Rank 0 prints; every rank exits with rank 0's verdict, so srun and
    torchrun report the same outcome for every task."""
    import torch.distributed as dist

    code = [0]
    if ctx.is_main and result is not None:
        code = [ExitCode.FAILED if result.failed else ExitCode.OK]
    if dist.is_initialized():
        dist.broadcast_object_list(code, src=0)
    return int(code[0])


def _spawned(ctx: DistContext, args: argparse.Namespace) -> None:
    place = Place(ctx.rank, ctx.local_world_size, ctx.launcher, network.Master(ctx.master_addr, None, False), ctx.host)
    code = joined(args, ctx, preflight(args, place))
    if code:
        sys.exit(code)


def run(args: argparse.Namespace) -> int:
    try:
        ops = [o for o in args.ops.split(",") if o]
        for op in ops:
            bus_factor(op, 1)
        if args.max_size is not None:
            message_sizes(args.min_size, args.max_size)
    except ValueError as exc:
        return exit_on(WHO, exc, ExitCode.BAD_INPUT)
    try:
        if args.spawn is not None:
            return _run_spawned(args)
        return run_process(args)
    except StartupError as exc:
        return exit_on(WHO, exc, ExitCode.BAD_INPUT)


def _run_spawned(args: argparse.Namespace) -> int:
    import functools

    from torch.multiprocessing import ProcessExitedException

    # The children get args by pickle; the CLI's dispatch closure cannot travel.
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
    # Before any child starts: a wrong interface name would end in gloo's traceback in every child.
    place = Place(0, args.spawn, "spawn", network.Master("127.0.0.1", None, False), hostname())
    checks = interface_checks(args, place)
    if any(c.status is Status.FAIL for c in checks):
        return _alone(args, place, checks, args.spawn)
    try:
        run_spawned(args, functools.partial(_spawned_entry, args=args))
    except ProcessExitedException:
        return ExitCode.FAILED
    return 0


def _spawned_entry(ctx: DistContext, args: argparse.Namespace) -> None:
    _spawned(ctx, args)
