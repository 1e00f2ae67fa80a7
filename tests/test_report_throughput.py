"""Throughput in the unit of the batch, and the step-time windows up to the
last step, for a program of the user's own (the preamble's metrics.py),
as `ddpkit report` reads and draws them: the batch's unit from real
batches (Lightning's list, a Hugging Face Trainer's keyword arguments, a
tokenizer's BatchEncoding), rank 0's recorder against a real TCPStore with
a second rank's windows published beside it, and the report's axis label.
The frameworks' real runs under `launch local`: tests/test_own_frameworks.py."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist

from ddpkit import records
from ddpkit.preamble import metrics
from ddpkit.report import data as report_data
from ddpkit.report import plots
from ddpkit.runs import RunFolder, all_runs


def test_the_batch_says_its_unit_tokens_where_it_names_them_else_samples() -> None:
    from transformers import BatchEncoding

    x, y = torch.zeros(16, 20), torch.zeros(16, 1)
    assert metrics.batch_size(([x, y], 3), {}) == (16, "samples")  # Lightning: (batch, batch_idx)
    assert metrics.batch_size((x,), {}) == (16, "samples")
    ids = torch.zeros(8, 32, dtype=torch.long)
    hf = {"input_ids": ids, "attention_mask": torch.ones(8, 32), "labels": torch.zeros(8)}
    assert metrics.batch_size((), hf) == (256, "tokens")  # a Trainer's model(**inputs): 8 x 32 tokens
    assert metrics.batch_size(({"input_ids": ids, "labels": y}, 0), {}) == (256, "tokens")  # a dict batch
    assert metrics.batch_size((BatchEncoding({"input_ids": ids}), 0), {}) == (256, "tokens")
    assert metrics.batch_size(([{"pixels": x}], 0), {}) == (16, "samples")  # a dict without tokens
    assert metrics.batch_size((torch.tensor(1.0), [1, 2]), {}) == (0, "samples")  # a scalar and a list: no batch


def test_once_a_batch_named_tokens_the_records_count_tokens() -> None:
    recorder = metrics.Recorder(None)
    recorder.on_batch(8, "samples")
    assert recorder.unit == "samples"
    recorder.on_batch(256, "tokens")
    recorder.on_batch(8, "samples")
    assert recorder.unit == "tokens" and recorder.counted == {"tokens": 256, "samples": 16}


@pytest.fixture
def stores() -> Iterator[tuple[dist.Store, dist.Store]]:
    """Rank 0's and rank 1's view of one real TCPStore, under the step-time prefix."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    yield dist.PrefixStore("step-times/", server), dist.PrefixStore("step-times/", peer)


def rank_0(path: Path, store: dist.Store) -> metrics.Recorder:
    recorder = metrics.Recorder(path)
    recorder._group, recorder._store = (0, 2), store  # as _joined finds them in a 2-rank group
    return recorder


def steps_of(path: Path, kind: type[records.Record]) -> list[int]:
    return [s.record.step for s in records.read_file(path) if isinstance(s.record, kind)]  # type: ignore[attr-defined]


def test_the_windows_reach_the_last_step(tmp_path: Path, stores: tuple[dist.Store, dist.Store]) -> None:
    """65 steps; rank 1 publishes each window just after rank 0 looked for it
    (as a rank a moment behind does). Each window is written at the next
    record; at exit the last full window (60) and the 5 steps after it (65),
    which rank 1 published at its own exit, follow: the heat map ends where
    training did. The control is what the report drew before: up to 50."""
    mine, peer = stores
    path = tmp_path / "metrics.jsonl"
    recorder = rank_0(path, mine)
    for step in range(1, 66):
        recorder.on_batch(256, "tokens")
        recorder.on_step(step)
        if step % metrics.LOG_EVERY == 0:
            peer.set(f"{step}/1", "0.2")
    assert steps_of(path, records.StepTimes) == [10, 20, 30, 40, 50]  # the control: training's last window missing
    peer.set("65/1", "0.2")  # rank 1's exit: its 5 steps since the last record
    recorder.finish(wait_s=5)
    assert steps_of(path, records.StepTimes) == [10, 20, 30, 40, 50, 60, 65]
    assert steps_of(path, records.Train) == [10, 20, 30, 40, 50, 60, 65]
    train = [s.record for s in records.read_file(path) if isinstance(s.record, records.Train)]
    assert all(r.unit == "tokens" and r.images_per_s > 0 for r in train), train
    [last] = [s.record for s in records.read_file(path) if isinstance(s.record, records.StepTimes) and
              s.record.step == 65]
    assert last.step_s[1] == 0.2


def test_a_rank_that_never_publishes_its_last_window_costs_the_exit_a_bounded_wait(
        tmp_path: Path, stores: tuple[dist.Store, dist.Store]) -> None:
    mine, _ = stores
    path = tmp_path / "metrics.jsonl"
    recorder = rank_0(path, mine)
    for step in range(1, 21):
        recorder.on_step(step)
    began = time.monotonic()
    recorder.finish(wait_s=0.3)
    assert 0.3 <= time.monotonic() - began < 2.0
    assert steps_of(path, records.StepTimes) == [] and steps_of(path, records.Train) == [10, 20]


def test_after_an_uncaught_exception_rank_0_waits_for_no_window(
        tmp_path: Path, stores: tuple[dist.Store, dist.Store], monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that ended in an exception (the interpreter keeps it as
    sys.last_value before the exit handlers run): the other ranks may be gone."""
    mine, _ = stores
    recorder = rank_0(tmp_path / "metrics.jsonl", mine)
    for step in range(1, 16):
        recorder.on_step(step)
    monkeypatch.setattr(sys, "last_value", RuntimeError("the program's"), raising=False)
    began = time.monotonic()
    recorder.finish(wait_s=5)
    assert time.monotonic() - began < 1.0
    assert steps_of(tmp_path / "metrics.jsonl", records.Train) == [10, 15]  # its own records are still written


def load(tmp_path: Path, *train: records.Train) -> report_data.ReportData:
    folder = RunFolder.create(name="units", target="local", nodes=2, nproc_per_node=1, spec_yaml="name: units\n",
                              root=tmp_path)
    t0 = folder.record().started
    folder.metrics_file.write_text("".join(records.encode(r, t0 + 1 + i) + "\n" for i, r in enumerate(train)))
    return report_data.load(all_runs(tmp_path)[0])


@pytest.mark.parametrize(("unit", "label"), [("tokens", "tokens / s (all ranks)"),
                                             ("samples", "samples / s (all ranks)"),
                                             (None, "images / s (all ranks)")])  # ddpkit train's own records
def test_the_throughput_axis_says_the_unit_the_records_carry(tmp_path: Path, unit: str | None, label: str) -> None:
    data = load(tmp_path, *(records.Train(step=10 * i, loss=1.0, images_per_s=100.0 * i, unit=unit)
                            for i in (1, 2, 3)))
    fig, ax = plt.subplots()
    try:
        plots._throughput(ax, data)
        assert ax.get_ylabel() == label
        [curve] = ax.get_lines()
        assert list(curve.get_ydata()) == [100.0, 200.0, 300.0]
    finally:
        plt.close(fig)
