"""A stranger on the network of a `launch ssh` job (sshd on network-namespace
hosts, tests/infra): while 2 nodes x 1 process of `ddpkit train` train, a
third host of the same network, not part of the job, opens the job's master
port and forges ddpkit's control records under the public prefix every
ddpkit used before run keys and under every prefix it could derive (the
job's name, an empty key): the job trains on and `launch ssh` exits 0. The
same verdict under the run's own prefix (the key read from a node's job
process, as only root or the job's user can; it came over ssh's stdin)
stops it with exit 13."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.rendezvous import runkey
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.followed import Followed
from tests.helpers.store_stranger import EVIL
from tests.infra import netns, sshd
from tests.infra.shared import SshPool
from tests.test_launch_ssh import DDPKIT, hostfile, job_processes

ROOT = Path(__file__).resolve().parents[1]
PORT = 29611  # the job's master port on node1 (each host is a network namespace of its own)
STEP_S, MAX_STEPS, STALL_S = 0.3, 80, 6
AFTER = 20  # steps the job must make after the forgeries: STEP_S x AFTER is at least STALL_S
TRAIN = ["--model", "tests.helpers.stall_models:paced", "--image-size", "8", "--workers", "0", "--progress", "plain",
         "--log-every", "1", "--data", "synthetic", "--batch-size", "4", "--synthetic-size", "100000",
         "--no-eval", "--max-steps", str(MAX_STEPS)]
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def ssh_cluster(ssh_pool: SshPool) -> Iterator[tuple[netns.Network, sshd.SshHosts]]:
    with ssh_pool.lease() as hosts:  # login and node1..node3: the job runs on node1 and node2
        yield hosts


class Job:
    def __init__(self, net: netns.Network, hosts: sshd.SshHosts, tmp: Path, name: str) -> None:
        spec = {"name": name, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
                "master_port": PORT, "command": {"python": sys.executable, "module": "ddpkit.train", "args": TRAIN},
                "env": {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "STALL_TEST_STEP_S": str(STEP_S)},
                "watchdog": {"stall_s": STALL_S},
                "ssh": {"workdir": str(tmp), "log_dir": str(tmp / "logs"), "grace_s": 3, "connect_timeout_s": 30}}
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        argv = [DDPKIT, "launch", "ssh", "-f", str(tmp / f"{name}.yaml"), "--hostfile",
                str(hostfile(tmp, net, [net["node1"].addr, net["node2"].addr])), *hosts.launcher_flags()]
        self.net, self.tmp, self.name = net, tmp, name
        self.out = Followed(net["login"].popen(argv, cwd=str(tmp), stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True,
                                               env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}))
        self.proc = self.out.proc

    @property
    def text(self) -> str:
        return self.out.text

    def stranger(self, *argv: str) -> str:
        """The stranger's client, on node3: on the job's network, not in the job."""
        done = self.net["node3"].run([sys.executable, "-m", "tests.helpers.store_stranger",
                                      self.net["node1"].addr, str(PORT), *argv], cwd=str(ROOT), timeout=120,
                                     env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"})
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def key(self) -> str:
        """The run key, from the environment of the job's processes (they run in ssh.workdir)."""
        keys = set()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if os.readlink(proc / "cwd") != str(self.tmp):
                    continue
                env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
            except OSError:
                continue
            if runkey.ENV.encode() in env:
                keys.add(env[runkey.ENV.encode()].decode())
        assert len(keys) == 1, f"every process of the run holds one key: {len(keys)} found"
        return keys.pop()

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.mark.full  # a stranger's forgery is proven on launch local in make test
def test_forged_records_without_the_run_key_do_not_reach_the_job(
        ssh_cluster: tuple[netns.Network, sshd.SshHosts], tmp_path: Path) -> None:
    job = Job(*ssh_cluster, tmp_path, "forge-ssh")
    job.out.wait_for(r"\bstep 3/")
    key = job.key()
    said = job.stranger("--job-name", job.name, "--world", "2")
    assert "forged every record" in said, said + job.text[-4000:]
    assert job.out.running, f"launch ssh ended during the forgery:\n{job.text[-4000:]}"
    job.out.wait_for(rf"\bstep {max(job.out.steps()) + AFTER}/", timeout=120)  # it trains on, under the watchdog's eye
    code = job.finish()
    text = job.text
    assert code == ExitCode.OK, text[-4000:]
    assert f"step {MAX_STEPS}/" in text and EVIL not in text and key not in text, text[-4000:]
    assert "watchdog: STALL" not in text and "watchdog: LOST" not in text and "straggler rank" not in text
    assert job_processes(str(tmp_path)) == []


@pytest.mark.full  # the positive control runs on launch local in make test
def test_the_same_verdict_under_the_run_key_stops_the_job(
        ssh_cluster: tuple[netns.Network, sshd.SshHosts], tmp_path: Path) -> None:
    job = Job(*ssh_cluster, tmp_path, "forge-ssh-key")
    job.out.wait_for(r"\bstep 3/")
    job.stranger("--key", job.key())
    code = job.finish(120)
    text = job.text
    assert code == ExitCode.STALLED, text[-4000:]
    assert f"STALL rank 1 node 1 host {EVIL} pid 1: step 0" in text, text[-4000:]
