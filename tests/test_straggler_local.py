"""Stragglers on real processes: `ddpkit launch local`, 2 nodes x 2 processes
of `ddpkit train` (torchrun agents, gloo). Rank 1's evaluation is slow (the
others wait for it), rank 0 writes a checkpoint every epoch (the others wait
for it), and from step SLOW_FROM on rank 2 sleeps SLOW_S in its data loading
at every step (DDPKIT_TEST_SLOW_RANK, train/watchdog/worktime.py). Rank 2 must be named
a straggler once it stayed slow as long as the judge's rule asks (SUSTAIN_STEPS
and SUSTAIN_S after its median turned, train/watchdog/straggler.py), within 45
steps of becoming slow, and nobody else ever: not the
rank with the slow evaluation, not the ranks that wait, not before step
SLOW_FROM (two uneven evaluations and checkpoints happened by then)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from ddpkit.train.watchdog.straggler import SUSTAIN_STEPS
from tests.test_launch_local import clean_env, launch_argv
from tests.test_startup import ROOT

SLOW_RANK, SLOW_FROM, SLOW_S = 2, 26, 0.6  # 30 steps of 0.6 s: the rule's 20 s pass within its steps
NAMED_WITHIN = 45  # steps: 6 turn the median, SUSTAIN_STEPS (30) keep it slow, a few for the checks
EVAL_RANK = 1
pytestmark = pytest.mark.slow


@pytest.mark.full  # the judge on real processes: test_preamble.py; an evaluation is no step: test_straggler.py
def test_a_slowed_rank_is_named_and_a_slow_evaluation_is_not(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    # 200 samples / 4 ranks / batch 4: 12 steps an epoch, each ending with an
    # evaluation (4 batches, 0.25 s each on rank 1) and a checkpoint. The job
    # ends NAMED_WITHIN steps after the slowdown: the straggler must be named by then.
    argv = launch_argv("--nodes", "2", "--nproc-per-node", "2", "--grace", "5", "--",
                       "--model", "tests.helpers.straggler_models:slow_eval", "--image-size", "8", "--workers", "0",
                       "--progress", "plain", "--log-every", "1", "--data", "synthetic", "--batch-size", "4",
                       "--synthetic-size", "200", "--eval-size", "64", "--epochs", "7",
                       "--max-steps", str(SLOW_FROM + NAMED_WITHIN),
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics", str(metrics))
    env = clean_env(DDPKIT_TEST_SLOW_RANK=f"{SLOW_RANK}:{SLOW_S}:{SLOW_FROM}",
                    STRAGGLER_TEST_EVAL_RANK=str(EVAL_RANK), STRAGGLER_TEST_EVAL_SLEEP_S="0.25")
    res = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    assert len([s for s in evals if s < SLOW_FROM]) == 2, evals  # the slow evaluations before the slowdown
    stragglers = [r for r in records if r["kind"] == "straggler"]
    assert [(r["rank"], r["state"]) for r in stragglers] == [(SLOW_RANK, "slow")], (stragglers, text)
    [named] = stragglers
    assert SLOW_FROM + SUSTAIN_STEPS <= named["step"] <= SLOW_FROM + NAMED_WITHIN, named
    # The other ranks wait SLOW_S at every step for rank 2: not counted as their own work.
    assert named["own_s"] >= SLOW_S and named["median_s"] < SLOW_S / 5 and named["node"] == 1, named
    line = re.search(rf"\[node0 rank0\] ddpkit watchdog: STRAGGLER rank {SLOW_RANK} node 1 host (\S+): "
                     r"\d\.\d{3}s of own work a step against the job's median 0\.\d+s \(\d+\.\dx, limit 1\.33x\) "
                     rf"at step {named['step']}", text)
    assert line and line.group(1) == named["host"], text
    assert text.count("ddpkit watchdog: STRAGGLER") == 1, text
    # The summary's straggler column, on node 1's row only.
    assert re.search(rf"node1\s*│\s*0\s*│\s*ok\s*│.*│\s*rank {SLOW_RANK} \({named['host']}\): \d\.\d{{3}}s of own", text), text
    assert not re.search(r"node0\s*│\s*0\s*│\s*ok\s*│.*│\s*rank \d", text), text
    # The record's step is rank 2's when it last published; the job may be a
    # few steps further when rank 0 names it: its progress line before the name.
    shown = re.findall(r"\[node0 rank0\] step (\d+)/", text[:text.index("ddpkit watchdog: STRAGGLER")])
    assert shown and int(shown[-1]) <= SLOW_FROM + NAMED_WITHIN, text
    print(f"rank {SLOW_RANK} slowed from step {SLOW_FROM}: named with its step {named['step']}, rank 0 at step "
          f"{shown[-1]} ({int(shown[-1]) - SLOW_FROM} steps): {named['own_s']:.3f}s against {named['median_s']:.3f}s")
