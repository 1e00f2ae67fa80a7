"""Start-up under every launcher: flags, detection, interface, backend,
device, process group.

    ctx = init_distributed(args)      # torchrun, srun, mpirun, a pod, manual, alone
    run_spawned(args, fn)             # --spawn N: N processes on this machine
    shutdown(ctx)

It stamps the start-up clock (clock.CLOCK) when the group is formed; CLOCK
and StartupClock are re-exported here for older imports.

torch is imported inside functions: `ddpkit --help` imports this module to
build its parser.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...host import netif
from ...rendezvous import runkey
from ...shared import envnames
from ...shared.agreed import device_block
from ..config.values import Options
from . import netcheck
from .clock import CLOCK, StartupClock, process_start
from .launchinfo import LaunchInfo, StartupError, detect_launch, expand_hostlist

if TYPE_CHECKING:
    import torch

__all__ = [
    "DistContext", "LaunchInfo", "StartupError", "add_startup_arguments", "detect_launch",
    "expand_hostlist", "init_distributed", "run_spawned", "shutdown", "hostname", "CLOCK", "StartupClock",
    "process_start", "Options",
]

DEFAULT_TIMEOUT_S = 1800


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    backend: str
    device: torch.device
    launcher: str
    interface: str | None
    host: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        import torch.distributed as dist

        return self.world_size > 1 or (dist.is_available() and dist.is_initialized())


def add_startup_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("start-up (normally set by the launcher)")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo", "mpi"],
                   default=os.environ.get(envnames.DDPKIT_BACKEND, "auto"),
                   help="auto: nccl with GPUs, else gloo (default: $DDPKIT_BACKEND or auto)")
    g.add_argument("--init-method", metavar="URL",
                   help="manual start: tcp://HOST:PORT, file:///PATH or env:// (with --rank and --world-size)")
    g.add_argument("--rank", type=int, help="this process's global rank (manual start)")
    g.add_argument("--world-size", type=int, help="number of processes in the job (manual start)")
    g.add_argument("--spawn", type=int, metavar="N", help="start N processes on this machine (torch.multiprocessing)")
    g.add_argument("--interface", default=os.environ.get(envnames.DDPKIT_INTERFACE, "auto"),
                   help="network interface(s) for NCCL/Gloo: auto (routes to the master), a name, or a comma list")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when a GPU is visible, else cpu")
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"collective and rendezvous timeout (default {DEFAULT_TIMEOUT_S})")


def hostname() -> str:
    """The host's name. `ddpkit launch local` names each emulated node
    (DDPKIT_HOSTNAME) so that N nodes on one machine stay distinct."""
    return os.environ.get(envnames.DDPKIT_HOSTNAME) or socket.gethostname()


def resolve_device(choice: str, local_rank: int, devices_per_process: int = 1, *,
                   wrap: bool = False) -> torch.device:
    """The primary device of the process with this local rank: the first of
    its block by the one ownership rule (agreed.device_block), so
    local rank 1 with two GPUs per process gets cuda:2, not rank 0's cuda:1.
    `wrap`: the rank is a guess (a manual start that was not told its node
    passes its global rank), so it is reduced modulo the blocks that fit."""
    import torch

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise StartupError("--device cuda but no GPU is visible to this process; use --device cpu (with gloo)")
    visible = torch.cuda.device_count()
    if wrap:
        local_rank %= max(1, visible // devices_per_process)
    try:
        block = device_block(local_rank, devices_per_process, visible)
    except ValueError as err:
        raise StartupError(str(err)) from None
    return torch.device("cuda", block.primary)


def resolve_backend(choice: str, device: torch.device) -> str:
    import torch.distributed as dist

    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise StartupError("--backend nccl needs GPUs; use --backend gloo for CPU processes")
    if choice == "mpi" and not dist.is_mpi_available():
        raise StartupError(
            "--backend mpi: this torch build has no MPI support (torch.distributed.is_mpi_available() is False); "
            "build torch from source against your MPI, or use gloo/nccl"
        )
    return choice


def _init_process_group(info: LaunchInfo, backend: str, timeout_s: float,
                        store: torch.distributed.Store | None = None) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "mpi":  # MPI knows ranks and peers itself
        dist.init_process_group("mpi", timeout=timeout)
        return
    if info.init_method == "env://":
        # Launchers that do not export these (srun, mpirun, a pod) still meet env://.
        os.environ[envnames.MASTER_ADDR] = str(info.master_addr)
        os.environ[envnames.MASTER_PORT] = str(info.master_port)
    if store is not None:  # the network checks opened the rendezvous store: the group meets through it
        prefix = runkey.group_prefix()  # every rank opened it the same way, so every rank wraps it alike
        group_store = store if prefix is None else dist.PrefixStore(prefix, store)
        dist.init_process_group(backend, store=group_store, rank=info.rank, world_size=info.world_size,
                                timeout=timeout)
        return
    dist.init_process_group(backend, init_method=info.init_method, rank=info.rank,
                            world_size=info.world_size, timeout=timeout)


def _placement_from_hosts(rank: int, host: str) -> tuple[int, int, int]:
    """(node_rank, local_rank, local_world_size) for a manual start whose node
    rank nobody told us: a node is a host, numbered in order of its lowest rank."""
    import torch.distributed as dist

    hosts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    order = list(dict.fromkeys(hosts))
    mine = [r for r, h in enumerate(hosts) if h == host]
    return order.index(host), mine.index(rank), len(mine)


def _init(info: LaunchInfo, args: Options) -> DistContext:
    import torch

    # A manual start that was not told its node guesses the GPU from the
    # global rank (one host's ranks are usually consecutive).
    # The doctor's Namespace has no --devices-per-process: its processes own one GPU each.
    per_process = int(getattr(args, "devices_per_process", 1))
    if info.node_rank is not None:
        device = resolve_device(args.device, info.local_rank, per_process)
    else:
        device = resolve_device(args.device, info.rank, per_process, wrap=True)
    backend = resolve_backend(args.backend, device)
    host = hostname()
    interface = None
    store: torch.distributed.Store | None = None
    if info.launcher != "single" and backend != "mpi":
        # Interface, DNS, port and arrival checks before any group; NetCheckError is a StartupError (exit 4).
        store = netcheck.before_join(info, args.interface, args.dist_timeout)
        try:
            interface = netif.apply_interface(args.interface, info.master_addr)
        except netif.InterfaceError as exc:
            raise StartupError(str(exc)) from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.launcher != "single":
        _init_process_group(info, backend, args.dist_timeout, store)
        if backend == "mpi":
            info = replace(info, rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size())
    node_rank, local_rank, local_world = info.node_rank, info.local_rank, info.local_world_size
    if node_rank is None:
        node_rank, local_rank, local_world = _placement_from_hosts(info.rank, host)
    CLOCK.mark("rendezvous_done")  # launcher detection, interface, device, process group, placement
    return DistContext(
        rank=info.rank, local_rank=local_rank, world_size=info.world_size, local_world_size=local_world,
        node_rank=node_rank, master_addr=info.master_addr, master_port=info.master_port, backend=backend,
        device=device, launcher=info.launcher, interface=interface, host=host,
    )


def init_distributed(args: Options) -> DistContext:
    """Detect the launcher, pin the interface, pick backend and device, and
    join the process group (none for one process started alone)."""
    return _init(detect_launch(os.environ, args), args)


def _spawned_child(index: int, args: Options, fn: Callable[[DistContext], object],
                   nprocs: int, init_file: str, prepare: Callable[[], object] | None,
                   failed: Callable[[int, BaseException], None] | None = None) -> None:
    info = LaunchInfo("spawn", rank=index, local_rank=index, world_size=nprocs, local_world_size=nprocs,
                      node_rank=0, master_addr="127.0.0.1", master_port=None, init_method=f"file://{init_file}")
    try:
        if prepare is not None:
            prepare()
        ctx = _init(info, args)
    except Exception as exc:
        if failed is not None:
            failed(index, exc)  # exits with the fault's code when it knows the error (a StartupError: 4)
        raise
    try:
        fn(ctx)
    finally:
        shutdown(ctx)


def run_spawned(args: Options, fn: Callable[[DistContext], object],
                prepare: Callable[[], object] | None = None,
                failed: Callable[[int, BaseException], None] | None = None) -> None:
    """--spawn N: N processes on this machine, joined through a file store
    (no port to race for). Each runs prepare() (if given) before it joins the
    group, then fn(ctx); `failed(rank, exc)`, if given, sees an error from
    prepare() or from joining (the pre-join checks' StartupError) and may
    exit the child with its code. All must be picklable (module-level functions or objects)."""
    import logging

    import torch.multiprocessing as mp

    if args.spawn is None or args.spawn < 1:
        raise StartupError(f"--spawn {args.spawn}: give the number of processes, 1 or more")
    # torch's "Terminating process N via signal SIGTERM" when one child failed
    # and the others are stopped: the failed child's own line says why.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="ddpkit-spawn-") as tmp:
            init_file = str(Path(tmp) / "rendezvous")
            mp.spawn(_spawned_child, args=(args, fn, args.spawn, init_file, prepare, failed), nprocs=args.spawn,
                     join=True)
    finally:
        spawn_log.setLevel(level)


def shutdown(ctx: DistContext | None = None) -> None:
    """Leave the process group so that no rank exits with NCCL/Gloo work
    still pending (torch warns, and peers may hang)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A DDP reducer left in a reference cycle (a fault's freed traceback
        # held it) must go before its group, or gloo aborts the process at
        # exit ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()
