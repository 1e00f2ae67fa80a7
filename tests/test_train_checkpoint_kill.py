"""A SIGKILL that lands while a checkpoint is being written never leaves a
corrupt `latest`: a real writer process, killed at random instants."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddpkit.train.checkpoint_files import latest_checkpoint, read_checkpoint

WRITER = """
import sys, torch
from pathlib import Path
from ddpkit.train.checkpoint_files import write_checkpoint
d = Path(sys.argv[1]); step = int(sys.argv[2])
print("ready", flush=True)
while True:
    step += 1
    write_checkpoint(d, step, {"step": step, "w": torch.full((4_000_000,), float(step))}, keep=2)
"""


def test_kill_during_checkpoint_write_never_corrupts_latest(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    rng, step, torn = random.Random(), 0, 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(step)], env=env,
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None  # stdout=PIPE
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.2, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        torn += any(tmp_path.glob(".ckpt-*.tmp-*"))
        path = latest_checkpoint(tmp_path)
        if path is None:
            continue  # killed before the first checkpoint was complete
        state = read_checkpoint(path, "cpu")
        assert torch.equal(state["w"], torch.full((4_000_000,), float(state["step"])))
        assert path.name == f"ckpt-{state['step']:08d}.pt"
        step = state["step"]
    assert step > 0, "no checkpoint ever completed"
    assert torn > 0, "no kill landed during a write; the test proved nothing"
