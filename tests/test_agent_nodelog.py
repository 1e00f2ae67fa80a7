"""What people read in a Slurm job's output file, as the agent writes it
(agent/nodelog.py): a failed worker's traceback, torch's report on it and
torch's stop and failure lines go to the node's log in the job's records
folder, and the output keeps one line each that says where. A Kubernetes job's
pods whose records folder is on a shared volume keep theirs there the same
way. Elsewhere (no records folder: a launcher reads the stream; a container's
own folder dies with it) everything is printed as before. The same
on the real cluster: tests/test_slurm_first_failure.py, tests/test_preempt_slurm.py."""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.agent import nodelog, stopping, worker
from ddpkit.launch.local import free_port
from tests.helpers.runs import ROOT


def slurm_env(tmp: Path, node: str = "node2") -> dict[str, str]:
    return {"DDPKIT_RECORDS": str(tmp / "job-7.records"), "SLURM_JOB_ID": "7", "SLURMD_NODENAME": node}


def test_the_node_log_is_a_slurm_jobs_and_holds_each_piece_under_a_heading(tmp_path: Path) -> None:
    env = slurm_env(tmp_path)
    assert nodelog.path(env) == tmp_path / "job-7.records" / "node2.log"
    # Kubernetes without a shared volume: the folder in the pod's container dies with it
    assert nodelog.path({"DDPKIT_RECORDS": records.CONTAINER_FOLDER, "HOSTNAME": "x"}) is None
    # compose: the container keeps its folder as long as its output, until `docker compose down`
    assert nodelog.path({"DDPKIT_RECORDS": records.COMPOSE_FOLDER}) == \
        Path(records.COMPOSE_FOLDER) / f"{socket.gethostname()}.log"
    # a Kubernetes job's folder on the volume its pods share: the pod's log beside its records
    shared = {"DDPKIT_RECORDS": str(tmp_path / "claim" / "job")}
    assert nodelog.path(shared) == tmp_path / "claim" / "job" / f"{socket.gethostname()}.log"
    assert nodelog.path({"SLURM_JOB_ID": "7"}) is None  # a launcher reads the stream
    kept = nodelog.keep("line one\nline two", "rank 3: its traceback", env)
    nodelog.keep("more\n", "torch, on the stop", env)
    text = (tmp_path / "job-7.records" / "node2.log").read_text()
    assert kept == tmp_path / "job-7.records" / "node2.log"
    heads = [line for line in text.splitlines() if line.startswith("==== ")]
    assert len(heads) == 2 and heads[0].endswith(f"pid {os.getpid()}: rank 3: its traceback"), text
    assert "line one\nline two\n==== " in text and text.endswith("torch, on the stop\nmore\n")


def raise_in_step() -> None:
    raise ValueError("bad shape (3, 4)")


def printed_exception(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    for name in ("DDPKIT_RECORDS", "SLURM_JOB_ID", "SLURMD_NODENAME", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    try:
        raise_in_step()
    except ValueError:
        worker.print_exception(skipping=())
    return err.getvalue()


def test_a_workers_traceback_in_a_slurm_job_is_one_line_and_the_node_log(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = printed_exception(monkeypatch, {**slurm_env(tmp_path), "RANK": "3"})
    log = tmp_path / "job-7.records" / "node2.log"
    assert out == (f"[rank3]:ValueError: bad shape (3, 4), raised at {__file__}:{raise_in_step.__code__.co_firstlineno + 1}"
                   f" in raise_in_step  (its traceback: {log})\n")
    kept = log.read_text()
    assert ": rank 3: its traceback\nTraceback (most recent call last):\n" in kept
    assert "in raise_in_step\n" in kept and kept.endswith("ValueError: bad shape (3, 4)\n")


def test_where_the_records_folder_dies_with_the_container_the_traceback_is_printed_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kubernetes job without a shared volume: kept in the pod's container, the traceback would go
    with it; on the output it stays as long as the pod's output does."""
    out = printed_exception(monkeypatch, {"DDPKIT_RECORDS": records.CONTAINER_FOLDER, "RANK": "3"})
    assert out.startswith("Traceback (most recent call last):\n") and out.endswith("ValueError: bad shape (3, 4)\n")


@pytest.mark.parametrize(("msg", "args", "printed_elsewhere"), [
    ("Received %s death signal, shutting down workers", ("SIGTERM",), False),
    ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", (1, 0, 42, "python"), True),
])
def test_torchs_stop_and_failure_lines_go_to_the_node_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, msg: str,
                                                          args: tuple, printed_elsewhere: bool) -> None:
    record = logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.WARNING, __file__, 1, msg, args,
                               None)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert stopping.QuietShutdown().filter(record) is printed_elsewhere  # no node log: as before
    for name, value in slurm_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    assert stopping.QuietShutdown().filter(record) is False
    assert record.getMessage() in (tmp_path / "job-7.records" / "node2.log").read_text()


BOOM = """\
import os, time
def step():
    raise RuntimeError("boom in the worker")
if os.environ["RANK"] == "0":
    step()
time.sleep(60)
"""


@pytest.mark.slow
def test_a_failed_worker_under_a_slurm_agent_is_three_lines_not_forty(tmp_path: Path) -> None:
    """The agent as a Slurm task runs it (the records folder, SLURM_JOB_ID): rank 0 raises, rank 1 is
    stopped. Before, the output held rank 0's traceback, torch's error line and its ChildFailedError box
    (41 lines); now one line for the exception, the preamble's stop line of rank 1, one for the agent."""
    (tmp_path / "boom.py").write_text(BOOM)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", **slurm_env(tmp_path, "node1")}
    done = subprocess.run([sys.executable, "-m", "ddpkit.agent", "--nnodes=1", "--nproc-per-node=2",
                           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "boom.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    log = tmp_path / "job-7.records" / "node1.log"
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == (f"[rank0]:RuntimeError: boom in the worker, raised at {tmp_path / 'boom.py'}:3 in step  "
                        f"(its traceback: {log})"), done.stderr
    assert lines[-1] == f"ddpkit.agent: node 0: worker rank 0 failed (exit code 1); torch's report: {log}", done.stderr
    assert len(lines) <= 3 and "Traceback" not in done.stderr and "=====" not in done.stderr, done.stderr
    kept = log.read_text()
    for whole in ('raise RuntimeError("boom in the worker")', "ChildFailedError", "Root Cause (first observed failure)",
                  "failed (exitcode: 1) local_rank: 0", "closing signal SIGTERM"):
        assert whole in kept, kept


COPIER = """\
import os, sys
from ddpkit.agent import nodelog, nodestderr
node = nodestderr.redirect(lambda line: nodelog.keep(line, "c10d"))
child = os.fork()
if child == 0:  # forked before the copier's thread, as the zygote is: its writes are copied too
    os.write(2, b"[W1129 03:00:01.000 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3\\n")
    os.write(2, b"from the zygote's worker\\n")
    os._exit(0)
node.copy()
os.waitpid(child, 0)
print("ddpkit.agent: a line for people", file=sys.stderr, flush=True)
os.write(2, b"[W1129 03:00:00.000 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3\\n")
os.write(2, b"a line left unfinished")
node.close()
print("after close", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("slurm", [True, False])
def test_the_nodes_stderr_keeps_c10ds_lookup_warning_in_the_node_log(tmp_path: Path, slurm: bool) -> None:
    """In a Slurm job, for the agent and the workers of the zygote it forks; elsewhere the copier is not
    started (launch/supervise/reader.NOISE drops the line), and were it started the line would be printed:
    nodelog.keep has nowhere to keep it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(slurm_env(tmp_path) if slurm else {})}
    if not slurm:
        env.pop("SLURM_JOB_ID", None)
    done = subprocess.run([sys.executable, "-c", COPIER], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "[c10d]" not in line]
    # the unfinished line copied as it was written, the next one after it
    assert lines == ["from the zygote's worker", "ddpkit.agent: a line for people",
                     "a line left unfinishedafter close"], done.stderr
    warned = done.stderr.count("[c10d] The hostname of the client socket")
    if slurm:
        assert warned == 0, done.stderr
        assert (tmp_path / "job-7.records" / "node2.log").read_text().count("[c10d] The hostname of the client") == 2
    else:
        assert warned == 2, done.stderr
