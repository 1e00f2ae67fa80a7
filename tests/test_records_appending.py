"""A process keeps its node's records file open (records/appending.py): what
a crash, a fork, a removed file and another folder must not lose."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.launch.supervise.metricsink import MetricsSink

from .test_records import EVERY_KIND

RECORD = records.WorkerExit(1, 0, 9, 12)


def fds_open_on(path: Path) -> list[int]:
    """This process's descriptors open on `path`."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                out.append(int(name))
        except OSError:
            continue
    return out


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(records.CHANNEL_VAR, str(tmp_path / "job.records"))
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    return tmp_path / "job.records"


def test_a_record_is_encoded_as_asdict_gives_its_fields() -> None:
    """The encoder reads each class's fields once; what it writes is what dataclasses.asdict gave."""
    for record in EVERY_KIND:
        omitted = {f.name for f in dataclasses.fields(record) if f.metadata.get("omitted when none")}
        expected = {k: v for k, v in dataclasses.asdict(record).items() if not (v is None and k in omitted)}
        assert records.fields_of(record) == expected
        assert json.loads(records.encode(record, 2.0)) == {"kind": record.kind, "v": record.version, "time": 2.0,
                                                          **json.loads(json.dumps(expected))}


def test_a_process_opens_its_node_file_once_and_every_record_is_in_it(folder: Path) -> None:
    for step in range(3):
        assert records.send(RECORD, time=float(step)) is None
    path = folder / "node3.jsonl"
    assert len(fds_open_on(path)) == 1  # kept open, once
    assert [s.time for s in records.read_file(path)] == [0.0, 1.0, 2.0]


def test_a_removed_file_is_made_again_and_another_folder_gets_the_records_after(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records.send(RECORD, time=1.0)
    (folder / "node3.jsonl").unlink()  # the folder cleaned while the job runs
    records.send(RECORD, time=2.0)
    assert [s.time for s in records.read_file(folder / "node3.jsonl")] == [2.0]
    monkeypatch.setenv(records.CHANNEL_VAR, str(tmp_path / "requeued.records"))
    records.send(RECORD, time=3.0)
    assert [s.time for s in records.read_file(tmp_path / "requeued.records" / "node3.jsonl")] == [3.0]
    assert fds_open_on(folder / "node3.jsonl") == []  # the old file's descriptor closed


def test_a_forked_child_writes_through_its_own_descriptor_and_leaves_its_parents_open(folder: Path) -> None:
    records.send(RECORD, time=1.0)
    (parents,) = fds_open_on(folder / "node3.jsonl")
    pid = os.fork()
    if pid == 0:  # the child: its inherited copy closed at the fork, its record through one of its own
        try:
            inherited = fds_open_on(folder / "node3.jsonl")
            records.send(RECORD, time=2.0)
            os._exit(0 if inherited == [] and len(fds_open_on(folder / "node3.jsonl")) == 1 else 3)
        finally:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    records.send(RECORD, time=3.0)
    assert fds_open_on(folder / "node3.jsonl") == [parents]
    assert [s.time for s in records.read_file(folder / "node3.jsonl")] == [1.0, 2.0, 3.0]


def test_a_process_killed_right_after_sending_leaves_its_record_whole(folder: Path) -> None:
    code = ("import os, signal; from ddpkit import records;"
            " records.send(records.WorkerExit(1, 0, 9, 12), time=5.0); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=60)
    assert done.returncode == -9
    assert records.read_file(folder / "node3.jsonl") == [records.Stamped(RECORD, 5.0)]


def test_the_launchers_metrics_sink_keeps_its_file_open_and_says_once_when_it_cannot_write(tmp_path: Path) -> None:
    warned: list[str] = []
    sink = MetricsSink(tmp_path / "run" / "metrics.jsonl", warned.append)
    for step in range(3):
        sink(records.Stamped(records.Train(step, 0.5, 900.0), float(step)))
    sink(records.Stamped(RECORD, 4.0))  # not a metrics file's kind
    assert [s.record.step for s in records.read_file(sink.path)] == [0, 1, 2]  # type: ignore[attr-defined]
    assert len(fds_open_on(sink.path)) == 1 and warned == []
    blocked = MetricsSink(tmp_path / "a-file" / "metrics.jsonl", warned.append)
    (tmp_path / "a-file").write_text("not a folder")
    blocked(records.Stamped(records.Train(1, 0.5, 900.0), 1.0))
    blocked(records.Stamped(records.Train(2, 0.5, 900.0), 2.0))
    assert len(warned) == 1 and "no longer kept" in warned[0]
