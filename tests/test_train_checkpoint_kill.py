"""A SIGKILL that lands while a checkpoint is being written never leaves a
corrupt `latest`: a real writer process, killed at random instants and,
until enough have landed there, inside a write."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddpkit.train.checkpoint.files import latest_checkpoint, read_checkpoint, write_checkpoint

WRITER = """
import sys, torch
from pathlib import Path
from ddpkit.train.checkpoint.files import write_checkpoint
d = Path(sys.argv[1]); step = int(sys.argv[2])
print("ready", flush=True)
while True:
    step += 1
    write_checkpoint(d, step, {"step": step, "w": torch.full((4_000_000,), float(step))}, keep=2)
"""
RANDOM_KILLS = 4  # at any instant: between writes, in the pointer's write, in the pruning
TORN_WANTED = 2  # kills seen to land inside a checkpoint's write
ROUNDS_MAX = 16  # a kill timed into a write misses only when the write ends between the poll and the signal
TMP_GLOB = ".ckpt-*.tmp-*"


def _in_a_write(directory: Path, proc: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    """Wait until the writer has a checkpoint's temporary file open, then a random instant inside it."""
    end = time.monotonic() + deadline_s
    while not any(directory.glob(TMP_GLOB)):
        assert proc.poll() is None, f"the writer exited with {proc.returncode} before writing"
        assert time.monotonic() < end, f"no checkpoint write began within {deadline_s:.0f} s"
        time.sleep(0.001)
    time.sleep(random.uniform(0.0, 0.003))


def _kill_one(directory: Path, step: int, into_a_write: bool) -> bool:
    """Start a writer from `step`, SIGKILL it; True when the kill left a write unfinished."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(step)], env=env,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None  # stdout=PIPE
    try:
        assert proc.stdout.readline() == b"ready\n"
        if into_a_write:
            _in_a_write(directory, proc)
        else:
            time.sleep(random.uniform(0.2, 1.0))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    return any(directory.glob(TMP_GLOB))


def _check_latest(directory: Path) -> int:
    """`latest` names a complete checkpoint whose contents are its step's; returns that step (0: none yet)."""
    path = latest_checkpoint(directory)
    if path is None:
        return 0  # killed before the first checkpoint was complete
    state = read_checkpoint(path, "cpu")
    assert torch.equal(state["w"], torch.full((4_000_000,), float(state["step"])))
    assert path.name == f"ckpt-{state['step']:08d}.pt"
    return int(state["step"])


def test_kill_during_checkpoint_write_never_corrupts_latest(tmp_path: Path) -> None:
    step, torn, rounds = 0, 0, 0
    while rounds < RANDOM_KILLS or torn < TORN_WANTED:
        assert rounds < ROUNDS_MAX, f"only {torn} of {rounds} kills landed inside a write; the test proved too little"
        torn += _kill_one(tmp_path, step, into_a_write=rounds >= RANDOM_KILLS)
        rounds += 1
        step = max(step, _check_latest(tmp_path))
    assert step > 0, "no checkpoint ever completed"


def test_a_gone_writers_temporary_file_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    left = tmp_path / f".ckpt-00000001.pt.tmp-{gone.pid}"
    live = tmp_path / f".ckpt-00000001.pt.tmp-{os.getppid()}"
    left.write_bytes(b"torn")
    live.write_bytes(b"in flight")
    write_checkpoint(tmp_path, 2, {"step": 2}, keep=2)
    assert not left.exists() and live.exists()
