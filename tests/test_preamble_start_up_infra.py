"""A rank of a program of the user's own stuck in its start-up, on real
hosts: the tutorial script (through tests/helpers/tutorial_start_up.py),
2 nodes x 1 process on gloo, rank 1's snapshot a named pipe nobody writes (a
checkpoint on a hung filesystem) while rank 0 waits in DDP's broadcast of
the parameters. Under `ddpkit launch ssh` (sshd hosts in network
namespaces) and `ddpkit submit slurm --follow` (the real Slurm cluster,
torchrun mode): what the user sees last is the launcher's exit code (the
stall's, 13), its closing line naming rank 1 and the call it sits in, and a
stack file where the console says it is; all within seconds of
first_step_s, not at the collective timeout (30 minutes)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import processes_in
from tests.infra import netns, slurm_cluster, sshd
from tests.infra.shared import SlurmPool, SshPool
from tests.infra.slurm_cluster import SlurmCluster
from tests.test_launch_ssh import DDPKIT, hostfile, job_processes
from tests.test_preamble import STALL_S
from tests.test_preamble_start_up import COLLECTIVE_TIMEOUT_S, FIRST_STEP_S, START_UP, TUTORIAL_ARGS

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(600)]
# torch.load called from the tutorial's _load_snapshot: the call rank 1 sits in
IN_THE_READ = r"at \S+/torch/serialization\.py:\d+ in \w+ \(called from \S+tutorial_ddp\.py:\d+ in _load_snapshot\)"
STACK_OF_THE_READ = r'File "\S+/torch/serialization\.py", line \d+ in load\n\s+File "\S+tutorial_ddp\.py", line \d+ '


def spec(name: str, hung: Path, **more: object) -> dict:
    return {"name": name, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "script": str(START_UP), "args": ["--stuck", f"1:{hung}", *TUTORIAL_ARGS]},
            "env": {"OMP_NUM_THREADS": "1"}, "watchdog": {"first_step_s": FIRST_STEP_S, "stall_s": STALL_S}, **more}


def stacks_where_the_console_says(text: str) -> Path:
    """The console's one line naming the stack files, with rank 1's file in its place;
    no stack on the console itself (faulthandler's and py-spy's lines)."""
    assert not re.search(r'Thread 0x|Thread \d+ \(|File "[^"]+", line \d+ in ', text), "stacks on the console"
    found = re.findall(r"stacks of every rank: (\S+stall-rank<R>\.txt)", text)
    assert len(found) == 1, text[-6000:]
    [where] = found
    stuck = Path(where.replace("<N>", "1").replace("<R>", "1"))
    assert stuck.is_file(), f"{stuck} (the console: {where})"
    return stuck


@pytest.fixture(scope="module")
def ssh_cluster(ssh_pool: SshPool) -> Iterator[tuple[netns.Network, sshd.SshHosts]]:
    reason = netns.available() or sshd.available()
    if reason is not None:
        pytest.skip(str(reason))
    with ssh_pool.lease() as hosts:  # login and node1..node3: this module uses node1 and node2
        yield hosts


@pytest.mark.full  # tests/test_preamble_start_up.py::test_a_rank_stuck_in_its_checkpoint_read_is_named_and_the_job_stopped
def test_a_rank_stuck_in_its_checkpoint_read_under_launch_ssh(
        ssh_cluster: tuple[netns.Network, sshd.SshHosts], tmp_path: Path) -> None:
    net, hosts = ssh_cluster
    hung = tmp_path / "hung-snapshot.pt"
    os.mkfifo(hung)
    job = tmp_path / "stuck-ssh.yaml"
    job.write_text(yaml.safe_dump(spec("stuck-ssh", hung, ssh={
        "workdir": str(tmp_path), "log_dir": str(tmp_path / "logs"), "grace_s": 5, "connect_timeout_s": 30})))
    argv = [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile",
            str(hostfile(tmp_path, net, [net["node1"].addr, net["node2"].addr])), *hosts.launcher_flags()]
    began = time.monotonic()
    out = net["login"].run(argv, cwd=str(tmp_path), timeout=420,
                           env={**os.environ, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")})
    took = time.monotonic() - began
    text = out.stdout + out.stderr
    print(f"STUCK-START ssh: exit {out.returncode} {took:.1f} s from the launch")
    assert out.returncode == ExitCode.STALLED, text[-6000:]
    assert re.search(rf"STALL rank 1 node 1 host node2 pid \d+: step 0, phase setup, {IN_THE_READ}", text), text[-6000:]
    closing = text.rstrip().splitlines()[-1]
    assert re.search(rf"the hang watchdog found stalled rank\(s\): rank 1 \(node 1, node2\) {IN_THE_READ}; ", closing), \
        text[-6000:]
    # the summary: node 1 stalled in its snapshot read, node 0 stopped
    assert re.search(r"│ node0 │ 13\s+│ stopped\s+│", text) and re.search(r"│ node1 │ 13\s+│ stalled\s+│", text), text
    # the cell wraps where the venv's path is long (the call itself: the closing line above)
    assert "rank 1 (node2): step 0, phase setup, at" in text, text[-6000:]
    assert re.search(STACK_OF_THE_READ, stacks_where_the_console_says(text).read_text())
    assert took < COLLECTIVE_TIMEOUT_S / 6, f"{took:.0f}s from the launch to its end"
    assert job_processes(str(tmp_path)) == []


@pytest.fixture(scope="module")
def slurm(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    reason = slurm_cluster.available()
    if reason is not None:
        pytest.skip(reason)
    with slurm_pool.lease(nodes=2) as c:
        yield c


@pytest.mark.full  # tests/test_preamble_start_up.py::test_a_rank_stuck_in_its_checkpoint_read_is_named_and_the_job_stopped
def test_a_rank_stuck_in_its_checkpoint_read_under_real_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    hung = tmp_path / "hung-snapshot.pt"
    os.mkfifo(hung)
    job = tmp_path / "stuck-slurm.yaml"
    job.write_text(yaml.safe_dump(spec("stuck-slurm", hung, slurm={"mode": "torchrun"})))
    began = time.monotonic()
    out = slurm.run([sys.executable, "-m", "ddpkit.cli", "submit", "slurm", "-f", str(job), "--dir",
                     str(tmp_path / "run"), "--follow"], cwd=tmp_path, timeout=420,
                    env={"DDPKIT_RUNS_DIR": str(tmp_path / "runs")})
    took = time.monotonic() - began
    text = out.stdout + out.stderr
    print(f"STUCK-START slurm: exit {out.returncode} {took:.1f} s from the submit")
    assert out.returncode == ExitCode.STALLED, text[-6000:]
    assert re.search(rf"STALL rank 1 node 1 host node2 pid \d+: step 0, phase setup, {IN_THE_READ}", text), text[-6000:]
    closing = out.stderr.rstrip().splitlines()[-1]
    assert re.search(r"ended FAILED \(exit code 13\b", closing), out.stderr[-3000:]
    assert re.search(STACK_OF_THE_READ, stacks_where_the_console_says(text).read_text())
    assert took < COLLECTIVE_TIMEOUT_S / 6, f"{took:.0f}s from the submit to its end"
    assert processes_in(tmp_path) == []
