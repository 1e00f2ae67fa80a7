"""bench/scale_sim.py's side-by-side rendezvous (`--only rendezvous
--baseline`): a baseline checkout's handlers and this one's, each forming a
first round of N simulated nodes, then re-forming after a crash, on one store
service. Here the baseline is this checkout's last commit (git:HEAD, exported
from its history): what is asserted is that both arms ran and were told
apart, never how fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bench_smoke import run_bench

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
N = 8


@pytest.mark.full  # the rendezvous simulated: tests/test_bench_scale_sim.py::test_scale_sim_short_forms_reforms_and_reports
def test_both_arms_form_reform_and_are_tabled_side_by_side(tmp_path: Path) -> None:
    run_bench("bench.scale_sim", "--only", "rendezvous", "--baseline", "git:HEAD", "--nodes", str(N),
              "--steady-s", "1", "--first-limit-s", "60", "--out", str(tmp_path), "--name", "r",
              "--img", str(tmp_path / "img"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert [(f["nodes"], f["arm"]) for f in data["figures"]] == [(N, "before"), (N, "after")]
    for r in data["results"]:
        assert r["first_ranks_distinct"] and r["reformed_without_lost"] and r["reformed_world"] == N - 1, r
        assert r["first_watch"]["max_participants"] <= N and r["polls"]["state_poll_s"] > 0
    exported = Path(data["results"][0]["src"])
    assert exported.name == "src" and exported.parent != ROOT and data["results"][1]["src"] is None
    assert data["baseline"] == "git:HEAD" and not exported.exists()  # the export is removed after the run
    assert all(r["steady"]["store_requests_per_s"] > 0 for r in data["results"])
    assert f"| N={N} before | N={N} after |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "img" / "rdzv_before_after.png").stat().st_size
