"""bench/scale_sim.py's short version end to end: the real store service, 16
real rendezvous handlers in a host process, a crash and the re-formation,
the rank report over 16 x 8 rows, a monitor round, the launcher's printer
fed every node's lines. What happened is asserted, never how fast
(tests/test_bench_smoke.py says what a smoke test asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bench_smoke import run_bench

pytestmark = pytest.mark.slow
N = 16


def test_scale_sim_short_forms_reforms_and_reports(tmp_path: Path) -> None:
    run_bench("bench.scale_sim", "--short", "--nodes", str(N), "--steady-s", "1", "--launcher-s", "0.3",
              "--out", str(tmp_path), "--name", "s")
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["machine"]["torch"] and data["command"]
    [res] = data["results"]
    rdzv = res["rendezvous"]
    # every simulated node got a distinct rank, in one round of N
    assert rdzv["first_ranks_distinct"] and rdzv["first_rendezvous_s"] > 0, rdzv
    # the crashed node was left out: a round of N-1 with ranks 0..N-2, all survivors in it
    assert rdzv["reformed_without_lost"] and rdzv["reformed_world"] == N - 1, rdzv
    # a training node keeps alive with a set of its own key and reads the next round's count (its
    # num_nodes_waiting): no compare-and-set of a shared state while the job trains
    steady = rdzv["steady"]["requests_per_s"]
    assert steady.get("set", 0) > 0 and steady.get("add", 0) > 0 and steady.get("compare_set", 0) == 0, steady
    # the reports and the monitor saw every rank
    assert res["rank_report_train"]["rows"] == res["rank_report_preamble"]["rows"] == N * 8
    assert res["monitor"]["ranks"] == N * 8
    assert res["launcher"]["nodes"] == N and res["launcher"]["cpu_s_per_line"] > 0
    assert res["commit_chain"]["points"][-1]["nodes"] == N
    assert set(data["goals"]) >= {"first_rendezvous_s", "reformation_s", "rank_report_train_s", "monitor_round_s",
                                  "launcher_cores"}
    assert "| one monitor round over N x 8 heartbeats | s |" in (tmp_path / "s.md").read_text()


@pytest.mark.full  # the rank reports at scale: test_bench_scale_sim.py's short run and test_rank_report_scale.py
def test_the_rank_report_alone_goes_into_an_earlier_run_and_keeps_its_first_figures(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    earlier = json.loads((Path(__file__).resolve().parents[1] / "bench/results/scale_sim-small.json").read_text())
    for r in earlier["results"]:
        r.pop("before", None)
    run.write_text(json.dumps(earlier))
    first = {r["nodes"]: r["figures"] for r in earlier["results"]}
    run_bench("bench.scale_sim", "--only", "rank-report", "--nodes", "16", "--into", str(run),
              "--img", str(tmp_path / "img"))
    data = json.loads(run.read_text())
    by_n = {r["nodes"]: r for r in data["results"]}
    assert by_n[16]["rank_report_train"]["rows"] == by_n[16]["rank_report_preamble"]["rows"] == 16 * 8
    assert by_n[16]["before"]["figures"]["rank_report_train_s"] == first[16]["rank_report_train_s"]
    assert by_n[32]["figures"] == first[32] and "before" not in by_n[32]  # an N not measured is left alone
    assert data["rank_report_again"]["nodes"] == [16] and (tmp_path / "img" / "rank_report.png").stat().st_size
    assert [p.name for p in (tmp_path / "img").iterdir()] == ["rank_report.png"]
