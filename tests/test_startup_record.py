"""The trainer's own start-up timings: the `startup` metrics record written by
rank 0 after its first step, and the process start time it is measured from.
Real `ddpkit train` runs; no duration is asserted, only that the stamps are
in order and the phases account for the whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.train.startup.clock import STAMPS, StartupClock
from tests.helpers.runs import ROOT, alone, metrics, run_ok, torchrun
from tests.helpers.tiers import one_case_in_ci

TICK = 1 / os.sysconf("SC_CLK_TCK")  # resolution of the kernel's process start time
RESNET = ["--model", "resnet18", "--image-size", "32", "--synthetic-size", "8", "--batch-size", "2",
          "--max-steps", "2", "--no-eval", "--workers", "0", "--progress", "plain", "--log-every", "1"]


def check_record(rec: dict, launched: float) -> None:
    stamps = rec["stamps"]
    assert list(stamps) == [name for name, _ in STAMPS]  # every stamp, in the order the phases run
    values = list(stamps.values())
    assert values == sorted(values), stamps
    # the kernel's start time is truncated to a tick, never later than the real start
    assert launched - TICK <= stamps["process_start"] and rec["process_start_from"] == "/proc/self/stat"
    phases = rec["phases"]
    assert list(phases) == [phase for _, phase in STAMPS[1:]]
    for (prev, _), (stamp, phase) in zip(STAMPS, STAMPS[1:]):
        assert phases[phase] == pytest.approx(stamps[stamp] - stamps[prev], abs=1e-9), phase
    assert rec["total"] == pytest.approx(stamps["first_step_done"] - stamps["process_start"], abs=1e-9)
    assert sum(phases.values()) == pytest.approx(rec["total"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", one_case_in_ci(["torchrun", "spawn"], keep="torchrun"))
def test_train_writes_one_ordered_startup_record(tmp_path: Path, launcher: str) -> None:
    args = [*RESNET, "--metrics", str(tmp_path / "m.jsonl")]
    launched = time.time()
    job = torchrun(tmp_path, 1, 2, args) if launcher == "torchrun" else alone(tmp_path, [*args, "--spawn", "2"])
    out = run_ok(job)
    rows = metrics(tmp_path / "m.jsonl")
    [rec] = [r for r in rows if r["kind"] == "startup"]
    check_record(rec, launched)
    # written after the first step, before its train line; one per run, from rank 0
    kinds = [r["kind"] for r in rows]
    assert kinds.index("startup") < kinds.index("train")
    assert rec["pid"] not in (p.pid for p in job.procs)  # a worker, not the launcher
    line = next(ln for ln in out.splitlines() if "INFO start-up " in ln)
    assert "rank0" in line and ": imports " in line and ", first step " in line


def test_process_start_is_when_the_interpreter_began(tmp_path: Path) -> None:
    code = ("import time; first = time.time()\n"
            "from ddpkit.train.startup.distributed import process_start\n"
            "import json; print(json.dumps([first, *process_start()]))")
    before = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    first, start, source = json.loads(done.stdout)
    assert source == "/proc/self/stat"
    assert before - TICK <= start <= first


def test_phases_skip_a_stamp_never_taken() -> None:
    clock = StartupClock(stamps={"process_start": 10.0, "imports_done": 12.0, "model_built": 12.5,
                                 "first_step_done": 13.0}, process_start_from="given")
    assert clock.phases() == {"imports": 2.0, "model": 0.5, "first step": 0.5}
    assert clock.record()["total"] == 3.0
    assert clock.line() == "start-up 3.00 s: imports 2.00, model 0.50, first step 0.50"
    with pytest.raises(ValueError, match="unknown start-up stamp"):
        clock.mark("lunch")
