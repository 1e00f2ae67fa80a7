"""ddpkit/agent/sameerror.py: the same error after a restart (a bug) told
from a fault of the machine, without processes: exceptions raised here, the
file a worker writes and the agent reads, and the agent's memory of its starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.agent import sameerror
from ddpkit.agent.sameerror import Failure, Memory
from ddpkit.shared import envnames

WORLD = "2/2"


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # the point: any exception, with its traceback
        return caught


def bug(step: int) -> Failure:
    failure = sameerror.of_exception(raised(ValueError(f"bad batch at step {step}: index 0x7f{step:x} of {step * 7}")))
    assert failure is not None
    return failure


def test_numbers_and_addresses_are_normalised_away() -> None:
    assert sameerror.normalise("bad batch at step 12: index 0x7ffe3a out of range 4096") == \
        "bad batch at step #: index 0x# out of range #"
    assert sameerror.normalise("pid  4242\n  on port 29500") == "pid # on port #"
    assert bug(3).key == bug(17).key  # the same error, whatever its numbers


def test_the_innermost_frame_of_the_programs_own_code_is_kept_not_the_librarys() -> None:
    import yaml

    try:
        yaml.safe_load("{")  # fails inside an installed package, called from here
    except yaml.YAMLError as exc:
        failure = sameerror.of_exception(exc)
    assert failure is not None
    assert failure.file == os.path.relpath(__file__) and failure.kind == "yaml.parser.ParserError", failure
    assert not failure.fault

    def deeper() -> None:
        json.loads("{")  # fails in the standard library

    try:
        deeper()
    except ValueError as exc:
        nested = sameerror.of_exception(exc)
    assert nested is not None and nested.file == os.path.relpath(__file__)
    assert nested.kind == "json.decoder.JSONDecodeError" and nested.line == deeper.__code__.co_firstlineno + 1


def test_the_same_type_and_message_at_another_line_is_another_error() -> None:
    first = bug(1)
    try:
        raise ValueError("bad batch at step 1: index 0x1 of 7")
    except ValueError as exc:
        second = sameerror.of_exception(exc)
    assert second is not None and first.kind == second.kind and first.message == second.message
    assert first.line != second.line and first.key != second.key


@pytest.mark.parametrize(("exc", "why"), [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:28565: Connection reset by peer"),
     "gloo reset"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"),
     "nccl"),
    (ConnectionResetError(104, "Connection reset by peer"), "a ConnectionError"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out of memory"),
    (MemoryError(), "MemoryError"),
    (TimeoutError("collective timed out"), "timeout"),
    (KeyboardInterrupt(), "a signal, as the interpreter says it"),
    (OSError(5, "Input/output error"), "a disk or a network file system"),
])
def test_faults_of_the_machine_are_never_a_bug(exc: BaseException, why: str) -> None:
    failure = sameerror.of_exception(raised(exc))
    assert failure is not None and failure.fault, why
    memory = Memory()
    for restart in range(3):
        memory.started(WORLD)
        assert memory.failed(failure, rank=0, restart=restart) is None, why


def test_a_fault_whose_cause_was_a_reset_is_a_fault() -> None:
    try:
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError as inner:
            raise ValueError("could not read the next batch") from inner
    except ValueError as exc:
        failure = sameerror.of_exception(exc)
    assert failure is not None and failure.fault


def test_the_same_error_in_the_next_start_is_a_bug_at_the_second_time_only() -> None:
    memory = Memory()
    memory.started(WORLD)
    assert memory.failed(bug(3), rank=1, restart=0) is None  # once: restarted as torchrun would
    memory.started(WORLD)
    repeated = memory.failed(bug(3), rank=1, restart=1)
    assert repeated is not None and repeated.rank == 1 and repeated.restart == 1
    assert memory.repeated == repeated
    record = repeated.record
    assert isinstance(record, records.SameError)
    assert record.verdict == (f"the same error twice, rank 1, {bug(0).where}: a bug in the program, "
                              "not a fault of the machine")
    assert records.decode(records.encode(record)).record == record


def test_another_rank_failing_the_same_way_after_a_restart_is_a_bug_too() -> None:
    memory = Memory()  # elastic ranks may be handed out anew at each rendezvous
    memory.started(WORLD)
    memory.failed(bug(3), rank=1, restart=0)
    memory.started(WORLD)
    repeated = memory.failed(bug(3), rank=0, restart=1)
    assert repeated is not None and repeated.rank == 0


@pytest.mark.parametrize("between", ["another world", "a start without it", "a start that wrote nothing"])
def test_no_verdict_across_a_lost_node_or_a_start_between(between: str) -> None:
    memory = Memory()
    memory.started(WORLD)
    memory.failed(bug(3), rank=1, restart=0)
    if between == "another world":  # a node lost (or back) between the two starts
        memory.started("1/1")
    else:
        memory.started(WORLD)
        reset = sameerror.of_exception(raised(RuntimeError("Connection closed by peer [127.0.0.1]:4242")))
        memory.failed(None if between == "a start that wrote nothing" else reset, rank=1, restart=1)
        memory.started(WORLD)
    assert memory.failed(bug(3), rank=1, restart=2) is None
    memory.started(memory._world[max(memory._world)])  # the same world once more: now it is a bug
    assert memory.failed(bug(3), rank=1, restart=3) is not None


def test_a_worker_killed_by_a_signal_writes_nothing_and_is_never_a_bug() -> None:
    memory = Memory()
    for restart in range(3):
        memory.started(WORLD)
        assert memory.failed(sameerror.read(None), rank=1, restart=restart) is None


def test_the_worker_writes_its_failure_where_the_agent_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)
    path = sameerror.file_for({envnames.TORCHELASTIC_ERROR_FILE: str(error_file)})
    assert path == str(error_file.parent / sameerror.FILE_NAME)
    assert sameerror.file_for({}) is None
    assert sameerror.read(path) is None  # nothing written yet
    monkeypatch.setenv(envnames.DDPKIT_FAILURE_FILE, str(path))
    exc = raised(ValueError("bad batch at step 3"))
    sameerror.record(exc)
    assert sameerror.read(path) == sameerror.of_exception(exc)
    Path(str(path)).write_text("{not json")
    assert sameerror.read(path) is None
    monkeypatch.delenv(envnames.DDPKIT_FAILURE_FILE)
    sameerror.record(exc)  # no file named: nothing written, nothing raised


def test_ddpkit_trains_own_frames_are_the_program_wherever_ddpkit_is_installed() -> None:
    libraries = ("/usr/lib/python3/site-packages/",)
    installed = "/usr/lib/python3/site-packages/ddpkit/train/loop/steps.py"
    assert sameerror.is_program_frame(installed, "ddpkit.train.loop.steps", libraries)
    assert not sameerror.is_program_frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py",
                                          "torch.nn.modules.module", libraries)
    assert not sameerror.is_program_frame("/home/me/ddpkit/src/ddpkit/agent/worker.py", "ddpkit.agent.worker",
                                          libraries)
    assert sameerror.is_program_frame("/home/me/train.py", "__main__", libraries)
