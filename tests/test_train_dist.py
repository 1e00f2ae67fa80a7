"""`ddpkit train` as real processes: torchrun agents on localhost as nodes, gloo, CPU."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from ddpkit.train.data.loaders import SyntheticImages
from ddpkit.train.model.build import build_model
from tests.helpers.runs import TINY, alone, assert_bitwise_equal, final_model, metrics, run_ok, torchrun, wait_for_step
from tests.test_train_units import write_cifar10

pytestmark = pytest.mark.slow


def single_process_accuracy(state: dict, size: int) -> int:
    model = build_model("tiny", 10, 8)
    model.load_state_dict(state)
    model.eval()
    data = SyntheticImages(size, 8, 10, seed=0, split=1)
    with torch.no_grad():
        return sum(int(model(x[None]).argmax(1).item() == y) for x, y in (data[i] for i in range(size)))


def test_two_nodes_two_processes_train_evaluate_exactly_and_report(tmp_path: Path) -> None:
    args = [*TINY, "--synthetic-size", "128", "--eval-size", "101", "--batch-size", "8", "--epochs", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "m.jsonl"),
            "--log-dir", str(tmp_path / "logs"), "--log-every", "2"]
    out = run_ok(torchrun(tmp_path, 2, 2, args))
    assert "rank report: 4 processes" in out
    assert "ddpkit train finished: 8 steps, 2 epochs, world size 4, global batch 32" in out
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"rank{r}.log" for r in range(4)]
    evals = [r for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    # 101 test samples over 4 ranks: each counted once, same answer as one process
    assert evals[-1]["total"] == 101
    assert evals[-1]["correct"] == single_process_accuracy(final_model(tmp_path / "ckpt"), 101)
    summary = metrics(tmp_path / "m.jsonl")[-1]
    assert summary["kind"] == "summary" and summary["checkpoint"].endswith("ckpt-00000008.pt")


def test_zero_checkpoint_consolidates_and_resumes_bitwise(tmp_path: Path) -> None:
    def args(tag: str) -> list[str]:
        return [*TINY, "--zero", "--synthetic-size", "96", "--batch-size", "8", "--epochs", "2", "--no-eval",
                "--checkpoint-dir", str(tmp_path / tag), "--checkpoint-every", "4", "--keep", "10"]

    run_ok(torchrun(tmp_path, 1, 2, args("full"), tag="full"))
    first = torch.load(tmp_path / "full" / "ckpt-00000004.pt", weights_only=False)
    # consolidated: rank 0's file holds the momentum of every parameter, not just its shard
    params = [k for k in first["model"] if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(first["optimizer"]["state"]) == len(params) == 8
    run_ok(torchrun(tmp_path, 1, 2, [*args("resumed"), "--resume", str(tmp_path / "full" / "ckpt-00000004.pt")],
                    tag="resumed"))
    assert_bitwise_equal(final_model(tmp_path / "full"), final_model(tmp_path / "resumed"))


def test_split_model_checkpointing_accumulation_mixed_precision(tmp_path: Path) -> None:
    args = [*TINY, "--devices-per-process", "2", "--activation-checkpointing", "--grad-accum", "2",
            "--precision", "bf16", "--channels-last", "--synthetic-size", "64", "--batch-size", "4",
            "--metrics", str(tmp_path / "m.jsonl"), "--warmup-epochs", "0.5"]
    out = run_ok(torchrun(tmp_path, 1, 2, args))
    assert "world size 2, global batch 16" in out
    losses = [r["loss"] for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "train"]
    assert losses and all(loss == loss and loss < 10 for loss in losses)


def test_dataparallel_with_balanced_batch_runs_in_one_process(tmp_path: Path) -> None:
    out = run_ok(alone(tmp_path, [*TINY, "--strategy", "dp", "--gpu0-batch", "2", "--batch-size", "8",
                                  "--synthetic-size", "64"]))
    assert "ddpkit train finished: 8 steps, 1 epoch, world size 1, global batch 8" in out


def test_cifar10_from_torchvision_format_on_resident_data(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "data", per_batch=8, test=9)
    out = run_ok(alone(tmp_path, ["--model", "ddpkit.train.model.tiny:cnn", "--workers", "0", "--data", "cifar10",
                                  "--data-dir", str(tmp_path / "data"), "--gpu-resident-data", "--batch-size", "8",
                                  "--metrics", str(tmp_path / "m.jsonl")]))
    assert "5 steps" in out
    assert [r["total"] for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "eval"] == [9]


def test_sigterm_alone_checkpoints_and_exits_75(tmp_path: Path) -> None:
    job = alone(tmp_path, [*TINY, "--synthetic-size", "4000", "--batch-size", "4", "--log-every", "1",
                           "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt")])
    wait_for_step(tmp_path / "m.jsonl", 3, job)
    job.procs[0].send_signal(signal.SIGTERM)
    assert job.wait(120) == [75]
    step = metrics(tmp_path / "m.jsonl")[-1]["steps"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"ckpt-{step:08d}.pt"
