"""An elastic job under `ddpkit launch local`: three torchrun agents on this
machine, min_nodes 2. Right after the first checkpoint of the 3-node world
(tests/helpers/elastic_gate.py), one node's agent and workers are SIGKILLed (or SIGSTOPped).

- node 2, max_node_failures 1: node 2 is excluded; the two others finish
  with world size 2 and the summary says `failed, excluded`.
- node 2, max_node_failures 2: the launcher starts node 2's agent again at
  once, it joins at the next rendezvous, the job finishes with world size 3
  and the summary says `ok, rejoined` (the two others' world is held at its
  first checkpoint until then: on a loaded machine they could otherwise
  finish the short job first, and the late agent finds the rendezvous closed).
- node 0 (rank 0, the checkpoint writer), max_node_failures 1: the launcher
  hosts the rendezvous store (rdzv_store.py), so node 0 goes as any
  other: nodes 1 and 2 finish with world size 2, the job exits 0.
- node 0 frozen (SIGSTOP, not killed): the watchdog's heartbeats are in that
  store too (DDPKIT_CONTROL_STORE), so node 1's monitor names node 0 lost
  after watchdog.loss_s and the others go on without it, as above.

Either way the job ends with exactly the parameters of an uninterrupted run,
with the final world size, from the checkpoint the last rendezvous resumed
from (every checkpoint is kept: --keep 100)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddpkit.launch.supervise import proctree
from tests.helpers.elastic_gate import LAST_CALL_S, held_step, local_node_agent, release
from tests.helpers.runs import ROOT, TINY, assert_bitwise_equal, final_model, run_ok, torchrun
from tests.helpers.tiers import full_case

pytestmark = pytest.mark.slow

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
TRAIN = [*TINY, "--synthetic-size", "96", "--batch-size", "4", "--epochs", "2", "--no-eval", "--device", "cpu",
         "--backend", "gloo", "--lr", "0.05", "--base-batch", "8", "--seed", "0", "--checkpoint-every", "4",
         "--keep", "100", "--resume", "auto", "--dist-timeout", "60"]


def write_job(folder: Path, ckpt: Path, gate: Path, max_node_failures: int, held: str = "3") -> Path:
    spec = {
        "name": "elastic-local", "nodes": 3, "nproc_per_node": 1,
        "rendezvous": {"timeout_s": 120},
        "elastic": {"min_nodes": 2, "max_restarts": 2, "max_node_failures": max_node_failures,
                    "last_call_s": LAST_CALL_S},
        "command": {"module": "tests.helpers.elastic_gate", "args": [*TRAIN, "--checkpoint-dir", str(ckpt)]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                "ELASTIC_TEST_GATE_DIR": str(gate), "ELASTIC_TEST_GATE_WORLD": held},
    }
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


BACK_IN = re.compile(r"restart [12] of at most 2; world size (2 -> 3|3, unchanged)")  # rank 0's line, node 2 in


def back_in(out: Path, proc: subprocess.Popen[bytes], timeout: float = 240) -> None:
    """Waits until the world has 3 nodes again after the loss (or the launcher ended, or `timeout`)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if BACK_IN.search(" ".join(out.read_text().split())):
            return
        time.sleep(0.2)


@pytest.mark.parametrize(("lost", "max_node_failures", "how"),
                         # every case: make test-full; make test proves an excluded, a rejoined, a silent node
                         # and node 0 lost on launch ssh (test_elastic_ssh.py), a lost node of launch local
                         # in test_own_elastic.py
                         [full_case(2, 1, signal.SIGKILL), full_case(2, 2, signal.SIGKILL), full_case(0, 1, signal.SIGKILL),
                          full_case(0, 1, signal.SIGSTOP)],
                         ids=["excluded", "rejoins", "node0-excluded", "node0-frozen"])
def test_launch_local_goes_on_without_a_lost_node(tmp_path: Path, lost: int, max_node_failures: int,
                                                  how: signal.Signals) -> None:
    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    # rejoins: the 2-node world is held at its first checkpoint too, until node 2 is back in, so that
    # the two others cannot finish the job before the restarted agent joins (its rendezvous then closed)
    rejoins = max_node_failures > 1
    job = write_job(tmp_path, ckpt, gate, max_node_failures, "3,2" if rejoins else "3")
    out = tmp_path / "launcher.out"
    with out.open("w") as o:
        proc = subprocess.Popen([DDPKIT, "launch", "local", "-f", str(job)], stdout=o, stderr=subprocess.STDOUT,
                                cwd=tmp_path)
    try:
        step = held_step(gate, 3, lambda: None if proc.poll() is None else out.read_text()[-4000:], timeout=300)
        killed = local_node_agent(proc.pid, lost)
        assert killed, f"no agent for node {lost}"
        proctree.signal_all(killed, how)
        release(gate, 3)
        if rejoins:
            back_in(out, proc)
            release(gate, 2)
        proc.wait(timeout=600)
    finally:
        release(gate, 3)
        release(gate, 2)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    output = " ".join(out.read_text().split())
    assert proc.returncode == 0, output[-6000:]
    assert f"ckpt-{step:08d}.pt at step {step}" in output, output[-4000:]
    if max_node_failures == 1:
        world = 2
        assert f"node{lost} │ 137 │ failed, excluded" in output, output[-3000:]
        assert "excluded after it failed; the job went on with 2 of 3 nodes" in output, output[-3000:]
        assert "world size 3 -> 2 (the checkpoint was written by 3 ranks)" in output, output[-4000:]
    else:
        world = 3
        assert f"node{lost} │ 0 │ ok, rejoined" in output, output[-3000:]
        assert f"every node finished; node {lost} " in output and "rejoined after it failed (exit status 137)" \
            in output, output[-3000:]
        assert f"ddpkit: node {lost} " in output and "is back after it failed" in output, output[-4000:]
    assert "ddpkit train finished: " in output and f"world size {world}, global batch" in output, output[-3000:]

    # an uninterrupted run with the final world, from the checkpoint the last rendezvous resumed from
    resumed = int(re.findall(r"resumed from \S+ckpt-(\d+)\.pt at step", output)[-1])
    held = tmp_path / "held"
    held.mkdir()
    shutil.copy2(ckpt / f"ckpt-{resumed:08d}.pt", held)
    (held / "latest").write_text(f"ckpt-{resumed:08d}.pt\n")
    ref = tmp_path / "ref"
    ref.mkdir()
    run_ok(torchrun(ref, world, 1, [*TRAIN, "--checkpoint-dir", str(held)], tag="ref"), timeout=300)
    assert_bitwise_equal(final_model(ckpt), final_model(held))
