"""Resume that every rank agrees on, on real torchrun/gloo
processes: a 2-process checkpoint resumed by 3 processes and by 1 continues
at the same GLOBAL sample, in the epoch's global order, with the learning
rate scaled to the new global batch; and a node whose checkpoint directory
is not the one rank 0 read ends the whole job within seconds, naming the
host, the path and the fix."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import TINY, metrics, processes_in, run_ok, torchrun
from tests.helpers.tiers import one_case_in_ci

pytestmark = pytest.mark.slow

N, BATCH, SEED = 96, 4, 0
FIRST_STEPS = 5  # the 2-process run stops (and checkpoints) here
DIST_TIMEOUT_S = 600  # the collective timeout that must not be what ends a job with a bad checkpoint
ENDS_WITHIN_S = DIST_TIMEOUT_S / 3  # the check ends it well before, however loaded the machine
COMMON = [*TINY, "--synthetic-size", str(N), "--batch-size", str(BATCH), "--no-eval", "--seed", str(SEED),
          "--device", "cpu", "--backend", "gloo", "--lr", "0.1", "--base-batch", "8"]
RECORD = "tests.helpers.record_samples"


def epoch_order(epoch: int = 0) -> list[int]:
    """The epoch's global sample order, drawn the way DistributedSampler draws it."""
    gen = torch.Generator()
    gen.manual_seed(SEED + epoch)
    return torch.randperm(N, generator=gen).tolist()


def shares(order: list[int], world: int) -> list[list[int]]:
    """Rank r's samples: positions r, r+W, ... of the order, padded by wrapping to equal shares."""
    rest = list(order)
    while len(rest) % world:
        rest.append(epoch_order()[len(rest) - len(order)])
    return [rest[r::world] for r in range(world)]


def consumed(samples_dir: Path, world: int) -> list[list[int]]:
    return [json.loads((samples_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_process_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 processes, 5 steps of a 12-step epoch, a checkpoint at step 5; checks what they consumed."""
    tmp = tmp_path_factory.mktemp("first")
    samples = tmp / "samples"
    samples.mkdir()
    run_ok(torchrun(tmp, 1, 2, [*COMMON, "--max-steps", str(FIRST_STEPS), "--checkpoint-every", str(FIRST_STEPS),
                                "--checkpoint-dir", str(tmp / "ckpt")],
                    module=RECORD, env={"DDPKIT_TEST_SAMPLES_DIR": str(samples)}), timeout=300)
    seen = FIRST_STEPS * BATCH * 2
    assert consumed(samples, 2) == [s[:FIRST_STEPS * BATCH] for s in shares(epoch_order()[:seen], 2)]
    return tmp / "ckpt"


@pytest.mark.parametrize("world", one_case_in_ci([3, 1], keep=3))
def test_resume_with_another_world_size_continues_at_the_global_sample(
        two_process_checkpoint: Path, tmp_path: Path, world: int) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_process_checkpoint, ckpt)
    samples = tmp_path / "samples"
    samples.mkdir()
    out = run_ok(torchrun(tmp_path, 1, world, [*COMMON, "--checkpoint-dir", str(ckpt), "--resume", "auto",
                                                "--metrics", str(tmp_path / "m.jsonl"),
                                                "--log-dir", str(tmp_path / "logs")],
                          module=RECORD, env={"DDPKIT_TEST_SAMPLES_DIR": str(samples)}), timeout=300)
    done = FIRST_STEPS * BATCH * 2  # global samples the 2-process run trained on
    expected = shares(epoch_order()[done:], world)
    steps_left = len(expected[0]) // BATCH  # every rank runs whole batches only
    assert consumed(samples, world) == [s[:steps_left * BATCH] for s in expected], out[-3000:]
    [summary] = [r for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "summary"]
    assert summary["status"] == "finished" and summary["steps"] == FIRST_STEPS + steps_left
    assert summary["epochs_completed"] == 1 and summary["global_batch"] == BATCH * world
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "global sample 40 of the epoch" in log
    # linear scaling: --lr 0.1 is for a global batch of 8; this world's batch is 4 * world
    assert re.search(rf"global batch {BATCH * world} \(checkpoint: global batch 8\): base lr 0\.1 -> "
                     rf"{0.1 * BATCH * world / 8:.4g} \(linear scaling\)", log), log
    lrs = [r["lr"] for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "train"]
    assert lrs and max(lrs) <= 0.1 * BATCH * world / 8 + 1e-9


def one_node_checkpoint(cwd: Path, seed: int) -> None:
    """A 1-process run in `cwd` that leaves ckpt/ckpt-00000002.pt there."""
    cwd.mkdir(parents=True)
    run_ok(torchrun(cwd, 1, 1, [*TINY, "--synthetic-size", "32", "--batch-size", "4", "--no-eval",
                                "--max-steps", "2", "--checkpoint-every", "2", "--checkpoint-dir", "ckpt",
                                "--seed", str(seed), "--device", "cpu"], tag="prep"), timeout=300)


@pytest.mark.parametrize("node1", one_case_in_ci(["missing", "different"], keep="missing"))
def test_a_node_without_rank0s_checkpoint_stops_the_job_within_seconds(tmp_path: Path, node1: str) -> None:
    node0, node1_dir = tmp_path / "node0", tmp_path / "node1"
    one_node_checkpoint(node0, seed=0)
    if node1 == "different":
        one_node_checkpoint(node1_dir, seed=1)  # same name, other bytes: another node's own run
    else:
        node1_dir.mkdir()
    # the same relative --checkpoint-dir on both "nodes", each on its own disk (cwd):
    # the directory is not shared. A 10-minute collective timeout must not be what ends it.
    args = [*TINY, "--synthetic-size", "32", "--batch-size", "4", "--no-eval", "--checkpoint-dir", "ckpt",
            "--resume", "auto", "--device", "cpu", "--dist-timeout", str(DIST_TIMEOUT_S)]
    started = time.monotonic()
    job = torchrun(tmp_path, 2, 1, args, tag="resume", cwds=[node0, node1_dir])
    codes = job.wait(timeout=ENDS_WITHIN_S)
    elapsed = time.monotonic() - started
    out = job.output()
    assert codes[0] != 0 and codes[1] != 0, out[-4000:]
    reason = "no such file" if node1 == "missing" else "a different file than rank 0's"
    line = next(ln for ln in out.splitlines() if "cannot use the checkpoint rank 0 chose" in ln)
    assert "host testhost-node1 (rank 1)" in line and "ckpt/ckpt-00000002.pt" in line and reason in line
    assert "on host testhost-node0" in line
    assert "the checkpoint directory must be shared by every node" in line
    # no traceback from the workers (torchrun's agent prints its own ChildFailedError one)
    assert "src/ddpkit/" not in out and out.count("Traceback") == out.count("ChildFailedError:")
    assert len(re.findall(rf"exitcode\s+:\s*{int(ExitCode.RESUME_MISMATCH)}\b", out)) == 2, out[-3000:]
    assert elapsed < ENDS_WITHIN_S, f"took {elapsed:.1f}s"
    assert processes_in(tmp_path) == []
