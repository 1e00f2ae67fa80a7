"""The programs people run, as they are, with no call into ddpkit: a Hugging
Face Transformers `Trainer` script and a Lightning `Trainer` script
(tests/helpers/hf_trainer.py, lightning_trainer.py) under `ddpkit launch
local`, 2 nodes x 1 process, gloo. Each gets the rank table and the hang
watchdog from ddpkit's preamble; a SIGSTOPped rank is named and the job
stopped with exit 13."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.rank_table import pid_of
from tests.test_preamble import Job, freeze_rank_1_and_expect_the_stall, run
from tests.test_startup import ROOT

HELPERS = ROOT / "tests" / "helpers"
PROGRAMS = {
    "hf": (HELPERS / "hf_trainer.py", lambda tmp, epochs: [str(tmp / "hf-out"), str(epochs)]),
    "lightning": (HELPERS / "lightning_trainer.py", lambda tmp, epochs: [str(tmp / "lt-out"), str(epochs), "2"]),
}
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


@pytest.mark.full  # a frozen rank of a program of the user's own: test_preamble.py
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_frozen_rank_of_a_framework_trainer_is_named_and_the_job_stopped(tmp_path: Path, program: str) -> None:
    script, args = PROGRAMS[program]
    freeze_rank_1_and_expect_the_stall(Job(tmp_path, script, *args(tmp_path, 10_000)))
