"""The programs people run, as they are, with no call into ddpkit: a Hugging
Face Transformers `Trainer` script and a Lightning `Trainer` script
(tests/helpers/hf_trainer.py, lightning_trainer.py) under `ddpkit launch
local`, 2 nodes x 1 process, gloo. Each gets the rank table and the hang
watchdog from ddpkit's preamble, and metrics in the unit of its batch
(tokens for the Trainer's `input_ids`, samples for Lightning's tensors) up to
its last step; Lightning's default (rich) progress bar shows on the console
while it trains; a SIGSTOPped rank is named and the job stopped with exit 13."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.runs import all_runs
from tests.helpers.rank_table import pid_of
from tests.test_preamble import Job, freeze_rank_1_and_expect_the_stall, run
from tests.test_startup import ROOT

HELPERS = ROOT / "tests" / "helpers"
PROGRAMS = {
    "hf": (HELPERS / "hf_trainer.py", lambda tmp, epochs: [str(tmp / "hf-out"), str(epochs)]),
    "lightning": (HELPERS / "lightning_trainer.py", lambda tmp, epochs: [str(tmp / "lt-out"), str(epochs), "2"]),
}
# What each program's batch counts, and its optimizer steps in 2 epochs of 256 samples on 2 ranks
BATCH = {"hf": ("tokens", 32), "lightning": ("samples", 16)}
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_framework_trainer_gets_the_rank_table_and_the_watchdog(tmp_path: Path, program: str) -> None:
    script, args = PROGRAMS[program]
    code, text = run(tmp_path, *args(tmp_path, 2), script=script)
    assert code == 0, text
    lines = text.splitlines()
    assert pid_of(lines, 0) is not None and pid_of(lines, 1) is not None, text
    assert "ddpkit watchdog: on for this script" in text and "STALL" not in text
    assert text.rstrip().endswith("launch local: every node finished"), text[-500:]
    unit, steps = BATCH[program]
    train, windows = metrics_of(text)
    assert [r.step for r in train] == [*range(10, steps, 10), steps], train
    assert all(r.unit == unit and r.images_per_s > 0 for r in train), train
    assert [w.step for w in windows][-1] == steps, windows  # the heat map's last window: the last step
    if program == "lightning":
        bar_while_training(lines)


def metrics_of(text: str) -> tuple[list[records.Train], list[records.StepTimes]]:
    [run_id] = re.findall(r"\(ddpkit status (\w+)\)", text)
    [run] = [r for r in all_runs() if r.record.id == run_id]
    stamped = [s.record for s in records.read_file(run.folder.metrics_file)]
    return ([r for r in stamped if isinstance(r, records.Train)],
            [r for r in stamped if isinstance(r, records.StepTimes)])


def bar_while_training(lines: list[str]) -> None:
    """Lightning's rich bar, on rank 0, as lines while it trained: its first
    epoch's state (rich alone prints only its final state, `Epoch 1/1` 8/8,
    when training ended), in plain text: no cursor escapes."""
    bars = [line.split()[2:] for line in lines if line.startswith("[node0 rank0] Epoch ")]
    assert ["Epoch", "0/1"] in [bar[:2] for bar in bars], lines
    assert bars[-1][:2] == ["Epoch", "1/1"] and "8/8" in bars[-1], bars  # and the final state
    assert not any("\x1b" in line or "\r" in line for line in lines)


@pytest.mark.full  # a frozen rank of a program of the user's own: test_preamble.py
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_frozen_rank_of_a_framework_trainer_is_named_and_the_job_stopped(tmp_path: Path, program: str) -> None:
    script, args = PROGRAMS[program]
    freeze_rank_1_and_expect_the_stall(Job(tmp_path, script, *args(tmp_path, 10_000)))


class TimedJob(Job):
    """A Job whose lines keep the time they reached the console."""

    def _read(self) -> None:
        self.arrived: list[tuple[float, str]] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.arrived.append((time.monotonic(), line))
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()


@pytest.mark.full  # test_own_frameworks.py::test_a_framework_trainer_gets_the_rank_table_and_the_watchdog
def test_lightnings_rich_bar_is_a_line_every_ten_seconds_while_it_trains(tmp_path: Path) -> None:
    """3 epochs of 8 steps of 1 s: rank 0's bar as a line at once, then one
    every 10 s (2 while it trains, at least), then rich's final state."""
    script, args = PROGRAMS["lightning"]
    job = TimedJob(tmp_path, script, *args(tmp_path, 3), launch=("--set", "env.STEP_SLEEP_S=1"))
    assert job.finish(300) == 0, job.text
    time.sleep(0.1)
    bars = [(at, line) for at, line in job.arrived if line.startswith("[node0 rank0] Epoch ")]
    during = bars[:-1]  # the last: rich's own final state
    assert len(during) >= 2 and "24/24" not in bars[-1][1] and "8/8" in bars[-1][1], bars
    gaps = [later[0] - earlier[0] for earlier, later in zip(during, during[1:], strict=False)]
    assert all(9.0 <= gap <= 13.0 for gap in gaps[:-1]), gaps  # the last may be the end's: shorter
