"""`ddpkit train --spawn N` through the installed console command: the
CLI's parsed Namespace carries its handler, a local function
that cannot be pickled into the spawned children; the children get the
frozen TrainConfig instead."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.train.config.values import TrainConfig
from tests.helpers.runs import ROOT, TINY


def console_command() -> str:
    """The `ddpkit` script installed beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("ddpkit")
    found = str(beside) if beside.exists() else shutil.which("ddpkit")
    if found is None:
        pytest.skip("no `ddpkit` console command installed")
    return found


def test_the_config_pickles_and_drops_the_cli_handler() -> None:
    import argparse
    import pickle

    from ddpkit.train.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--spawn", "2", "--batch-size", "8"])
    args.handler = lambda _: 0  # what ddpkit.cli puts there: not picklable
    config = TrainConfig.from_args(args)
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.spawn == 2 and config.batch_size == 8 and not hasattr(config, "handler")


@pytest.mark.slow
def test_ddpkit_train_spawn_2_runs_to_completion(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        env.pop(name, None)
    done = subprocess.run([console_command(), "train", "--spawn", "2", "--device", "cpu", "--backend", "gloo",
                           "--interface", "lo", *TINY, "--synthetic-size", "64", "--batch-size", "8",
                           "--eval-size", "16", "--metrics", str(metrics)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Can't pickle" not in done.stderr
    assert "ddpkit train finished: 4 steps, 1 epoch, world size 2, global batch 16" in done.stdout
    [summary] = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "summary"]
    assert summary["status"] == "finished" and summary["world_size"] == 2


@pytest.mark.slow
def test_a_start_up_fault_under_spawn_is_one_line_and_its_exit_code(tmp_path: Path) -> None:
    """The pre-join check's line, not wrapped in two
    tracebacks from torch.multiprocessing; exit 4 as without --spawn."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
                 "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    done = subprocess.run([console_command(), "train", "--spawn", "2", "--device", "cpu", "--backend", "gloo",
                           "--interface", "doesnotexist0", *TINY, "--synthetic-size", "64", "--max-steps", "1"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 4, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # both ranks fail with it: shown once, and nothing else
    assert lines[0].startswith("ddpkit train: --interface='doesnotexist0': no interface doesnotexist0 on host "), lines
    assert "use --interface auto or one of this host's interfaces: lo=127.0.0.1" in lines[0]


@pytest.mark.full  # one line from the parent: the start-up fault under spawn above
@pytest.mark.slow
def test_a_fault_every_child_hits_is_one_line_from_the_parent(tmp_path: Path) -> None:
    """Past the parent's own checks: both children fail on the model; each
    writes its cause, the parent shows it once with its code, no traceback."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        env.pop(name, None)
    done = subprocess.run([console_command(), "train", "--spawn", "2", "--device", "cpu", "--backend", "gloo",
                           *TINY, "--model", "no.such.module:factory", "--synthetic-size", "64", "--max-steps", "1"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    causes = [line for line in done.stderr.splitlines() if line.startswith("ddpkit train:")]
    assert causes == ["ddpkit train: --model no.such.module:factory: cannot import factory from no.such.module "
                      "(No module named 'no')"], done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_spawn_causes_are_each_shown_once_in_rank_order(tmp_path: Path) -> None:
    from ddpkit.train.main import spawn_causes

    for rank, line in ((10, "b"), (2, "a"), (0, "b"), (1, "a")):
        (tmp_path / f"rank{rank}").write_text(line)
    assert spawn_causes(tmp_path) == ["b", "a"]
    assert spawn_causes(tmp_path / "nothing") == []
