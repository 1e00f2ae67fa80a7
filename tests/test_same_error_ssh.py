"""The same crash again and again under `ddpkit launch ssh`: two real sshd
hosts in network namespaces (tests/infra), 1 process each, elastic
(max_restarts 3), gloo. As tests/test_same_error_local.py proves under
`launch local` (the CI tier's proof), on hosts whose workers write into the
agent's own stream: the same error at every start ends the job with exit 76
after one restart, with the closing line naming rank, file and line; a
worker SIGKILLed at the same step at two starts is restarted and the job
completes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.shared.exitcodes import ExitCode
from tests.infra import netns, sshd
from tests.infra.shared import SshPool
from tests.test_launch_ssh import DDPKIT, hostfile, job_processes, launch
from tests.test_same_error_local import SCRIPT, bad_line

_REASON = netns.available() or sshd.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.full,
              pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

ROOT = Path(__file__).resolve().parents[1]
NODES = ["node1", "node2"]
Cluster = tuple[netns.Network, sshd.SshHosts]


@pytest.fixture(scope="module")
def cluster(ssh_pool: SshPool) -> Iterator[Cluster]:
    with ssh_pool.lease() as hosts:
        yield hosts


def write_job(folder: Path, mode: str) -> Path:
    spec = {"name": f"same-error-{mode}", "nodes": len(NODES), "nproc_per_node": 1, "device": "cpu",
            "backend": "gloo", "elastic": {"min_nodes": 1, "max_restarts": 3},
            "command": {"python": sys.executable, "script": str(SCRIPT)},
            "env": {"OMP_NUM_THREADS": "1", "SAME_ERROR_MODE": mode},
            "ssh": {"workdir": str(folder), "log_dir": str(folder / "logs"), "grace_s": 5, "connect_timeout_s": 3}}
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def run_job(cluster: Cluster, folder: Path, mode: str) -> tuple[int, str, float]:
    net, hosts = cluster
    job = write_job(folder, mode)
    began = time.monotonic()
    done = launch(net, hosts, folder, job, hostfile(folder, net, [net[n].addr for n in NODES]), timeout=300)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def starts(out: str) -> list[int]:
    """The restart count of each start of rank 1, from its own lines (not the summary's cells)."""
    return [int(n) for line in out.splitlines() if not line.startswith(("│", "┃"))
            for n in re.findall(r"\] start restart=(\d+) rank=1 ", line)]


def test_the_same_error_after_a_restart_stops_the_ssh_job_as_a_bug(cluster: Cluster, tmp_path: Path) -> None:
    code, out, took = run_job(cluster, tmp_path, "raise")
    flat = " ".join(out.split())
    print(f"SAME-ERROR ssh: exit {code} after {took:.1f} s, starts {starts(out)}")
    assert code == ExitCode.SAME_ERROR, out[-5000:]
    assert starts(out) == [0, 1], out[-5000:]
    assert "is back after it failed" not in out, out[-5000:]
    where = f"{SCRIPT}:{bad_line(SCRIPT, 'raise ValueError')}"
    closing = (f"failed first: the same error twice, rank 1, {where}: a bug in the program, not a fault of the "
               "machine; every other node was stopped")
    assert re.search(r"launch ssh: node 1 \(\S+\) " + re.escape(closing), flat), flat[-3000:]
    assert "Traceback (most recent call last)" not in out, out[-5000:]
    assert job_processes(str(tmp_path)) == []


def test_a_worker_killed_at_the_same_step_twice_is_restarted_on_ssh(cluster: Cluster, tmp_path: Path) -> None:
    code, out, took = run_job(cluster, tmp_path, "kill")
    print(f"SAME-ERROR ssh control: exit {code} after {took:.1f} s, starts {starts(out)}")
    assert code == 0, out[-5000:]
    assert starts(out) == [0, 1, 2] and "same error twice" not in out, out[-5000:]


def test_the_rendered_launch_sh_ends_with_the_same_error_and_leaves_no_node_out(cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    net, hosts = cluster
    rendered = tmp_path / "rendered"
    subprocess.run([DDPKIT, "render", "ssh", "-f", str(write_job(tmp_path, "raise")), "-o", str(rendered)],
                   check=True, capture_output=True)
    env = {**os.environ, "DDPKIT_SSH_OPTS": f"-F {hosts.ssh_config}"}
    out = net["login"].run(["bash", str(rendered / "launch.sh"), str(hostfile(tmp_path, net, [net[n].addr for n in NODES]))],
                           cwd=str(tmp_path), env=env, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == ExitCode.SAME_ERROR, text[-5000:]
    assert starts(out.stdout) == [0, 1], text[-5000:]
    assert "excluded" not in out.stderr, text[-5000:]
    assert re.search(r"launch.sh: node 1 \(\S+\) failed first: its agent saw the same error twice, a bug in the "
                     r"program, not a fault of the machine", out.stderr), text[-5000:]
    assert job_processes(str(tmp_path)) == []
