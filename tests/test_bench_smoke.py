"""Each benchmark script runs end to end with the tiniest settings (real
torchrun workers, one process, a step or two) and writes JSON with the fields
docs/BENCHMARKS.md relies on. No timing is asserted: only that every figure
is there and positive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_bench(module: str, *args: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    # a failure's cause is often in the nodes' output the benchmark appends (bench.recovery.work_folder)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-8000:]


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_train_throughput_writes_every_entry_and_ratio(tmp_path: Path) -> None:
    # One entry of each kind: the others differ only in ddpkit train's flags.
    run_bench("bench.train_throughput", "--only", "resnet18", "--repeats", "1", "--nproc", "1",
              "--batch-size", "2", "--warmup", "1", "--measure", "1", "--entries", "ceiling:eager,reference,ddpkit",
              "--out", str(tmp_path), "--name", "t")
    data = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 0
    assert data["machine"]["torch"] and data["command"]
    [res] = data["results"]
    assert res["workload"] == {"model": "resnet18", "image_size": 32, "batch": 2, "nproc": 1,
                               "warmup": 1, "measure": 1}
    kinds = {e["kind"] for e in res["entries"].values()}
    assert kinds == {"ceiling", "reference", "ddpkit"}
    for name, entry in res["entries"].items():
        assert len(entry["images_per_s"]) == 1 and entry["images_per_s"][0] > 0, name
    assert set(res["ratios"]) == {"ddpkit/reference", "ddpkit/ceiling", "reference/ceiling"}
    assert all(v > 0 for v in res["ratios"].values())


def test_throughput_entries_must_name_known_entries_of_every_kind() -> None:
    from bench.train_throughput import chosen_entries

    assert [e.name for e in chosen_entries("cpu", False, ["ddpkit", "reference", "ceiling:eager"])] == [
        "ceiling:eager", "reference", "ddpkit"]
    with pytest.raises(SystemExit, match="no entry 'ddpkit --turbo'; choose from 'ceiling:eager'"):
        chosen_entries("cpu", False, ["ddpkit --turbo", "reference"])
    with pytest.raises(SystemExit, match="leaves no ceiling entry"):
        chosen_entries("cpu", False, ["ddpkit", "reference"])


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_startup_phases_add_up_to_total(tmp_path: Path) -> None:
    run_bench("bench.startup", "--nproc", "1", "--repeats", "1", "--batch-size", "2", "--workers", "0",
              "--out", str(tmp_path), "--name", "s")
    data = json.loads((tmp_path / "s.json").read_text())
    assert (tmp_path / "s.png").stat().st_size > 0
    assert data["agents"] == ["torch.distributed.run", "ddpkit.agent"]
    measured = ("launcher + interpreter", "imports", "rendezvous", "rank report", "model build", "data",
                "first step")
    for agent in data["agents"]:
        [run] = data["runs"][agent]
        for phase in measured:
            assert run[phase] > 0, (agent, phase)
        assert run["total"] == pytest.approx(sum(run[p] for p in (*measured, "other")))
        assert run["other"] > -0.05  # the measured phases never overlap (clock granularity aside)
        assert run["cpu"] > 0, agent  # the tree's CPU, zygote and workers included
    assert set(data["ratios"]) == {"total torch.distributed.run / ddpkit.agent",
                                   "cpu torch.distributed.run / ddpkit.agent"}


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_ceiling_rejects_unknown_variant(tmp_path: Path) -> None:
    """Bad input fails the run loudly instead of writing a figure."""
    from bench import common

    with pytest.raises(RuntimeError, match="exited"):
        common.torchrun(1, [str(ROOT / "bench" / "ceiling.py"), "--variant", "turbo", "--timing",
                            str(tmp_path / "t.jsonl")])
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_teardown_local_times_both_launchers(tmp_path: Path) -> None:
    # Measured to the end, however loaded the machine: plain torchrun's teardown, about 2 s on an idle
    # machine, outlasted the benchmark's 20 s cap beside the suite in a fresh-clone run (ci31).
    run_bench("bench.teardown_local", "--repeats", "1", "--nodes", "2", "--nproc", "1", "--cap-s", "180",
              "--out", str(tmp_path), "--name", "td")
    data = json.loads((tmp_path / "td.json").read_text())
    assert data["machine"]["torch"] and data["command"]
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"ddpkit launch local", "plain torchrun"}
    for method, run in runs.items():
        assert run["seconds"] is not None and run["seconds"] > 0, (method, run["note"])


@pytest.mark.root
def test_launch_bench_times_start_and_teardown_on_real_hosts(tmp_path: Path) -> None:
    """bench/launch.py on two namespace hosts, one method, no torch runs."""
    import shutil

    from tests.infra import netns, sshd

    reason = netns.available() or sshd.available() or (None if shutil.which("pdsh") else "needs pdsh")
    if reason or os.geteuid() != 0:
        pytest.skip(reason or "needs root")
    run_bench("bench.launch", "--sizes", "2", "--methods", "ddpkit launch ssh", "--repeats", "1",
              "--torch-hosts", "0", "--out", str(tmp_path), "--name", "l")
    data = json.loads((tmp_path / "l.json").read_text())
    assert (tmp_path / "l.png").stat().st_size > 0
    assert data["machine"]["torch"] and data["command"]
    kinds = {(r["kind"], r["method"]): r for r in data["summary"]}
    assert set(kinds) == {("start", "ddpkit launch ssh"), ("teardown", "ddpkit launch ssh")}
    for key, row in kinds.items():
        assert row["spread"] and row["spread"]["mean"] > 0, (key, row["notes"])


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_watchdog_bench_stops_the_job_and_simulates_the_store(tmp_path: Path) -> None:
    # ddpkit's stop is bounded against the fallback it rules out (torchrun's 30-minute collective timeout),
    # not against an idle machine; plain torchrun is watched for 8 s: it must still be running then
    run_bench("bench.watchdog", "--ranks", "64", "--stall-s", "4", "--cap", "150", "--torchrun-cap", "8",
              "--calls", "2000", "--out", str(tmp_path), "--name", "w")
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["stop"]["ddpkit"]["exit_code"] == 13 and data["stop"]["ddpkit"]["named_rank_3"]
    assert data["stop"]["ddpkit"]["stopped_by_itself"], data["stop"]["ddpkit"]
    assert not data["stop"]["torchrun"]["stopped_by_itself"] and data["stop"]["torchrun"]["seconds"] >= 8
    assert data["heartbeat"]["loop_ns_per_step"] > 0 and data["heartbeat"]["publish_us"] > 0
    [scale] = data["scale"]
    assert scale["ranks"] == 64 and scale["check_ms_median"] > 0 and scale["named"] == [63]


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_own_work_bench_times_every_variant(tmp_path: Path) -> None:
    run_bench("bench.own_work", "--rounds", "1", "--steps", "5", "--warmup", "3", "--out", str(tmp_path))
    data = json.loads((tmp_path / "own_work.json").read_text())
    assert set(data["median_us"]) == {"off", "stragglers", "stragglers, builtin hook"}
    assert all(v > 0 for v in data["median_us"].values()) and set(data["added_us"]) == {"stragglers",
                                                                                      "stragglers, builtin hook"}


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_rendezvous_bench_times_the_round_after_a_crash_per_variant(tmp_path: Path) -> None:
    run_bench("bench.rendezvous", "--repeats", "1", "--losses", "crash", "--variants", "c10d,ddpkit",
              "--out", str(tmp_path), "--name", "r")
    data = json.loads((tmp_path / "r.json").read_text())
    assert [(t["variant"], t["loss"], t["world_size"]) for t in data["trials"]] == [("c10d", "crash", 2),
                                                                                   ("ddpkit", "crash", 2)]
    assert all(t["seconds"] > 0 for t in data["trials"]) and set(data["medians"]["crash"]) == {"c10d", "ddpkit"}
    assert set(data["ratios"]) == {"crash: c10d / ddpkit"}
