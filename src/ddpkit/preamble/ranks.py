"""The rank report for a program of the user's own: the same table and
checks as `ddpkit train`'s (train/startup/rank_report.py), once the program's
`torch.distributed.init_process_group` has returned.

The rows travel through the process group's own store (each rank sets its
row, rank 0 reads them all, checks them and sets the verdict every rank
waits for), so the program's collectives, streams and devices are never
touched: a program whose first collective is a GPU all-reduce sees nothing
different. A job whose rows do not form one job ends on every rank with
exit 4 (STARTUP) and the problems in one line each, as `ddpkit train` does.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..host import netif
from ..records import RankRow
from ..shared import envnames
from ..shared.agreed import metrics_to_launcher
from ..shared.exitcodes import ExitCode
from ..train.startup import process_env
from ..train.startup.rank_report import ReportOutputs, check_rows, publish, versions
from ..train.startup.rank_table import print_table
from .store import group_store

SUBPREFIX = "rank-report"  # under the run's control prefix (runkey): a stranger cannot forge a row or the verdict
# How long rank 0 waits for every row, and every rank for rank 0's verdict: the
# ranks are past init_process_group, so each is seconds away from its row.
WAIT_S = 120.0
SAID_WAIT_S = 10.0
MULTI_GET_KEYS = 256  # rows a store request reads; one request of 8,192 keys was slower than 32 of 256


def install(env: Mapping[str, str]) -> None:
    """Wrap torch.distributed.init_process_group so that the report follows it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group
    if getattr(original, "__ddpkit_wrapped__", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        report(env)

    init_process_group.__ddpkit_wrapped__ = True  # type: ignore[attr-defined]
    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    dist.init_process_group = init_process_group
    distributed_c10d.init_process_group = init_process_group


def own_row(env: Mapping[str, str]) -> RankRow:
    import torch
    import torch.distributed as dist

    torch_v, cuda_v, nccl_v = versions()
    sockets = process_env.socket_ifnames()
    backend = str(dist.get_backend())
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else \
        ("cuda" if "nccl" in backend else "cpu")  # the program's choice; asking CUDA now would initialise it
    interface = sockets[envnames.GLOO_SOCKET_IFNAME] or sockets[envnames.NCCL_SOCKET_IFNAME]
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(env.get(envnames.LOCAL_WORLD_SIZE, world))
    port = env.get(envnames.MASTER_PORT)
    return RankRow(
        rank=rank, local_rank=int(env.get(envnames.LOCAL_RANK, rank % max(local_world, 1))),
        node_rank=int(env.get(envnames.GROUP_RANK, rank // max(local_world, 1))),
        host=env.get(envnames.DDPKIT_HOSTNAME) or socket.gethostname(), pid=os.getpid(), device=device,
        interface=interface, address=netif.address_of(interface), torch=torch_v, cuda=cuda_v, nccl=nccl_v,
        launcher=launcher(env), world_size=world, master_addr=env.get(envnames.MASTER_ADDR),
        master_port=int(port) if port and port.isdigit() else None, backend=backend,
        nccl_socket_ifname=sockets[envnames.NCCL_SOCKET_IFNAME], gloo_socket_ifname=sockets[envnames.GLOO_SOCKET_IFNAME])


def launcher(env: Mapping[str, str]) -> str:
    if envnames.TORCHELASTIC_RUN_ID in env:
        return "torchrun"
    if envnames.SLURM_PROCID in env:
        return "srun"
    return "manual"


def report(env: Mapping[str, str], say: Callable[[str], None] | None = None) -> list[str]:
    """Exchange the rows, print the table on rank 0, end the process on every
    rank when the rows do not form one job. The problems found (none: [])."""

    store = group_store(SUBPREFIX, env)
    if store is None:
        return []
    store.set_timeout(datetime.timedelta(seconds=WAIT_S))
    row = own_row(env)
    store.set(f"row/{row.rank}", json.dumps(asdict(row)))
    if row.rank == 0:
        rows, problems = _gather(store, row.world_size)
        # Set before rank 0 prints and writes, so that no rank waits on rank 0's files.
        store.set("verdict", json.dumps(problems))
        metrics = env.get(envnames.DDPKIT_METRICS)
        outputs = ReportOutputs(metrics=Path(metrics) if metrics else None,
                                folder=None if not metrics or metrics_to_launcher(metrics) else Path(metrics).parent)
        print_table(rows, problems, folder=outputs.folder, records=outputs.records_at())
        sys.stdout.flush()
        if outputs.metrics is not None:
            publish(rows, problems, outputs, row.world_size)
    else:
        problems = _verdict(store)
    if problems:
        _settle()
        for problem in problems:
            (say or _say)(f"ddpkit: rank report: {problem}")
        _all_said(store, row.world_size)
        sys.exit(ExitCode.STARTUP)
    return problems


def _settle() -> None:
    """This rank's end is decided (exit 4): a stop signal from now on is
    ignored. The first rank to exit makes torchrun SIGTERM the others, and on
    a busy machine one still saying why or shutting its interpreter down
    would end as -15, not with the exit code every rank agreed on."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread: the signal keeps its action
            pass


def _gather(store: Any, world: int) -> tuple[list[RankRow], list[str]]:
    keys = [f"row/{r}" for r in range(world)]
    try:
        store.wait(keys)
    except RuntimeError:  # a timeout: the rows that came, and the missing ranks named by check_rows
        keys = [key for key in keys if store.check([key])]
    # A few batches instead of a round trip per row (the watchdog reads its heartbeats so).
    raws = [raw for at in range(0, len(keys), MULTI_GET_KEYS) for raw in store.multi_get(keys[at:at + MULTI_GET_KEYS])]
    rows = [RankRow(**json.loads(raw)) for raw in raws]
    return rows, check_rows(rows, world)


def _verdict(store: Any) -> list[str]:
    try:
        return list(json.loads(store.get("verdict")))
    except RuntimeError:
        return [f"rank 0 gave no verdict on the rank report within {WAIT_S:g} s"]


def _all_said(store: Any, world: int) -> None:
    """Wait (briefly) until every rank has said why it ends: the first rank to
    exit makes torchrun stop the others, which would cut their lines."""
    if store.add("said", 1) >= world:
        store.set("all-said", "1")
    try:
        store.wait(["all-said"], datetime.timedelta(seconds=SAID_WAIT_S))
    except RuntimeError:  # a rank that never got here (it died): end anyway
        pass


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
