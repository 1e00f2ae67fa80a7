"""The rank report every job starts with (docs/CONTRACT.md, "The rank contract").

Every process builds its row, all rows are gathered to every rank, rank 0
prints one table, and every rank runs the same checks on the same rows, so
a bad job stops on all ranks at once instead of hanging in a collective.

The rows are also written as machine-readable records (`ReportOutputs`):
rank 0 writes every process's record to `--rank-report-json PATH` (one JSON
document; `-` prints one JSON line per process on stdout, for containers
whose files nobody can reach) and to the `--metrics` JSONL (kind
`rank_report`, one line per process). `gather` and `publish` are separate
so that a later report (after a new rendezvous) can reuse them.

Tests forge a row in real processes by replacing `own_row` from outside
(tests/helpers/forge_rank_report.py); report() looks it up at call time.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ... import envnames, netif, records
from ...exitcodes import ExitCode
from ...records import RankRow
from . import process_env
from .distributed import DistContext

STDOUT = "-"  # --rank-report-json -: the records go to stdout, one JSON line each


class RankReportError(RuntimeError):
    """The processes of the job do not form one consistent job."""

    exit_code = ExitCode.STARTUP  # `ddpkit train` exits with it (main.run)


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


def own_row(ctx: DistContext, env_names: Sequence[str] = ()) -> RankRow:
    torch_v, cuda_v, nccl_v = versions()
    sockets = process_env.socket_ifnames()
    return RankRow(
        rank=ctx.rank, local_rank=ctx.local_rank, node_rank=ctx.node_rank, host=ctx.host, pid=os.getpid(),
        device=str(ctx.device), interface=ctx.interface, address=netif.address_of(ctx.interface),
        torch=torch_v, cuda=cuda_v, nccl=nccl_v, launcher=ctx.launcher,
        world_size=ctx.world_size, master_addr=ctx.master_addr, master_port=ctx.master_port, backend=ctx.backend,
        nccl_socket_ifname=sockets[envnames.NCCL_SOCKET_IFNAME],
        gloo_socket_ifname=sockets[envnames.GLOO_SOCKET_IFNAME],
        env=process_env.values_of(env_names),
    )


def check_rows(rows: list[RankRow], world_size: int) -> list[str]:
    """Every way the gathered rows can contradict one job."""
    problems: list[str] = []
    # Counted once, not searched per row: a job of 1,024 nodes x 8 reports 8,192 rows.
    times = Counter(r.rank for r in rows)
    repeated = sorted(rank for rank, n in times.items() if n > 1)
    missing = sorted(set(range(world_size)) - times.keys())
    if repeated:
        twice = set(repeated)
        problems.append(f"rank(s) {repeated} reported by more than one process "
                        f"(pids {[r.pid for r in rows if r.rank in twice]}): two launches share one rendezvous")
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


@dataclass(frozen=True)
class ReportOutputs:
    """Where rank 0 writes the machine-readable records (nothing when both are None)."""

    json_path: str | None = None  # a file, or STDOUT
    metrics: Path | None = None  # the --metrics JSONL file, appended to


def record(row: RankRow) -> dict[str, Any]:
    """One process's machine-readable record (records.RankRow as JSON)."""
    return records.to_json(row)


def gather(ctx: DistContext, env_names: Sequence[str] = ()) -> list[RankRow]:
    """Every process's row, on every rank, in rank order (one collective)."""
    import torch.distributed as dist

    row = own_row(ctx, env_names)
    if not (dist.is_available() and dist.is_initialized()):
        return [row]
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, asdict(row))
    return sorted((RankRow(**g) for g in gathered if g is not None), key=lambda r: (r.rank, r.pid))


def _write_atomically(path: Path, text: str) -> None:
    """Readers never see half a file: write beside it, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def publish(rows: list[RankRow], problems: list[str], outputs: ReportOutputs, world_size: int) -> None:
    """Write the records where `outputs` says (rank 0 calls this)."""
    if outputs.json_path == STDOUT:
        # One short line per process: a single write each, so lines from
        # other processes sharing the stream cannot split a record.
        for row in rows:
            print(records.encode(row), flush=True)  # "kind" first: readers find records by it
    elif outputs.json_path is not None:
        document = {"kind": RankRow.kind, "world_size": world_size, "problems": problems,
                    "processes": [record(r) for r in rows]}
        _write_atomically(Path(outputs.json_path), json.dumps(document, indent=1) + "\n")
    if outputs.metrics is not None:
        from ..outputs.progress import Metrics

        metrics = Metrics(outputs.metrics, enabled=True)
        try:
            for row in rows:
                metrics.put(row)
        finally:
            metrics.close()


def report(ctx: DistContext, *, quiet: bool = False, env_names: Sequence[str] = (),
           outputs: ReportOutputs | None = None) -> RankReport:
    """Gather every process's row, print the table on rank 0 (and write the
    records to `outputs`, problems included), and raise RankReportError on
    every rank when the rows do not form one job."""
    rows = gather(ctx, env_names)
    problems = check_rows(rows, ctx.world_size)
    if ctx.is_main and not quiet:
        print_table(rows, problems)
    if ctx.is_main and outputs is not None:
        publish(rows, problems, outputs, ctx.world_size)
    if problems:
        raise RankReportError("rank report: " + " | ".join(problems))
    return RankReport(rows, problems)
