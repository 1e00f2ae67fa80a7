"""The rank report every job starts with (docs/CONTRACT.md, "The rank contract").

Every process builds its row, the rows are gathered to rank 0, which checks
them, prints the table (rank_table.py: every row for a small job, a short
one at scale) and sends its verdict to every rank, so a bad job stops on all
ranks at once, with the same problems, instead of hanging in a collective.

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
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ... import records
from ...host import netif
from ...records import RankRow
from ...shared import envnames
from ...shared.agreed import metrics_to_launcher
from ...shared.exitcodes import ExitCode
from . import process_env
from .distributed import DistContext
from .rank_table import print_table, write_atomically

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


@dataclass(frozen=True)
class ReportOutputs:
    """Where rank 0 writes the machine-readable records (nothing when both are None)."""

    json_path: str | None = None  # a file, or STDOUT
    metrics: Path | None = None  # the --metrics JSONL file, appended to
    folder: Path | None = None  # where the full table goes when the printed one is short (a log or run folder)

    def records_at(self) -> str | None:
        """Where every process's record goes, in words (None: nowhere)."""
        places = []
        if self.json_path is not None:
            places.append("stdout (--rank-report-json -)" if self.json_path == STDOUT else self.json_path)
        if self.metrics is not None:
            where = "the run's records" if metrics_to_launcher(self.metrics) else str(self.metrics)
            places.append(f"{where} (kind {RankRow.kind})")
        return " and ".join(places) or None


def record(row: RankRow) -> dict[str, Any]:
    """One process's machine-readable record (records.RankRow as JSON)."""
    return records.to_json(row)


def gather(ctx: DistContext, env_names: Sequence[str] = ()) -> list[RankRow]:
    """Every process's row on rank 0, in rank order (one collective). Only
    rank 0 reads them: under gloo the other ranks keep their own row alone.
    Under NCCL every rank gets them all, as an all-gather: NCCL's gather is
    point to point, and rank 0 would open a connection, with its buffers on
    the GPU, to each of thousands of ranks for a few hundred bytes each."""
    import torch.distributed as dist

    row = own_row(ctx, env_names)
    if not (dist.is_available() and dist.is_initialized()):
        return [row]
    world, main = dist.get_world_size(), dist.get_rank() == 0
    if dist.get_backend() == "gloo":
        gathered: list[dict[str, Any] | None] = [None] * world if main else []
        dist.gather_object(asdict(row), gathered if main else None, dst=0)
        if not main:
            return [row]
    else:
        gathered = [None] * world
        dist.all_gather_object(gathered, asdict(row))
    return sorted((RankRow(**g) for g in gathered if g is not None), key=lambda r: (r.rank, r.pid))


def verdict(problems: list[str]) -> list[str]:
    """Rank 0's problems, on every rank (one collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return problems
    sent: list[Any] = [problems if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    return list(sent[0])


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
        write_atomically(Path(outputs.json_path), json.dumps(document, indent=1) + "\n")
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
    """Gather every process's row to rank 0, which checks them and sends the
    problems to every rank, then prints the table (and writes the records to
    `outputs`, problems included); raise RankReportError on every rank when
    the rows do not form one job. The report's rows are gather()'s."""
    rows = gather(ctx, env_names)
    # Sent before rank 0 prints and writes, so that no rank waits on rank 0's files.
    problems = verdict(check_rows(rows, ctx.world_size) if ctx.is_main else [])
    if ctx.is_main and not quiet:
        print_table(rows, problems, folder=outputs.folder if outputs else None,
                    records=outputs.records_at() if outputs else None)
    if ctx.is_main and outputs is not None:
        publish(rows, problems, outputs, ctx.world_size)
    if problems:
        raise RankReportError("rank report: " + " | ".join(problems))
    return RankReport(rows, problems)
