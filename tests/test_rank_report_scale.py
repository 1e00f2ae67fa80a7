"""The rank report at scale, without torch processes: rank 0's short table
of thousands of rows (one row per kind of process, the ones unlike the rest
apart, the full table in a file), the small job's table as it always was,
rank 0's verdict on every rank, and the preamble's rows read in batches."""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from ddpkit.preamble import ranks as preamble_ranks
from ddpkit.records import RankRow
from ddpkit.train.startup import rank_report, rank_table
from ddpkit.train.startup.rank_report import RankReportError, ReportOutputs, check_rows
from ddpkit.train.startup.rank_table import print_table, ranges
from tests.test_rank_report import GOOD, row

# What the table printed for a small job before it had a short form (rich, 160 columns into a log).
SMALL = "\n".join([
    'rank report: 4 processes                                                                                          ',
    '┏━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━┳━━━━━━┳━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━┳━━━━━━┳━━━━━━━━┳━━━━━━━━━━┓',
    '┃ rank ┃ local rank ┃ node rank ┃ host ┃ pid  ┃ device ┃ interface ┃ address  ┃ torch ┃ cuda ┃ nccl   ┃ launcher ┃',
    '┡━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━╇━━━━━━╇━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━╇━━━━━━╇━━━━━━━━╇━━━━━━━━━━┩',
    '│ 0    │ 0          │ 0         │ a    │ 1000 │ cpu    │ eth0      │ 10.0.0.1 │ 2.5.0 │ 12.4 │ 2.21.5 │ torchrun │',
    '│ 1    │ 1          │ 0         │ a    │ 1001 │ cpu    │ eth0      │ 10.0.0.1 │ 2.5.0 │ 12.4 │ 2.21.5 │ torchrun │',
    '│ 2    │ 0          │ 1         │ b    │ 1002 │ cpu    │ eth0      │ 10.0.0.1 │ 2.5.0 │ 12.4 │ 2.21.5 │ torchrun │',
    '│ 3    │ 1          │ 1         │ b    │ 1003 │ cpu    │ eth0      │ 10.0.0.1 │ 2.4.0 │ -    │ 2.21.5 │ torchrun │',
    '└──────┴────────────┴───────────┴──────┴──────┴────────┴───────────┴──────────┴───────┴──────┴────────┴──────────┘',
    'rank report: a problem',
]) + "\n"


def job(world: int) -> list[RankRow]:
    """1,024 nodes x 8 ranks at world 8,192, as bench/scale_sim.py builds them."""
    return [RankRow(rank=r, local_rank=r % 8, node_rank=r // 8, host=f"gpu-{r // 8:04d}", pid=100_000 + r,
                    device=f"cuda:{r % 8}", interface="ib0", address=f"10.0.{r // 8 // 256}.{r // 8 % 256}",
                    torch="2.14.1+cu130", cuda="13.0", nccl="2.28.9", launcher="torchrun", world_size=world)
            for r in range(world)]


def test_a_small_jobs_table_is_every_row_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [*GOOD[:3], row(3, 1, "b", torch="2.4.0", cuda=None)]
    print_table(rows, ["a problem"], folder=None, records="somewhere")
    assert capsys.readouterr().out == SMALL


def test_up_to_64_rows_every_row_is_shown_and_above_the_table_is_short(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    print_table(job(64), [], folder=tmp_path)
    out = capsys.readouterr().out
    assert "│ 63 " in out and "folded" not in out and not (tmp_path / rank_table.TABLE_FILE).exists()
    print_table(job(65), [], folder=tmp_path)
    out = capsys.readouterr().out
    assert "│ 0-64 " in out and "65 processes folded into 1 row(s)" in out


def test_8192_rows_fold_into_one_row_beside_the_outliers_and_the_full_table_is_written(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rows = job(8192)
    rows[5000] = replace(rows[5000], torch="0.0")  # another image on one rank
    rows[77] = replace(rows[77], device="cuda:0")  # a rank on another rank's GPU
    rows[6001] = replace(rows[6001], rank=6000)  # a rank twice, rank 6001 missing
    problems = check_rows(rows, 8192)
    print_table(rows, problems, folder=tmp_path, records="ranks.json")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("rank report: 8192 processes") and len(lines) < 20, out
    [folded] = [line for line in lines if line.startswith("│ 0-76, 78-4999")]
    assert "5001-5999, 6002-8191" in folded and "gpu-0000 … gpu-1023 (1024 hosts)" in folded
    assert "8188 processes" in folded and "cuda:<local rank>" in folded and "0-7 " in folded
    apart = {line.split("│")[1].strip(): line for line in lines if line.startswith("│ ") and line != folded}
    assert set(apart) == {"77", "5000", "6000"}, apart
    assert "0.0" in apart["5000"] and "cuda:0" in apart["77"] and "gpu-0009" in apart["77"]
    assert sum(line.startswith("│ 6000 ") for line in lines) == 2
    full = tmp_path / rank_table.TABLE_FILE
    assert ("8188 processes folded into 1 row(s), one per kind (device, interface, versions, launcher); "
            "4 shown on their own") in out and f"the full table: {full}; every process's record: ranks.json" in out
    text = full.read_text().splitlines()
    assert text[0] == "rank report: 8192 processes" and len(text) == 2 + 8192
    assert text[2].split() == ["0", "0", "0", "gpu-0000", "100000", "cuda:0", "ib0", "10.0.0.0", "2.14.1+cu130",
                               "13.0", "2.28.9", "torchrun"]
    assert all(f"rank report: {p}" in out.replace("\n", " ") for p in problems[:2])


def test_without_a_folder_the_full_table_is_omitted_and_said(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(job(1024), [], folder=None, records=None)
    out = capsys.readouterr().out
    assert "the full table is omitted (rank 0 has no log or run folder)" in out and "record" not in out


def test_many_outliers_fold_into_their_kinds_row_past_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [replace(r, torch="2.0") if r.rank % 2 else r for r in job(8192)]  # two images, half and half
    print_table(rows, [])
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 20 + rank_table.APART_ROWS
    assert "4064 processes" in out and f"{rank_table.APART_ROWS} shown on their own" in out


def test_ranges_are_short() -> None:
    assert ranges([3, 1, 2, 7, 9, 10]) == "1-3, 7, 9-10"
    assert ranges(range(0, 20, 2)) == "0, 2, 4, … 18 (10 ranges)"


class FakeDist:
    """torch.distributed as one rank of a gloo job sees it: rank 0 gathers the
    rows; every rank gets what rank 0 broadcast."""

    def __init__(self, rank: int, rows: list[RankRow], sent: list[Any]) -> None:
        self.rank, self.rows, self.sent = rank, rows, sent

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return len(self.rows)

    def get_backend(self) -> str:
        return "gloo"

    def gather_object(self, obj: Any, out: list[Any] | None, dst: int = 0) -> None:
        assert (out is not None) == (self.rank == dst == 0)
        if out is not None:
            out[:] = [asdict(r) for r in self.rows]

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> None:
        if self.rank == src:
            self.sent[:] = objects
        else:
            objects[:] = self.sent


def run_rank(monkeypatch: pytest.MonkeyPatch, rank: int, rows: list[RankRow], sent: list[Any],
             tmp_path: Path) -> str:
    import torch.distributed

    fake = FakeDist(rank, rows, sent)
    for name in ("is_available", "is_initialized", "get_rank", "get_world_size", "get_backend", "gather_object",
                 "broadcast_object_list"):
        monkeypatch.setattr(torch.distributed, name, getattr(fake, name))
    monkeypatch.setattr(rank_report, "own_row", lambda ctx, env_names=(): rows[rank])
    ctx: Any = type("Ctx", (), {"rank": rank, "is_main": rank == 0, "world_size": len(rows)})()
    with pytest.raises(RankReportError) as raised:
        rank_report.report(ctx, quiet=True, outputs=ReportOutputs(folder=tmp_path))
    return str(raised.value)


def test_rank_0s_verdict_stops_every_rank_with_the_same_problems(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = [*GOOD[:3], row(3, 1, "b", torch="0.0")]
    sent: list[Any] = []
    said = [run_rank(monkeypatch, 0, rows, sent, tmp_path)]

    def no_check(*_: object) -> list[str]:
        raise AssertionError("only rank 0 checks the rows")

    monkeypatch.setattr(rank_report, "check_rows", no_check)
    said += [run_rank(monkeypatch, r, rows, sent, tmp_path) for r in (1, 2, 3)]
    assert len(set(said)) == 1 and "rank report: torch/CUDA/NCCL versions differ" in said[0], said


class CountingStore:
    """A torch HashStore that counts the reads."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store, self.reads = dist.HashStore(), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def get(self, key: str) -> bytes:
        self.reads += 1
        return bytes(self.store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reads += 1
        return list(self.store.multi_get(keys))


def test_the_preambles_rank_0_reads_8192_rows_in_32_requests() -> None:
    store, rows = CountingStore(), job(8192)
    store.multi_set([f"row/{r.rank}" for r in rows], [json.dumps(asdict(r)) for r in rows])
    found, problems = preamble_ranks._gather(store, 8192)
    assert found == rows and problems == [] and store.reads == 8192 // preamble_ranks.MULTI_GET_KEYS == 32


def test_the_preamble_names_the_ranks_whose_rows_never_came() -> None:
    store, rows = CountingStore(), job(300)
    store.set_timeout(datetime.timedelta(seconds=0.2))
    store.multi_set([f"row/{r.rank}" for r in rows if r.rank != 7], [json.dumps(asdict(r)) for r in rows if r.rank != 7])
    found, problems = preamble_ranks._gather(store, 300)
    assert len(found) == 299 and problems == ["rank(s) [7] missing from a world of 300"]
