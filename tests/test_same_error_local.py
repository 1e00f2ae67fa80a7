"""The same crash again and again, on real processes: `ddpkit launch local`,
2 nodes x 1 process, elastic (max_restarts 3, min_nodes 2: every round
waits for both nodes, so on a busy machine a slow agent is not left out of
the restart's round, where rank 1, the one that fails, would then not
exist), torchrun-style agents talking gloo.

- A program that raises the same error at the same step at every start
  (a program of the user's own, and `ddpkit train` with a bug in its step):
  one restart is burned, not max_restarts; the agent that saw it twice ends
  with exit 76, the launcher stops the job without bringing a node back,
  exits 76, and its closing line names the rank, the file and the line.
- The control: a worker SIGKILLed at the same step at two starts (and its
  peer's gloo connection reset with it) is a fault, not a bug: restarted
  each time, and the job completes.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import ROOT, TINY
from tests.helpers.tiers import one_case_in_ci
from tests.test_launch_local import clean_env, launch_argv

pytestmark = pytest.mark.slow

HELPERS = ROOT / "tests" / "helpers"
SCRIPT = HELPERS / "same_error.py"
ELASTIC = ("--nodes", "2", "--nproc-per-node", "1", "--grace", "5", "--set", "elastic.min_nodes=2",
           "--set", "elastic.max_restarts=3", "--set", "env.OMP_NUM_THREADS=1")
TRAIN = [*TINY, "--synthetic-size", "64", "--batch-size", "4", "--epochs", "1", "--no-eval", "--device", "cpu",
         "--backend", "gloo"]


def bad_line(path: Path, text: str) -> int:
    """The line of `path` that holds `text` (where the program raises)."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def launch(tmp: Path, *argv: str) -> tuple[int, str, float]:
    began = time.monotonic()
    done = subprocess.run(launch_argv(*ELASTIC, *argv), env=clean_env(PYTHONPATH=f"{ROOT}:{ROOT / 'src'}"), cwd=tmp,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, check=False)
    return done.returncode, done.stdout, time.monotonic() - began


@pytest.mark.parametrize("program", one_case_in_ci(["own", "train"], keep="own"))
def test_the_same_error_after_a_restart_stops_the_job_as_a_bug(tmp_path: Path, program: str) -> None:
    if program == "own":
        code, out, took = launch(tmp_path, "--set", f"command.script={SCRIPT}", "--set", "env.SAME_ERROR_MODE=raise")
        where = f"{SCRIPT}:{bad_line(SCRIPT, 'raise ValueError')}"
        starts = [int(n) for n in re.findall(r"^\[node\d rank1\] start restart=(\d+) rank=1", out, re.M)]
    else:
        helper = HELPERS / "train_same_error.py"
        code, out, took = launch(tmp_path, "--set", "command.module=tests.helpers.train_same_error", "--", *TRAIN)
        where = f"{helper}:{bad_line(helper, 'raise ValueError')}"
        starts = sorted({0, *(int(n) for n in re.findall(r"elastic: restart (\d+) of at most 3", out))})
    flat = " ".join(out.split())
    print(f"SAME-ERROR {program}: exit {code} after {took:.1f} s, starts {starts}")
    assert code == ExitCode.SAME_ERROR, out[-5000:]
    assert starts == [0, 1], out[-5000:]  # one restart burned, not max_restarts' 3
    assert "is back after it failed" not in out, out[-5000:]  # no node brought back either
    closing = (f"failed first: the same error twice, rank 1, {where}: a bug in the program, not a fault of the "
               "machine; every other node was stopped")
    assert re.search(r"launch local: node 1 \(\S+\) " + re.escape(closing), flat), flat[-3000:]
    assert flat.count("failed first:") == 1 and "exited with code" not in flat, flat[-3000:]  # said once
    assert "Traceback (most recent call last)" not in out, out[-5000:]  # one line a cause, tracebacks in the logs


def test_a_worker_killed_at_the_same_step_twice_is_restarted_and_the_job_completes(tmp_path: Path) -> None:
    code, out, took = launch(tmp_path, "--set", f"command.script={SCRIPT}", "--set", "env.SAME_ERROR_MODE=kill")
    print(f"SAME-ERROR control: SIGKILLed at two starts, exit {code} after {took:.1f} s")
    assert code == 0, out[-5000:]
    assert re.findall(r"^\[node\d rank1\] start restart=(\d+) rank=1", out, re.M) == ["0", "1", "2"], out[-5000:]
    assert "done restart=2 rank=1" in out and "same error twice" not in out, out[-5000:]
    assert out.rstrip().splitlines()[-1].startswith("launch local: every node finished"), out[-800:]
