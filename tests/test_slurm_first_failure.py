"""A non-elastic Slurm job in torchrun mode whose one rank fails while the
others stay healthy, on the real cluster (2 nodes x 1 process, gloo): srun's
--kill-on-bad-exit stops the healthy node with SIGTERM, and the job still
ends FAILED with the failed rank's code, not with the 143 of the node srun
stopped (agent/stopping.py holds a stop signal that comes after a worker
failed; agent/nodefailure.py and the batch script's first-failure block).
The job's output file, read as a user does, holds the program's lines and
ddpkit's: a traceback is one line that names the node's log where it is whole,
and torch's report box is not there. The same in srun mode (one srun task per
process, no agent: the task that failed leaves its node's failure file)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from ddpkit import records
from tests.helpers.runs import processes_in
from tests.helpers.stop_output import NOISE
from tests.infra import netns, slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(300),
              pytest.mark.root]

# Rank 1 (node2) fails once both ranks joined (mode exit: os._exit(13), sysexit: sys.exit(13), raise: an
# exception; stall: it stops reporting its steps to the hang watchdog, whose verdict ends every rank with
# os._exit(13)); rank 0 stays healthy.
PROGRAM = """\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
rank = dist.get_rank()
os.write(1, f"READY rank {rank}\\n".encode())
if sys.argv[1] == "ok":
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)
if sys.argv[1] == "stall":
    from ddpkit import watchdog
    for step in range(1, 4):
        watchdog.progress(step)
        dist.barrier()
    if rank == 1:
        time.sleep(300)
    dist.barrier()
if rank == 1:
    time.sleep(1)
    if sys.argv[1] == "exit":
        os._exit(13)
    if sys.argv[1] == "sysexit":
        sys.exit(13)
    def step():
        raise RuntimeError("boom on rank 1")
    step()
time.sleep(300)
"""


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


def submit(cluster: SlurmCluster, tmp: Path, name: str, mode: str, slurm_mode: str = "torchrun",
           stall_s: int | None = None) -> tuple[slurm_cluster.JobInfo, str, Path]:
    """The job's end, its output file as people read it, and its records folder."""
    (tmp / "program.py").write_text(PROGRAM)
    spec = {"name": name, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "script": str(tmp / "program.py"), "args": [mode]},
            "env": {"OMP_NUM_THREADS": "1"}, "slurm": {"mode": slurm_mode}}
    if stall_s is not None:
        spec["watchdog"] = {"stall_s": stall_s}
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
    out = cluster.run([sys.executable, "-m", "ddpkit.cli", "submit", "slurm", "-f", str(tmp / "job.yaml"),
                       "--dir", str(tmp)], cwd=ROOT, timeout=120, env={"DDPKIT_RUNS_DIR": str(tmp / "runs")})
    assert out.returncode == 0, out.stdout + out.stderr
    job = int(out.stdout.split("submitted Slurm job ")[1].split(":")[0])
    info = cluster.wait(job, timeout=200)
    text = (tmp / f"{name}-{job}.out").read_text(errors="replace")
    print(f"FIRST-FAILURE {slurm_mode} {mode}: {info.state} {info.exit_code}\n{text}")
    return info, text, records.slurm_folder(tmp, name, job)


def assert_read_as_people_read_it(text: str) -> None:
    """No traceback, no torch box or chatter, no record, no c10d lookup warning."""
    for noise in (*NOISE, records.FRAME, "ChildFailedError", "Root Cause", "====", "of binary:"):
        assert noise not in text, f"{noise!r} in the output\n{text[-6000:]}"


@pytest.mark.full  # test_slurm_real.py::test_failing_task_fails_the_whole_job (its torchrun case: exit code 1)
@pytest.mark.parametrize(("mode", "code"), [("exit", 13), ("raise", 1)])
def test_a_failed_rank_ends_the_job_with_its_code_while_srun_stops_the_healthy_node(
        cluster: SlurmCluster, tmp_path: Path, mode: str, code: int) -> None:
    info, text, folder = submit(cluster, tmp_path, f"first-{mode}", mode)
    assert (info.state, info.exit_code) == ("FAILED", f"{code}:0"), f"{info}\n{text[-6000:]}"
    log = folder / "node2.log"
    # node 1's agent (host node2) says its worker failed, and where torch's report is
    assert re.search(rf"^1: ddpkit\.agent: node 1: worker rank 1 failed \(exit code {code}\); torch's report: "
                     rf"{re.escape(str(log))}$", text, re.MULTILINE), text[-6000:]
    assert (folder / "node2.run0.failed").read_text().split()[1] == str(code)
    if mode == "raise":
        # the exception in one line, where it was raised, and the file with its whole traceback
        assert re.search(rf"^1: \[rank1\]:RuntimeError: boom on rank 1, raised at \S+program\.py:\d+ in step  "
                         rf"\(its traceback: {re.escape(str(log))}\)$", text, re.MULTILINE), text[-6000:]
        assert 'raise RuntimeError("boom on rank 1")' in log.read_text()
    assert "ChildFailedError" in log.read_text()
    assert_read_as_people_read_it(text)
    assert processes_in(tmp_path) == []


@pytest.mark.full  # tests/test_slurm_real.py::test_failing_task_fails_the_whole_job (the same block, torchrun mode)
@pytest.mark.parametrize(("mode", "code"), [("sysexit", 13), ("raise", 1)])
def test_srun_mode_a_failed_task_ends_the_job_with_its_code_and_its_traceback_in_one_line(
        cluster: SlurmCluster, tmp_path: Path, mode: str, code: int) -> None:
    """One srun task per process, no agent (`python -m ddpkit.run`): the task that failed
    leaves its failure file, and its traceback is one line, as in torchrun mode."""
    info, text, folder = submit(cluster, tmp_path, f"srun-{mode}", mode, slurm_mode="srun")
    assert (info.state, info.exit_code) == ("FAILED", f"{code}:0"), f"{info}\n{text[-6000:]}"
    log = folder / "node2.log"
    assert (folder / "node2.run0.failed").read_text().split()[1] == str(code)
    assert not (folder / "node1.run0.failed").exists(), "the task srun stopped is no failure"
    # srun's status is the stopped task's (143: the signal killed it); the batch script says whose code it keeps
    assert re.search(rf"^ddpkit: job step ended with status 143; node2 failed first, with exit code {code}, "
                     rf"and srun stopped the other nodes: the job's exit code is {code}$", text, re.MULTILINE), text[-6000:]
    if mode == "raise":
        assert re.search(rf"^1: \[rank1\]:RuntimeError: boom on rank 1, raised at \S+program\.py:\d+ in step  "
                         rf"\(its traceback: {re.escape(str(log))}\)$", text, re.MULTILINE), text[-6000:]
        assert 'raise RuntimeError("boom on rank 1")' in log.read_text()
    assert_read_as_people_read_it(text)
    assert processes_in(tmp_path) == []


@pytest.mark.full  # tests/test_agent_nodefailure.py::test_an_srun_task_the_hang_watchdog_ends_leaves_its_nodes_failure_file
def test_srun_mode_a_stall_the_watchdog_ended_ends_the_job_with_13(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The hang watchdog ends every task with os._exit(13), which skips the task's last lines:
    each still leaves its node's failure file first, so the job ends 13 whatever srun's status
    (143 where srun stopped a task before its own verdict ended it)."""
    info, text, folder = submit(cluster, tmp_path, "srun-stall", "stall", slurm_mode="srun", stall_s=8)
    assert (info.state, info.exit_code) == ("FAILED", "13:0"), f"{info}\n{text[-6000:]}"
    assert "stalled rank(s): 1;" in text, text[-6000:]
    left = {host: (folder / f"{host}.run0.failed").read_text().split()[1]
            for host in ("node1", "node2") if (folder / f"{host}.run0.failed").exists()}
    assert left and set(left.values()) == {"13"}, f"{left}\n{text[-6000:]}"
    assert_read_as_people_read_it(text)
    assert processes_in(tmp_path) == []


@contextmanager
def hosts_without_mapped_names(cluster: SlurmCluster) -> Iterator[None]:
    """Every node's /etc/hosts without the IPv4-mapped names the test cluster adds
    (netns.Network.name_v4_mapped), as most clusters' files are: c10d's reverse lookup of
    a client then goes to DNS, which no namespace reaches. Written in place: the file is
    bind-mounted into the daemons' namespaces, which a new file would not reach."""
    assert cluster.net is not None
    files = [netns.NETNS_ETC / host.ns / "hosts" for host in cluster.net.hosts]
    before = [path.read_text() for path in files]
    try:
        for path, text in zip(files, before):
            path.write_text("".join(line for line in text.splitlines(keepends=True) if not line.startswith("::ffff:")))
        yield
    finally:
        for path, text in zip(files, before):
            path.write_text(text)


@pytest.mark.full  # tests/test_agent_nodelog.py::test_the_nodes_stderr_keeps_c10ds_lookup_warning_in_the_node_log
def test_c10ds_lookup_warning_goes_to_the_node_log_not_the_output(cluster: SlurmCluster, tmp_path: Path) -> None:
    with hosts_without_mapped_names(cluster):
        info, text, folder = submit(cluster, tmp_path, "lookup", "ok")
    assert info.state == "COMPLETED", f"{info}\n{text[-6000:]}"
    assert sorted(re.findall(r"^\d+: READY rank (\d)$", text, re.MULTILINE)) == ["0", "1"], text
    assert_read_as_people_read_it(text)
    # node 0's agent (host node1) hosts the store and looked its clients up: the warning is there
    assert "The hostname of the client socket cannot be retrieved" in (folder / "node1.log").read_text()
