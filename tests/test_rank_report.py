"""The rank report: the checks on gathered rows, and real gloo jobs that a
forged row (tests/helpers/forge_rank_report.py, test-only) must stop on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ddpkit.records import RankRow
from ddpkit.train.startup.rank_report import check_rows
from tests.helpers.forge_rank_report import forge_env, forged
from tests.test_startup import ROOT, free_port, run_ranks


def row(rank: int, node: int, host: str, **kw: object) -> RankRow:
    base = RankRow(rank=rank, local_rank=rank % 2, node_rank=node, host=host, pid=1000 + rank, device="cpu",
                   interface="eth0", address="10.0.0.1", torch="2.5.0", cuda="12.4", nccl="2.21.5",
                   launcher="torchrun")
    return replace(base, **kw)  # type: ignore[arg-type]


GOOD = [row(0, 0, "a"), row(1, 0, "a"), row(2, 1, "b"), row(3, 1, "b")]


def test_a_consistent_job_has_no_problems() -> None:
    assert check_rows(GOOD, 4) == []


@pytest.mark.parametrize("rows,world,needle", [
    ([*GOOD, row(2, 1, "b")], 4, "rank(s) [2] reported by more than one process"),
    (GOOD[:3], 4, "rank(s) [3] missing from a world of 4"),
    ([*GOOD[:2], row(2, 1, "a"), row(3, 1, "a")], 4, "host a carries node ranks [0, 1]"),
    ([*GOOD[:2], row(2, 1, "b"), row(3, 1, "c")], 4, "node rank 1 is claimed by hosts ['b', 'c']"),
    ([*GOOD[:3], row(3, 1, "b", torch="2.4.0")], 4, "versions differ between processes"),
    ([*GOOD[:3], row(3, 1, "b", nccl="2.20.0")], 4, "NCCL 2.20.0 on b/rank3"),
])
def test_each_inconsistency_is_named(rows: list[RankRow], world: int, needle: str) -> None:
    problems = check_rows(rows, world)
    assert len(problems) == 1 and needle in problems[0], problems


def test_a_job_of_1024_nodes_x_8_names_its_one_repeated_and_one_missing_rank() -> None:
    """8,192 rows (bench/scale_sim.py's largest job): rank 5000 twice, rank 8191 never."""
    rows = [row(r, r // 8, f"h{r // 8}") for r in range(8191)] + [row(5000, 625, "h625", pid=77)]
    assert check_rows(rows, 8192) == [
        "rank(s) [5000] reported by more than one process (pids [6000, 77]): two launches share one rendezvous",
        "rank(s) [8191] missing from a world of 8192"]


def test_forge_hook_changes_only_the_chosen_rank() -> None:
    raw = json.dumps({"on_rank": 1, "rank": 0})
    assert forged(GOOD[1], 4, raw).rank == 0
    assert forged(GOOD[2], 4, raw) == GOOD[2]
    raw = json.dumps({"torch": "0.0"})  # default: the last rank
    assert forged(GOOD[3], 4, raw).torch == "0.0" and forged(GOOD[0], 4, raw) == GOOD[0]
    with pytest.raises(ValueError, match="unknown row fields"):
        forged(GOOD[3], 4, json.dumps({"rnak": 1}))


def test_the_product_has_no_forge_hook() -> None:
    import ddpkit.train.startup.rank_report as product

    source = Path(product.__file__).read_text()
    assert "FORGE" not in source and "environ" not in source


def manual_job(forge: dict[str, object]) -> list[subprocess.CompletedProcess[str]]:
    url = f"tcp://127.0.0.1:{free_port()}"
    return run_ranks([["--init-method", url, "--rank", str(r), "--world-size", "2"] for r in (0, 1)],
                     env=forge_env(forge))


@pytest.mark.full  # a forged duplicate stops the job: test_forged_duplicate_fails_a_launch_local_job
@pytest.mark.slow
def test_forged_duplicate_rank_stops_every_rank() -> None:
    results = manual_job({"on_rank": 1, "rank": 0})
    for rank, res in enumerate(results):
        assert res.returncode == 3, (res.stdout, res.stderr)
        assert f"rank {rank}: rank report: rank(s) [0] reported by more than one process" in res.stderr
        assert "REPORT-OK" not in res.stdout
    assert "rank(s) [1] missing" in results[0].stdout  # rank 0 prints the table and the problems


@pytest.mark.slow
def test_forged_version_mismatch_stops_every_rank() -> None:
    results = manual_job({"on_rank": 1, "torch": "0.0"})
    for rank, res in enumerate(results):
        assert res.returncode == 3, (res.stdout, res.stderr)
        assert f"rank {rank}: rank report: torch/CUDA/NCCL versions differ" in res.stderr
        assert "torch 0.0" in res.stderr


@pytest.mark.slow
def test_forged_duplicate_fails_a_launch_local_job() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_"))}
    env.update(forge_env({"on_rank": 1, "rank": 0}, env))
    res = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2",
                          "--nproc-per-node", "1", "--set", f"command.script={ROOT / 'tests/helpers/report_only.py'}"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0, res.stdout
    assert "rank report: rank(s) [0] reported by more than one process" in res.stdout
    assert "REPORT-OK" not in res.stdout
    assert "every other node was stopped" in " ".join(res.stdout.split()), res.stdout[-3000:]
