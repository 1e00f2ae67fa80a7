"""In-process pieces of `ddpkit train`: samplers, balanced DP split, schedule,
activation checkpointing, CIFAR-10 reader, device-resident loader, flag checks."""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpkit.launch.supervise import proctree
from ddpkit.train.data.loaders import (
    DeviceResidentLoader,
    ResumableSampler,
    ShardSampler,
    SyntheticImages,
    read_cifar10,
    train_loader,
)
from ddpkit.train.loop.training import warmup_cosine
from ddpkit.train.main import add_arguments, run
from ddpkit.train.model.balanced_dp import chunk_sizes
from ddpkit.train.model.build import build_model

from .helpers.held_lock_data import LOCK, HeldLockData


def write_cifar10(root: Path, per_batch: int = 6, test: int = 7) -> None:
    """A small CIFAR-10 in torchvision's on-disk format (pickled dicts of uint8 rows)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        n = test if name == "test_batch" else per_batch
        batch = {b"batch_label": name.encode(), b"labels": [(i + j) % 10 for j in range(n)],
                 b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"x.png"] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)


def test_balanced_chunks_put_the_small_share_on_device_zero() -> None:
    assert chunk_sizes(8, 2, 3) == [2, 3, 3]  # the sources' example: 2+3+3
    assert chunk_sizes(16, 4, 3) == [4, 6, 6]
    assert chunk_sizes(10, 1, 4) == [1, 3, 3, 3]
    assert chunk_sizes(11, 0, 3) == [0, 6, 5]
    with pytest.raises(ValueError):
        chunk_sizes(4, 5, 2)


@pytest.mark.parametrize("size,world", [(101, 4), (7, 3), (2, 4)])
def test_shard_sampler_covers_every_sample_exactly_once(size: int, world: int) -> None:
    seen = [i for r in range(world) for i in ShardSampler(size, world, r)]
    assert sorted(seen) == list(range(size))


def test_resumable_sampler_skips_exactly_the_seen_prefix() -> None:
    ds = SyntheticImages(50, 4, 10, seed=0)
    full = ResumableSampler(ds, 2, 1, seed=3)
    full.set_epoch(2)
    part = ResumableSampler(ds, 2, 1, seed=3)
    part.set_epoch(2, skip=8)
    assert list(part) == list(full)[8:] and len(part) == len(full) - 8
    other = ResumableSampler(ds, 2, 1, seed=3)
    other.set_epoch(3)
    assert list(other) != list(full)  # set_epoch reshuffles


def test_warmup_is_linear_then_decays() -> None:
    f = warmup_cosine(4, 20)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(12) == pytest.approx(0.5) and f(20) == pytest.approx(0.0)


def _grads_and_stats(checkpointing: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model("resnet18", 10, 16)
    model.checkpointing = checkpointing
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([1, 2, 3, 4])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)  # every parameter took part
    return [g.clone() for g in grads if g is not None], [b.clone() for b in model.buffers()]


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    plain_grads, _ = _grads_and_stats(False)
    ckpt_grads, _ = _grads_and_stats(True)
    for a, b in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_small_images_get_the_cifar_stem() -> None:
    small, large = build_model("resnet18", 10, 32), build_model("resnet18", 10, 224)
    assert small.stages[0].conv1.kernel_size == (3, 3) and small.stages[0].conv1.stride == (1, 1)  # type: ignore[union-attr]
    assert isinstance(small.stages[0].maxpool, torch.nn.Identity)
    assert large.stages[0].conv1.kernel_size == (7, 7)  # type: ignore[union-attr]
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cifar10_reader_reads_torchvision_format(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    images, labels = read_cifar10(tmp_path, train=True)
    assert images.shape == (30, 32, 32, 3) and labels.shape == (30,)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_2", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    # row layout: 1024 red, then green, then blue, row-major
    assert images[6, 0, 1, 2] == raw[b"data"][0][2 * 1024 + 1]
    assert read_cifar10(tmp_path, train=False)[0].shape == (7, 32, 32, 3)


def test_device_resident_loader_is_deterministic_and_resumable() -> None:
    ds = SyntheticImages(40, 8, 10, seed=1)

    def batches(skip: int) -> list[torch.Tensor]:
        sampler = ResumableSampler(ds, 2, 0, seed=0)
        sampler.set_epoch(1, skip=skip)
        loader = DeviceResidentLoader.from_dataset(ds, sampler, 4, seed=0, device=torch.device("cpu"))
        return [x for x, _ in loader]

    full, resumed = batches(0), batches(8)
    assert len(full) == 5 and all(b.shape == (4, 3, 8, 8) for b in full)
    for a, b in zip(full[2:], resumed):
        assert torch.equal(a, b)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,flag", [
    (["--data", "cifar10"], "--data-dir"),
    (["--gpu0-batch", "2"], "--gpu0-batch"),
    (["--model", "not a model"], "--model"),
    (["--resume", "auto"], "--checkpoint-dir"),
    (["--strategy", "dp", "--zero"], "--strategy dp"),
])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    assert run(_parse(*argv)) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["bar", "plain"])
def test_the_loss_is_read_every_log_interval_only_bar_or_not(mode: str) -> None:
    """Reading the loss syncs the host with the device; the bar used to ask
    for it after every step."""
    from ddpkit.train.outputs.progress import Progress

    progress = Progress(mode, True, total=25, start=0, every=10)
    try:
        wanted = [step for step in range(1, 26) if progress.wants_loss(step)]
        assert wanted == [10, 20, 25]
        if mode == "bar":
            progress.update(10, 0, 1.5, 100.0)
            progress.update(11, 0, None, 100.0)
            assert progress.bar is not None
            assert progress.bar.tasks[0].fields["loss"] == "1.5000"  # kept until the next read
    finally:
        progress.close()
    assert not Progress(mode, False, total=25, start=0, every=10).wants_loss(10)  # ranks > 0 never read it


def test_the_summary_repeats_the_progress_lines_throughput_and_counts_in_words() -> None:
    """The summary's img/s is the last progress line's (training only), not
    diluted by the final evaluation and checkpoint its time includes."""
    from ddpkit import records
    from ddpkit.train.loop.training import _Counters
    from ddpkit.train.outputs.progress import TrainingStatus, TrainingSummary

    run = _Counters(t0=100.0, start_step=2)
    run.trained_at = 104.0  # 8 steps x 16 images in 4 s of training
    assert run.images_per_s(10, 16) == 32.0
    summary = TrainingSummary(records.Summary("finished", 10, 1, 60.0, run.images_per_s(10, 16), None, None, None, 2, 16))
    assert summary.status is TrainingStatus.FINISHED
    lines = summary.lines()
    assert lines[0] == "ddpkit train finished: 10 steps, 1 epoch, world size 2, global batch 16"
    assert lines[1] == "  time 60.0s, 32 img/s while training"


def test_plural_counts() -> None:
    from ddpkit.shared.wording import plural

    assert [plural(1, "epoch"), plural(2, "epoch"), plural(3, "process"), plural(0, "node")] == [
        "1 epoch", "2 epochs", "3 processes", "0 nodes"]


def test_loader_workers_do_not_inherit_a_lock_another_thread_holds() -> None:
    """A thread of the rank holds a lock while the workers start (the watchdog,
    gloo and the store client run threads by the first batch). Workers forked
    from the rank would get the lock held by no one and wait out the deadline;
    the fork server's workers start clean, so every item gets the lock."""
    data = HeldLockData(size=8, wait_s=5.0)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with LOCK:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10), "the holder thread never took the lock"
    try:
        loader = train_loader(data, ResumableSampler(data, 1, 0, seed=0), batch_size=4, workers=2, pin=False)
        got, parents = zip(*[(flags.flatten().tolist(), ppids.tolist()) for flags, ppids in loader])
    finally:
        release.set()
        holder.join()
    assert [flag for batch in got for flag in batch] == [1.0] * 8
    assert os.getpid() not in {pid for batch in parents for pid in batch}  # started by the server, not forked here


LOADER_THEN_WAIT = """
import sys, time
from ddpkit.train.data.loaders import ResumableSampler, SyntheticImages, train_loader
data = SyntheticImages(16, 8, 4, seed=0)
loader = train_loader(data, ResumableSampler(data, 1, 0, seed=0), batch_size=4, workers=2, pin=False)
next(iter(loader))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_loader_workers_and_their_server_end_with_the_rank(sig: int) -> None:
    """A rank that dies without cleaning up (SIGKILL; the watchdog's os._exit)
    or is told to go takes its fork server and loader workers with it: they
    would otherwise keep each other alive for good (train/data/loader_procs.py)."""
    proc = subprocess.Popen([sys.executable, "-c", LOADER_THEN_WAIT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        left = proctree.descendants(proc.pid)
        assert len(left) >= 3, left  # the server and two workers (and the resource tracker)
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in left):
            time.sleep(0.05)
        assert not [pid for pid in left if _alive(pid)], "left behind by the rank"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    """Running, not a zombie (proctree.alive counts zombies: an orphan waits as
    one until its new parent reaps it, which is not this test's concern)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
