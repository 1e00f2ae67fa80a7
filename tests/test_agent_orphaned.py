"""When the other nodes' agents end an elastic Slurm job whose batch host is
gone (ddpkit/agent/orphaned.py): only after a rendezvous had formed, only in
an elastic Slurm job, and only when both the store and the host's slurmd take
no connection. The whole path runs on the real cluster in
tests/test_elastic_slurm.py (the batch host's every process killed)."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpkit.agent import orphaned


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_store_is_gone_when_nothing_takes_a_connection() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert not orphaned.store_gone(f"127.0.0.1:{listening.getsockname()[1]}")
    assert orphaned.store_gone(f"127.0.0.1:{closed_port()}")
    assert not orphaned.store_gone("no-port-here")  # nothing to judge: not gone


@pytest.mark.parametrize(("nnodes", "elastic"), [("2:3", True), ("3", False), ("3:3", False), ("1:4", True)])
def test_only_an_elastic_job_is_judged(nnodes: str, elastic: bool) -> None:
    assert orphaned.is_elastic(nnodes) is elastic


def test_a_step_on_min_nodes_is_elastic_when_its_batch_shell_says_so() -> None:
    """On Slurm --nnodes tops out at the step's nodes: a run Slurm gave only
    min_nodes shows 2:2, and the elastic batch shell's mark tells it apart."""
    marked = {"DDPKIT_SLURM_BATCH_PID": "123"}
    assert orphaned.is_elastic("2:2", marked) and not orphaned.is_elastic("2:2", {})
    assert not orphaned.is_elastic("3", marked)


@pytest.mark.parametrize(("env", "workers_ran", "nnodes"), [
    ({}, True, "2:3"),  # not under Slurm
    ({"SLURM_JOB_ID": "7"}, False, "2:3"),  # no rendezvous had formed: the store may not be up yet
    ({"SLURM_JOB_ID": "7"}, True, "3"),  # a static job ends by its batch script's srun
])
def test_nothing_is_asked_of_slurm_outside_an_elastic_slurm_job_that_had_run(
        env: dict[str, str], workers_ran: bool, nnodes: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = SimpleNamespace(nnodes=nnodes, rdzv_endpoint=f"127.0.0.1:{closed_port()}")
    assert orphaned.end_orphaned_job(args, workers_ran, env) is False
    assert capsys.readouterr().err == ""


def test_a_host_without_slurms_client_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: object,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol, no scancel
    monkeypatch.setattr(orphaned, "slurmd_port", closed_port)
    args = SimpleNamespace(nnodes="2:3", rdzv_endpoint=f"127.0.0.1:{closed_port()}")
    assert orphaned.end_orphaned_job(args, True, {"SLURM_JOB_ID": "7"}) is True
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("ddpkit.agent: the batch host 127.0.0.1 is gone") and "cancelling it" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("ddpkit.agent: scancel 7 failed: ")
    assert lines[1].endswith("; end the job by hand (scancel 7)")


FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$CALLS"
case $* in
  "show job -o 7") echo "JobId=7 JobName=j JobState=RUNNING StdErr=$OUT StdOut=$OUT" ;;
  "requeue 7")  # the first try times out, as against a slurmctld busy with the lost node
    [ "$(grep -c requeue "$CALLS")" -ge 2 ] && exit 0
    echo "slurm_requeue error: Socket timed out on send/recv operation" >&2; exit 1 ;;
esac
"""


def test_a_requeue_that_times_out_is_asked_again_and_the_job_output_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    calls, out = tmp_path / "calls", tmp_path / "job-7.out"
    out.write_text("0: step 30/300\n")  # what the batch host's srun had written
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(orphaned, "slurmd_port", closed_port)
    monkeypatch.setattr(orphaned, "ASK_PAUSE_S", 0.01)
    args = SimpleNamespace(nnodes="2:3", rdzv_endpoint=f"127.0.0.1:{closed_port()}")
    assert orphaned.end_orphaned_job(args, True, {"SLURM_JOB_ID": "7", "DDPKIT_SLURM_REQUEUE_ON": "USR2"}) is True
    assert calls.read_text().splitlines() == ["show job -o 7", "requeue 7", "requeue 7"]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("ddpkit.agent: the batch host 127.0.0.1 is gone"), said
    assert "requeueing it" in said[0]
    assert out.read_text().splitlines() == ["0: step 30/300", said[0]]


def test_a_requeue_that_keeps_failing_is_named_with_the_fix(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho \"$*\" >> \"$CALLS\"\necho 'Job is in transition state' >&2\n"
                                      "exit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    monkeypatch.setattr(orphaned, "slurmd_port", closed_port)
    monkeypatch.setattr(orphaned, "ASK_PAUSE_S", 0.01)
    args = SimpleNamespace(nnodes="2:3", rdzv_endpoint=f"127.0.0.1:{closed_port()}")
    assert orphaned.end_orphaned_job(args, True, {"SLURM_JOB_ID": "7", "DDPKIT_SLURM_REQUEUE_ON": "USR2"}) is True
    asked = (tmp_path / "calls").read_text().splitlines()
    assert asked == ["show job -o 7"] + ["requeue 7"] * orphaned.ASK_TRIES
    said = capsys.readouterr().err.splitlines()
    assert said[-1] == "ddpkit.agent: scontrol requeue 7 failed: Job is in transition state; end the job by hand " \
                       "(scancel 7)"


class BrokenPipe:
    """stderr whose reader is gone: the lost batch host's srun."""

    def write(self, _text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_stderr_does_not_stop_the_requeue_or_the_line_in_the_job_output(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    calls, out = tmp_path / "calls", tmp_path / "job-7.out"
    (tmp_path / "calls").write_text("requeue 7 (an earlier try)\n")  # the fake's next requeue succeeds
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(orphaned, "slurmd_port", closed_port)
    monkeypatch.setattr("sys.stderr", BrokenPipe())
    args = SimpleNamespace(nnodes="2:3", rdzv_endpoint=f"127.0.0.1:{closed_port()}")
    assert orphaned.end_orphaned_job(args, True, {"SLURM_JOB_ID": "7", "DDPKIT_SLURM_REQUEUE_ON": "USR2"}) is True
    assert calls.read_text().splitlines()[1:] == ["show job -o 7", "requeue 7"]
    [line] = out.read_text().splitlines()
    assert line.startswith("ddpkit.agent: the batch host 127.0.0.1 is gone") and "requeueing it" in line
