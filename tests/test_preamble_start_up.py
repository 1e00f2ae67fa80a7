"""A rank of a program of the user's own stuck in its start-up: the tutorial
script (tests/helpers/tutorial_ddp.py, through tutorial_start_up.py) under
`ddpkit launch local`, 2 nodes x 1 process on gloo, one rank's checkpoint
read in trouble while the other waits in DDP's broadcast of the parameters.
Stuck (a named pipe nobody writes, standing in for a hung filesystem): the
rank is named with the line it sits on, its stacks are in its file in the
run folder, the job ends with exit 13 within seconds of first_step_s, not
at the collective timeout (30 minutes). Slow but moving: not stopped."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from ddpkit.shared.exitcodes import ExitCode
from tests.test_preamble import Job, run_folder, stacks_are_in_files_and_the_console_says_where
from tests.test_startup import ROOT

START_UP = ROOT / "tests" / "helpers" / "tutorial_start_up.py"
FIRST_STEP_S = 10
COLLECTIVE_TIMEOUT_S = 1800  # torch's default for gloo: what the waiting rank would sit out without the watchdog
TUTORIAL_ARGS = ("2", "1", "--batch_size", "8")
pytestmark = pytest.mark.slow


def launch(tmp: Path, *args: str) -> Job:
    return Job(tmp, START_UP, *args, *TUTORIAL_ARGS, launch=("--set", f"watchdog.first_step_s={FIRST_STEP_S}"))


def test_a_rank_stuck_in_its_checkpoint_read_is_named_and_the_job_stopped(tmp_path: Path) -> None:
    """Rank 1's torch.load of its snapshot never returns; rank 0 waits for it. The console reads
    as the user reads it: the verdict, the rank and its line, one line saying where the stacks are,
    and no stack itself."""
    hung = tmp_path / "hung-snapshot.pt"
    os.mkfifo(hung)
    job = launch(tmp_path, "--stuck", f"1:{hung}")
    started = time.monotonic()
    try:
        job.wait_for(r"rank report: 2 processes")
        code = job.finish(FIRST_STEP_S + 200)  # the bound is asserted below; this only ends a broken run
    finally:
        if job.proc.poll() is None:
            job.finish(10)
    took = time.monotonic() - started
    time.sleep(0.1)  # the reader thread takes the last lines
    text = job.text
    assert code == ExitCode.STALLED, text
    assert job.left == [], "a process of the job outlived it"
    assert took < 150, f"{took:.0f}s from the launch to its end (vs {COLLECTIVE_TIMEOUT_S}s)\n{text}"
    assert re.search(r"STALL rank 1 node 1 host \S+ pid \d+: step 0, phase setup, at \S+/torch/serialization\.py:\d+ "
                     r"in \w+ \(called from \S+tutorial_ddp\.py:\d+ in _load_snapshot\)", text), text
    # what the user reads last: the rank and the call it sits in
    assert re.search(r"the hang watchdog found stalled rank\(s\): rank 1 \(node 1, \S+\) at \S+/torch/serialization\.py:"
                     r"\d+ in \w+ \(called from \S+tutorial_ddp\.py:\d+ in _load_snapshot\); ", text.splitlines()[-1]), text
    stacks_are_in_files_and_the_console_says_where(text)
    stuck = (run_folder(text) / "logs" / "node1" / "stall-rank1.txt").read_text()
    assert re.search(r'File "\S+/torch/serialization\.py", line \d+ in load\n\s+File "\S+tutorial_ddp\.py", line \d+ '
                     r"in _load_snapshot", stuck), stuck
    records = [json.loads(line) for line in (run_folder(text) / "metrics.jsonl").read_text().splitlines()]
    [stall] = [r for r in records if r["kind"] == "stall"]
    assert [(s["rank"], s["phase"]) for s in stall["stalled"]] == [(1, "setup")] and stall["waiting"] == [0], stall


@pytest.mark.full  # test_preamble_start_up.py::test_a_rank_stuck_in_its_checkpoint_read_is_named_and_the_job_stopped
def test_a_rank_slow_in_its_checkpoint_read_but_moving_is_not_stopped(tmp_path: Path) -> None:
    """The control: rank 1 reads its snapshot a little at a time for twice first_step_s while
    rank 0 waits for it; then both train to the end."""
    torch.save({"MODEL_STATE": torch.nn.Linear(20, 1).state_dict(), "EPOCHS_RUN": 0}, tmp_path / "snapshot.pt")
    job = launch(tmp_path, "--slow", f"1:{2 * FIRST_STEP_S}")
    code = job.finish(300)
    time.sleep(0.1)
    text = job.text
    assert code == 0, text
    assert text.count("Resuming training from snapshot") == 2, text
    assert "ddpkit watchdog: on for this script" in text and "STALL" not in text, text
    assert re.search(r"\[node0 rank0\] ddpkit watchdog: rank 1 \(node 1, \S+\) is still starting up 1\ds after the "
                     r"others began to wait for it; it moves, so it is slow, not stuck", text), text


@pytest.mark.full  # test_preamble_start_up.py::test_a_rank_stuck_in_its_checkpoint_read_is_named_and_the_job_stopped
def test_a_rank_whose_first_batch_never_comes_is_named_in_its_data_loader(tmp_path: Path) -> None:
    """Rank 1's data loader reads its first batch from a named pipe nobody writes; rank 0 took
    its batch and waits in its first backward's all-reduce."""
    hung = tmp_path / "hung-shard"
    os.mkfifo(hung)
    job = launch(tmp_path, "--stuck-batch", f"1:{hung}")
    try:
        code = job.finish(FIRST_STEP_S + 200)
    finally:
        if job.proc.poll() is None:
            job.finish(10)
    time.sleep(0.1)
    text = job.text
    assert code == ExitCode.STALLED, text
    assert job.left == [], "a process of the job outlived it"
    assert re.search(r"STALL rank 1 node 1 host \S+ pid \d+: step 0, phase setup, at \S+tutorial_start_up\.py:\d+ "
                     r"in fetch_from_a_hung_filesystem", text), text
    stuck = (run_folder(text) / "logs" / "node1" / "stall-rank1.txt").read_text()
    assert re.search(r'File "\S+/torch/utils/data/dataloader\.py", line \d+ in __next__\n\s+File "\S+tutorial_ddp\.py", '
                     r"line \d+ in _run_epoch", stuck), stuck
    waiting = (run_folder(text) / "logs" / "node0" / "stall-rank0.txt").read_text()
    assert "in backward" in waiting and "in _run_batch" in waiting, waiting
