"""bench/scale.py's short version end to end: `ddpkit launch ssh` on real
sshd hosts (network namespaces), `ddpkit train` and a program of the user's
own, one host's processes SIGKILLed and the survivors training again. What
happened is asserted (every host in the first step's world, every figure
there and positive, the run ended by the bench's Ctrl-C), never how fast
(tests/test_bench_smoke.py says what a smoke test asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.infra import netns, sshd
from tests.test_bench_smoke import run_bench

_REASON = netns.available() or sshd.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

COMMON = ("launcher_cpu_s", "launcher_cpu_to_first_step_s", "launcher_peak_rss_mb", "console_lines_per_s",
          "host_memory_mb_mean", "first_step_s", "to_workers_s", "recovery_s")
PER_PROGRAM = {"ddpkit train": ("process_group_s", "rank_report_s"), "own program": ("process_group_and_report_s",)}


def check(data: dict, nodes: list[int], tmp_path: Path) -> None:
    assert data["machine"]["torch"] and data["command"] and data["crash"]
    assert data["stopped"] == {}
    hosts = {n: [f"h{i:02d}" for i in range(1, n + 1)] for n in nodes}
    assert sorted((r["program"], r["nodes"]) for r in data["results"]) == sorted(
        (p, n) for p in PER_PROGRAM for n in nodes)
    for r in data["results"]:
        what = (r["program"], r["nodes"])
        # the first step was taken by a world of every host, each once (the rank report's rows)
        assert r["rank_hosts"] == hosts[r["nodes"]] and r["first_world"] == r["nodes"], what
        assert r["exit_code"] == 130, what  # the bench's Ctrl-C after the survivors trained, not a failure
        assert r["stopped_at_start"] == [], what  # no worker stopped, no node left out before the first step
        assert r["trained_steps"] >= 13, what  # 8 before the crash, 5 after the survivors' first
        expected = {*COMMON, *PER_PROGRAM[r["program"]]}
        assert set(r["figures"]) == expected, what
        assert all(v > 0 for v in r["figures"].values()), (what, r["figures"])
        assert len(r["host_memory_mb"]) == r["nodes"] and all(m > 0 for m in r["host_memory_mb"]), what
    for png in ("real_start.png", "real_launcher.png"):
        assert (tmp_path / "img" / png).stat().st_size > 0
    assert "| ddpkit train | command to rank 0's first step | s |" in (tmp_path / "s.md").read_text()


@pytest.mark.full  # a bench on real hosts: tests/test_bench_smoke.py::test_launch_bench_times_start_and_teardown_on_real_hosts
def test_scale_bench_trains_on_every_host_and_measures_each_figure(tmp_path: Path) -> None:
    run_bench("bench.scale", "--short", "--out", str(tmp_path), "--img", str(tmp_path / "img"), "--name", "s")
    check(json.loads((tmp_path / "s.json").read_text()), [2], tmp_path)


@pytest.mark.full  # a bench on real hosts: tests/test_bench_smoke.py::test_launch_bench_times_start_and_teardown_on_real_hosts
def test_scale_bench_on_two_and_three_hosts_fits_each_figure(tmp_path: Path) -> None:
    run_bench("bench.scale", "--nodes", "2,3", "--out", str(tmp_path), "--img", str(tmp_path / "img"),
              "--name", "s")
    data = json.loads((tmp_path / "s.json").read_text())
    check(data, [2, 3], tmp_path)
    for program, measures in data["analysis"].items():
        for name, g in measures.items():
            assert g["n"] == [2, 3] and len(g["values"]) == 2, (program, name)
