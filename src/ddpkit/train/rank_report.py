"""The rank report every job starts with (DESIGN.md).

Every process builds its row, all rows are gathered to every rank, rank 0
prints one table, and every rank runs the same checks on the same rows, so
a bad job stops on all ranks at once instead of hanging in a collective.

Tests forge a row in real processes by replacing `own_row` from outside
(tests/helpers/forge_rank_report.py); report() looks it up at call time.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass

from .. import netif
from ..exitcodes import ExitCode
from .startup import DistContext


class RankReportError(RuntimeError):
    """The processes of the job do not form one consistent job."""

    exit_code = ExitCode.STARTUP  # `ddpkit train` exits with it (main.run)


@dataclass(frozen=True)
class RankRow:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    device: str
    interface: str | None
    address: str | None
    torch: str
    cuda: str | None
    nccl: str | None
    launcher: str

    @property
    def versions(self) -> tuple[str, str | None, str | None]:
        return (self.torch, self.cuda, self.nccl)


@dataclass(frozen=True)
class RankReport:
    rows: list[RankRow]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def versions() -> tuple[str, str | None, str | None]:
    import torch

    nccl = None
    if torch.cuda.is_available() or torch.version.cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):  # CPU-only build
            nccl = None
    return torch.__version__, torch.version.cuda, nccl


def own_row(ctx: DistContext) -> RankRow:
    torch_v, cuda_v, nccl_v = versions()
    return RankRow(
        rank=ctx.rank, local_rank=ctx.local_rank, node_rank=ctx.node_rank, host=ctx.host, pid=os.getpid(),
        device=str(ctx.device), interface=ctx.interface, address=netif.address_of(ctx.interface),
        torch=torch_v, cuda=cuda_v, nccl=nccl_v, launcher=ctx.launcher,
    )


def check_rows(rows: list[RankRow], world_size: int) -> list[str]:
    """Every way the gathered rows can contradict one job."""
    problems: list[str] = []
    ranks = sorted(r.rank for r in rows)
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    missing = sorted(set(range(world_size)) - set(ranks))
    if repeated:
        problems.append(f"rank(s) {repeated} reported by more than one process "
                        f"(pids {[r.pid for r in rows if r.rank in repeated]}): two launches share one rendezvous")
    if missing:
        problems.append(f"rank(s) {missing} missing from a world of {world_size}")
    node_ranks_of: dict[str, set[int]] = defaultdict(set)
    hosts_of: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        node_ranks_of[r.host].add(r.node_rank)
        hosts_of[r.node_rank].add(r.host)
    for host, nodes in sorted(node_ranks_of.items()):
        if len(nodes) > 1:
            problems.append(f"host {host} carries node ranks {sorted(nodes)}: each host must be one node "
                            "(check the node rank each launcher passes)")
    for node, hosts in sorted(hosts_of.items()):
        if len(hosts) > 1:
            problems.append(f"node rank {node} is claimed by hosts {sorted(hosts)}: node ranks must be unique")
    by_version: dict[tuple[str, str | None, str | None], list[str]] = defaultdict(list)
    for r in rows:
        by_version[r.versions].append(f"{r.host}/rank{r.rank}")
    if len(by_version) > 1:
        listing = "; ".join(f"torch {v[0]} CUDA {v[1]} NCCL {v[2]} on {', '.join(w[:4])}"
                            for v, w in sorted(by_version.items(), key=lambda kv: str(kv[0])))
        problems.append(f"torch/CUDA/NCCL versions differ between processes: {listing}; use one image everywhere")
    return problems


def print_table(rows: list[RankRow], problems: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rank report: {len(rows)} processes", title_justify="left")
    columns = ["rank", "local_rank", "node_rank", "host", "pid", "device", "interface", "address",
               "torch", "cuda", "nccl", "launcher"]
    for name in columns:
        table.add_column(name.replace("_", " "), no_wrap=True)
    for row in sorted(rows, key=lambda r: (r.rank, r.pid)):
        table.add_row(*("-" if getattr(row, c) is None else str(getattr(row, c)) for c in columns))
    # Logs are not terminals: do not squeeze the table into 80 columns there.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for problem in problems:
        console.print(f"[bold red]rank report:[/] {problem}", markup=True, soft_wrap=True)


def report(ctx: DistContext, *, quiet: bool = False) -> RankReport:
    """Gather every process's row, print the table on rank 0, and raise
    RankReportError on every rank when the rows do not form one job."""
    import torch.distributed as dist

    row = own_row(ctx)
    if dist.is_available() and dist.is_initialized():
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, asdict(row))
        rows = [RankRow(**g) for g in gathered if g is not None]
    else:
        rows = [row]
    problems = check_rows(rows, ctx.world_size)
    if ctx.is_main and not quiet:
        print_table(rows, problems)
    if problems:
        raise RankReportError("rank report: " + " | ".join(problems))
    return RankReport(rows, problems)
