"""The pieces of `launch ssh --detach` that need no host (docs/guides/detach.md):
the first host's checks run by a real `sh` here and judged, each problem one
line; the supervisor's command line there; a handle's command as it runs
there; a stop signal held until the supervisor's first node starts."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.launch.prelude import READY_FLAG, SUPERVISE_FLAG, hold_stop_signals, replay_held_stop
from ddpkit.launch.ssh.detached import detach_checks, judge_first_host, supervisor_command
from ddpkit.launch.ssh.remote import remote_words
from ddpkit.runs import RemoteRun, RunFolder, RunTarget

PYTHON = sys.executable


def checks_here(runs_dir: str | None, python: str = PYTHON) -> str:
    return subprocess.run(["sh", "-c", detach_checks(python, runs_dir)], capture_output=True, text=True,
                          timeout=60).stdout


def test_a_first_host_with_what_a_detached_run_needs_passes(tmp_path: Path) -> None:
    first = judge_first_host(checks_here(str(tmp_path / "runs")), PYTHON, str(tmp_path / "runs"))
    assert first.problems == [] and first.runs_dir == str((tmp_path / "runs").resolve())
    assert first.keeper[-2:] == ["setsid", "--fork"] and first.hostname


def test_each_missing_need_is_one_line_naming_its_fix(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    first = judge_first_host(checks_here(str(blocked / "runs")), PYTHON, str(blocked / "runs"))
    assert first.problems == [f"runs folder {blocked / 'runs'} cannot be made or written there; give one it can "
                              "with --detach-runs-dir DIR"]
    first = judge_first_host(checks_here(str(tmp_path), "/nonexistent/python3"), "/nonexistent/python3", None)
    assert first.problems == ["'/nonexistent/python3' not found there; install it or set command.python"]
    said = "folder /r\npython ok\nddpkit missing\nsetsid missing\nsystemd no\n"
    assert judge_first_host(said, "python3", None).problems == [
        "python3 cannot import ddpkit and paramiko there; the detached supervisor runs ddpkit on the first host: "
        "pip install ddpkit there",
        "no setsid --fork there (util-linux 2.31 or newer): nothing would keep the supervisor running once this "
        "session closes; install util-linux, or launch without --detach"]


def test_systemd_run_keeps_the_supervisor_where_the_user_manager_answers() -> None:
    said = "folder /r\npython ok\nddpkit ok\nsetsid ok\nsystemd ok\n"
    assert judge_first_host(said, "python3", None).keeper == ["systemd-run", "--user", "--scope", "--quiet", "--",
                                                              "setsid", "--fork"]


def test_the_supervisors_command_there_quotes_every_word() -> None:
    command = supervisor_command("/opt/my env/python", ["setsid", "--fork"], "/runs/a b-123456", ["-i", "/k/id x"])
    words = shlex.split(command.removeprefix("cd / && cat | "))
    assert words[:3] == ["setsid", "--fork", "/opt/my env/python"]
    assert words[words.index(SUPERVISE_FLAG) + 1] == "/runs/a b-123456"
    assert words[words.index(READY_FLAG) + 1] == "1" and words[-2:] == ["-i", "/k/id x"]


def test_a_handles_command_runs_there_for_its_run_id() -> None:
    args = argparse.Namespace(command="logs", run="myjob", node=None, rank=3, tail=5, follow=True)
    assert remote_words(args, "abc123") == ["logs", "abc123", "--rank", "3", "--tail", "5", "--follow"]
    assert remote_words(argparse.Namespace(command="cancel", run="myjob"), "abc123") == ["cancel", "abc123"]


def test_a_handle_keeps_the_id_and_where_the_run_lives(tmp_path: Path) -> None:
    run = RunFolder.create(name="away", target=RunTarget.SSH, nodes=2, nproc_per_node=1, spec_yaml="name: away\n",
                           root=tmp_path, run_id="abc123")
    assert run.path == tmp_path / "away-abc123"
    remote = RemoteRun(alias="gpu1", hostname="10.0.0.1", port=22, user="me", python="python3", runs_dir="/r",
                       folder="/r/away-abc123")
    assert run.update(remote=remote, detached=True).remote == remote
    assert run.record().remote == remote and run.record().detached


def test_a_stop_signal_before_the_first_node_is_held_then_stops_the_run() -> None:
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        hold_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # `ddpkit cancel` before the supervisor's own handlers
        with pytest.raises(KeyboardInterrupt):
            replay_held_stop()
        replay_held_stop()  # once only
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
