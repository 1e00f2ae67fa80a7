"""When the other nodes' agents end an elastic Slurm job whose batch host is
gone (ddpkit/agent/orphaned.py): only after a rendezvous had formed, only in
an elastic Slurm job, and only when both the store and the host's slurmd take
no connection. The whole path runs on the real cluster in
tests/test_elastic_slurm.py (the batch host's every process killed)."""

from __future__ import annotations

import socket
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
