"""The hang watchdog under `launch ssh` (sshd on network-namespace hosts)
and under a real Slurm cluster (the rendered sbatch script, both modes):
a worker frozen with SIGSTOP mid-run; the job stops within stall_s + 30 s,
names the rank, and leaves no process behind."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.infra import netns, sshd
from tests.infra.shared import SlurmPool, SshPool
from tests.infra.slurm_cluster import SlurmCluster
from tests.test_launch_ssh import DDPKIT, hostfile, job_processes

ROOT = Path(__file__).resolve().parents[1]
STALL_TRAINER = str(ROOT / "tests" / "helpers" / "stall_trainer.py")
STALL_S = 8
TRAIN = ["--model=tiny", "--data=synthetic", "--image-size=8", "--synthetic-size=400000",
         "--batch-size=4", "--epochs=1", "--no-eval", "--progress=plain", "--log-every=1"]
pytestmark = [pytest.mark.root, pytest.mark.slow]


def stall_env(mark: Path, rank: int) -> dict[str, str]:
    return {"STALL_RANK": str(rank), "STALL_AFTER_STEP": "3", "STALL_MARK": str(mark), "PYTHONPATH": str(ROOT)}


def wait_gone(marker: str, since: float) -> float:
    """Seconds from `since` until no process of the job is left (or 120 s more)."""
    while job_processes(marker) and time.time() < since + STALL_S + 120:
        time.sleep(0.2)
    return time.time() - since


def lingering(marker: str) -> str:
    """The job's processes still there, with state and parent (for a failure message)."""
    lines = []
    for entry in job_processes(marker):
        pid = entry.split()[0]
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        lines.append(f"state {stat[0]} ppid {stat[1]}: {entry}")
    return "\n".join(lines) or "(none left)"


@pytest.fixture(scope="module")
def ssh_cluster(ssh_pool: SshPool) -> Iterator[tuple[netns.Network, sshd.SshHosts]]:
    with ssh_pool.lease() as hosts:  # login and node1..node3: this module uses node1 and node2
        yield hosts


@pytest.mark.full  # a frozen rank: under launch local (test_watchdog_local.py) and real Slurm below
def test_sigstop_under_launch_ssh(ssh_cluster: tuple[netns.Network, sshd.SshHosts], tmp_path: Path) -> None:
    net, hosts = ssh_cluster
    mark = tmp_path / "stopped-at"
    spec = {"name": "wd-ssh", "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": sys.executable, "script": STALL_TRAINER, "args": TRAIN},
            "env": stall_env(mark, 1), "watchdog": {"stall_s": STALL_S},
            # connect_timeout_s sizes the pre-flight's budget, which includes `import torch` on each host:
            # seconds on a loaded 2-core machine, so not the 3 s other tests give an idle sshd.
            "ssh": {"workdir": str(tmp_path), "log_dir": str(tmp_path / "logs"), "grace_s": 3, "connect_timeout_s": 30}}
    job = tmp_path / "wd-ssh.yaml"
    job.write_text(yaml.safe_dump(spec))
    argv = [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile",
            str(hostfile(tmp_path, net, [net["node1"].addr, net["node2"].addr])), *hosts.launcher_flags()]
    out = net["login"].run(argv, cwd=str(tmp_path), timeout=600)
    text = out.stdout + out.stderr
    assert mark.exists(), text[-4000:]  # the rank froze
    stopped_at, pid = mark.read_text().split()
    took = wait_gone(str(tmp_path), float(stopped_at))
    assert out.returncode == 13, text[-4000:]
    assert took < STALL_S + 60, f"{took:.0f}s from SIGSTOP to the last process gone\n{text[-4000:]}"
    assert job_processes(str(tmp_path)) == []
    assert f"STALL rank 1 node 1 host node2 pid {pid}: step" in text, text[-4000:]
    assert "the hang watchdog found stalled rank(s): rank 1 (node 1, node2)" in " ".join(out.stderr.split())


@pytest.fixture(scope="module")
def slurm(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


@pytest.mark.full  # a frozen rank stops the job: test_watchdog_local.py; a failed Slurm job's state: test_slurm_real.py
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_sigstop_under_real_slurm(slurm: SlurmCluster, tmp_path: Path, mode: str) -> None:
    mark = tmp_path / "stopped-at"
    spec = {"name": "wd-slurm", "nodes": 2, "nproc_per_node": 2, "device": "cpu", "backend": "gloo",
            "command": {"python": str(ROOT / ".venv" / "bin" / "python"), "script": STALL_TRAINER, "args": TRAIN},
            "env": stall_env(mark, 3), "watchdog": {"stall_s": STALL_S}, "slurm": {"mode": mode}}
    (tmp_path / "wd-slurm.yaml").write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(tmp_path / "wd-slurm.yaml"),
                           "-o", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    script = tmp_path / "wd-slurm.sbatch"
    assert f"DDPKIT_WATCHDOG_STALL_S={STALL_S}" in script.read_text()  # the rendered target carries the setting
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=300)
    text = (tmp_path / f"wd-slurm-{job}.out").read_text()
    assert mark.exists(), text[-4000:]  # the rank froze
    stopped_at, pid = mark.read_text().split()
    took = wait_gone(str(tmp_path), float(stopped_at))
    assert info.state == "FAILED", text[-4000:]
    left = lingering(str(tmp_path))
    assert took < STALL_S + 60, f"{took:.0f}s from SIGSTOP to the last process gone\n{left}\n{text[-4000:]}"
    assert job_processes(str(tmp_path)) == []
    assert f"STALL rank 3 node 1 host node2 pid {pid}: step" in text, text[-4000:]
