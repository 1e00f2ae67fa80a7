"""`ddpkit env`: what this process resolved from its launcher, without
joining a process group. Run it where the job would run (under srun,
torchrun, mpirun, in a pod) to see ranks, master, interface, backend, device."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

from ...shared.exitcodes import ExitCode, exit_on
from .distributed import add_startup_arguments


@dataclass(frozen=True)
class Resolved:
    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    init_method: str
    interface: str | None
    address: str | None
    backend: str
    device: str
    host: str
    pid: int
    torch: str
    cuda: str | None
    nccl: str | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_startup_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def resolve(args: argparse.Namespace) -> Resolved:
    from ...host import netif
    from .distributed import detect_launch, hostname, resolve_backend, resolve_device
    from .rank_report import versions

    info = detect_launch(os.environ, args)
    device = resolve_device(args.device, info.local_rank)
    backend = resolve_backend(args.backend, device)
    interface = None
    if info.launcher != "single" and backend != "mpi":
        interface = netif.apply_interface(args.interface, info.master_addr)
    torch_v, cuda_v, nccl_v = versions()
    return Resolved(
        launcher=info.launcher, rank=info.rank, local_rank=info.local_rank, world_size=info.world_size,
        local_world_size=info.local_world_size, node_rank=info.node_rank, master_addr=info.master_addr,
        master_port=info.master_port, init_method=info.init_method, interface=interface,
        address=netif.address_of(interface), backend=backend, device=str(device), host=hostname(),
        pid=os.getpid(), torch=torch_v, cuda=cuda_v, nccl=nccl_v,
    )


def print_table(resolved: Resolved) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ddpkit env", title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in asdict(resolved).items():
        table.add_row(key.replace("_", " "), "-" if value is None else str(value))
    Console(highlight=False).print(table)


def run(args: argparse.Namespace) -> int:
    from ...host.netif import InterfaceError
    from .distributed import StartupError

    try:
        resolved = resolve(args)
    except (StartupError, InterfaceError) as exc:
        return exit_on("ddpkit env", exc, ExitCode.BAD_INPUT)
    if args.json:
        print(json.dumps(asdict(resolved), sort_keys=True))
    else:
        print_table(resolved)
    return 0
