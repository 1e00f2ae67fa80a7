"""Every launcher ddpkit controls ends a run with the same summary table.

One job for all three: node 1 prints two lines and its worker exits 3 while
node 0 waits; `python -m timeit` runs the job's code, so the same command
runs unchanged on this machine, in a container and over SSH. Each launcher
must print the same columns, name node 1 as the first failure with its exit
code and its last lines, stop node 0, and leave nothing running. Each
records its run (docs/guides/runs.md): the same table as JSON, the exit code, the
failure as an event, and every node's whole log in the run folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ddpkit.runs import RunState, all_runs
from tests.infra import netns, sshd
from tests.infra.docker_daemon import REPO, Docker, docker_daemon  # noqa: F401  (fixture)
from tests.test_launch_ssh import cluster, hostfile, job_processes, write_job  # noqa: F401  (fixture)

# cpu-smoke under a name of its own: the test checks that no container of
# its job is left while other xdist workers run cpu-smoke jobs on the daemon.
DOCKER_JOB = "summary-docker-test"

COLUMNS = ["node", "exit code", "status", "host", "first failure"]


def job_code(marker: str) -> str:
    # One line: timeit runs it as its statement. The marker finds the job's processes.
    return (f"import os, time; r = os.environ['DDPKIT_NODE_RANK']; print('{marker} node=' + r + ' first line', "
            f"flush=True); print('{marker} node=' + r + ' last line', flush=True); "
            "time.sleep(1) if r == '1' else time.sleep(300); os._exit(3)")


def job_args(marker: str) -> list[str]:
    return ["-n", "1", "-r", "1", job_code(marker)]


def summary_table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The summary's header and its rows by node; a cell that wraps onto
    more lines is joined with newlines."""
    header: list[str] = []
    rows: dict[str, dict[str, str]] = {}
    last: dict[str, str] | None = None
    for line in text.splitlines():
        if "┃" in line:
            cells = [c.strip() for c in line.split("┃")[1:-1]]
            if "first failure" in cells:
                header, rows, last = cells, {}, None
        elif header and line.startswith("│"):
            cells = [c.strip() for c in line.split("│")[1:-1]]
            if len(cells) != len(header):
                continue
            if cells[0]:
                last = rows[cells[0]] = dict(zip(header, cells, strict=True))
            elif last is not None:
                for name, cell in zip(header, cells, strict=True):
                    if cell:
                        last[name] = f"{last[name]}\n{cell}" if last[name] else cell
    return header, rows


def check_summary(text: str, code: int, marker: str, failed_host: str) -> None:
    header, rows = summary_table(text)
    assert header == COLUMNS, text[-4000:]
    assert sorted(rows) == ["node0", "node1"], text[-4000:]
    failed, other = rows["node1"], rows["node0"]
    assert (failed["status"], failed["exit code"], other["status"]) == ("failed first", str(code), "stopped"), rows
    assert failed["host"] == failed_host and other["first failure"] == "", rows
    cell = failed["first failure"].splitlines()
    assert cell[0] == f"exit status {code}", cell
    # Its last lines: the worker's own, before torchrun's report on it.
    assert any(line.endswith(f"{marker} node=1 last line") for line in cell[1:]), cell
    # torchrun's line is long: the table may wrap it anywhere.
    assert "failed (exitcode: 3)" in " ".join(" ".join(cell[1:]).split()), cell
    flat = " ".join(text.split())
    closing = f"node 1 ({failed_host}) failed first: exit status {code}; every other node was stopped"
    assert closing in flat and flat.count("failed first:") == 1 and "exited with code" not in flat, flat[-2000:]


def check_recorded(runs_dir: Path, printed: str, code: int, marker: str, target: str) -> None:
    """The run folder holds what the launcher printed, not a recomputation."""
    (run,) = all_runs(runs_dir)
    record = run.folder.record()
    assert (record.target, record.state, record.exit_code) == (target, RunState.FAILED, code), record
    assert record.summary is not None
    rows = {f"node{r.node}": {"node": f"node{r.node}", "exit code": r.exit_code, "status": r.status, "host": r.host}
            for r in record.summary.rows}
    printed_rows = summary_table(printed)[1]
    assert rows == {n: {k: v for k, v in row.items() if k != "first failure"} for n, row in printed_rows.items()}
    assert record.summary.closing.splitlines()[-1] in printed
    assert [(e.kind, e.node) for e in run.folder.events() if e.kind == "failed"] == [("failed", 1)]
    for log in record.logs:  # the node logs' default home is the run folder, every line kept
        assert Path(log.path).is_relative_to(run.folder.path), log
        assert f"{marker} node={log.node} last line" in Path(log.path).read_text(), log


def nothing_left(marker: str) -> list[str]:
    deadline = time.monotonic() + 10
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return job_processes(marker)


def test_launch_local_summary(tmp_path: Path) -> None:
    marker = f"SUMMARY-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2", "--nproc-per-node", "1",
            "--grace", "3", "--set", "command.module=timeit", "--", *job_args(marker)]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    host = summary_table(out.stdout)[1]["node1"]["host"]
    assert host.endswith("-node1")  # DDPKIT_HOSTNAME: the nodes share this machine
    check_summary(out.stdout, out.returncode, marker, host)
    check_recorded(tmp_path / "runs", out.stdout, out.returncode, marker, "local")
    assert nothing_left(marker) == []


@pytest.mark.full  # the same table from every launcher: local and ssh above; docker's rows: test_docker.py
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_docker_summary(docker_daemon: Docker, tmp_path: Path) -> None:  # noqa: F811
    marker = f"SUMMARY-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "docker", "-f", "examples/cpu-smoke.yaml",
            "--nodes", "2", "--nproc-per-node", "1", "--image", str(docker_daemon.image), "--grace", "2",
            "--set", f"name={DOCKER_JOB}", "--set", "command.module=timeit",
            "--set", "command.args=" + json.dumps(job_args(marker))]
    out = subprocess.run(argv, cwd=REPO, env={**docker_daemon.env, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")},
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    check_summary(out.stdout, out.returncode, marker, "node1")
    check_recorded(tmp_path / "runs", out.stdout, out.returncode, marker, "docker")
    (run,) = all_runs(tmp_path / "runs")  # its network and containers carry the run's id
    assert f"on network ddpkit-{run.folder.path.name}, master node0" in out.stdout, out.stdout[:2000]
    left = subprocess.run(["docker", "ps", "-a", "-q", "--filter", f"label=io.ddpkit.job={DOCKER_JOB}"],
                          env=docker_daemon.env, capture_output=True, text=True, check=True).stdout
    assert left == ""


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif((netns.available() or sshd.available()) is not None, reason="needs network namespaces and sshd")
def test_launch_ssh_summary(cluster: tuple[netns.Network, sshd.SshHosts], tmp_path: Path) -> None:  # noqa: F811
    net, hosts = cluster
    marker = f"SUMMARY-{uuid.uuid4().hex[:8]}"
    job = write_job(tmp_path, "summary", args=[], extra={
        "nodes": 2, "command": {"python": sys.executable, "module": "timeit", "args": job_args(marker)},
        # no ssh.log_dir: the node logs go to the run folder
        "ssh": {"workdir": str(tmp_path), "grace_s": 3, "connect_timeout_s": 3}})
    addrs = [net["node1"].addr, net["node2"].addr]
    argv = [str(Path(sys.executable).with_name("ddpkit")), "launch", "ssh", "-f", str(job),
            "--hostfile", str(hostfile(tmp_path, net, addrs)), *hosts.launcher_flags()]
    out = net["login"].run(argv, cwd=str(tmp_path), timeout=300,
                           env={**os.environ, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    check_summary(out.stderr, out.returncode, marker, addrs[1])  # the summary goes to stderr, with the preflight's
    check_recorded(tmp_path / "runs", out.stderr, out.returncode, marker, "ssh")
    assert re.search(rf"^\[node1 {re.escape(addrs[1])}\] {marker} node=1 last line$", out.stdout, re.M)
    assert nothing_left(marker) == []
