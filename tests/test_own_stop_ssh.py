"""A Hugging Face and a Lightning `Trainer` program under `ddpkit launch
ssh` (three real sshd hosts in network namespaces, 1 process each, gloo).

Pre-emption, with ddpkit's callback added to each: the launcher's SIGTERM
(what `ddpkit cancel` sends) stops every node with grace, every rank agrees
on one optimizer step, the framework saves its own checkpoint there, and the
next launch resumes from it through the framework's own resume.

A frozen rank, each program as it is (and the tutorial-style script): the
rank table names every host's rank, rank 1 SIGSTOPped is named and the job
stopped with exit 13 within `watchdog.stall_s` and the launcher's grace, and
`ddpkit report` draws the run from the metrics the launcher kept."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.rank_table import pid_of
from tests.infra import netns, sshd
from tests.infra.shared import SSH_NODES, SshPool
from tests.test_launch_ssh import DDPKIT, hostfile, job_processes

_REASON = netns.available() or sshd.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=str(_REASON)),
              pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
AGREED = r"ddpkit: SIGTERM: every rank stops after optimizer step (\d+); the program's callback saves and stops"
Cluster = tuple[netns.Network, sshd.SshHosts]


@pytest.fixture(scope="module")
def cluster(ssh_pool: SshPool) -> Iterator[Cluster]:
    with ssh_pool.lease() as hosts:
        yield hosts


def write_job(folder: Path, name: str, script: Path, args: list[str], **more: object) -> Path:
    spec = {"name": name, "nodes": len(SSH_NODES), "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": sys.executable, "script": str(script), "args": args},
            "env": {"OMP_NUM_THREADS": "1"},
            "ssh": {"workdir": str(folder), "log_dir": str(folder / "logs"), "grace_s": 20, "connect_timeout_s": 3},
            **more}
    job = folder / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


class Launch:
    """`ddpkit launch ssh` from the login host, its output collected as it comes."""

    def __init__(self, cluster: Cluster, folder: Path, job: Path, env: dict[str, str] | None = None) -> None:
        net, hosts = cluster
        argv = [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(hostfile(folder, net)),
                *hosts.launcher_flags()]
        self.proc = net["login"].popen(argv, cwd=str(folder), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert self.proc.poll() is None, self.text[-4000:]
            assert time.monotonic() < deadline, f"never saw {needle!r}\n{self.text[-4000:]}"
            time.sleep(0.2)

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code


def cancel_when(launch: Launch, ready: str) -> tuple[int, str]:
    launch.wait_for(ready)
    launch.proc.send_signal(signal.SIGTERM)
    code = launch.finish(120)
    found = re.search(AGREED, launch.text)
    assert found, launch.text[-6000:]
    assert code == ExitCode.INTERRUPTED, launch.text[-3000:]
    return int(found.group(1)), launch.text


@pytest.mark.full  # the Hugging Face Trainer's stop and resume: test_own_stop.py
def test_a_hugging_face_trainer_checkpoints_at_the_agreed_step_and_the_next_launch_resumes(
        cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "hf-out"
    job = write_job(tmp_path, "hf-ssh", HELPERS / "hf_trainer.py", [str(out), "100000", "stop"])
    step, text = cancel_when(Launch(cluster, tmp_path, job), "'loss'")
    assert job_processes(str(tmp_path)) == []
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{step}"], text[-6000:]
    assert f'"global_step": {step}' in (out / f"checkpoint-{step}" / "trainer_state.json").read_text()
    epochs = step // 11 + 2  # 256 samples, 8 a rank, 3 ranks: 11 steps an epoch
    again = write_job(tmp_path, "hf-ssh-again", HELPERS / "hf_trainer.py", [str(out), str(epochs), "stop"])
    resumed = Launch(cluster, tmp_path, again)
    assert resumed.finish() == 0, resumed.text[-6000:]
    assert f"resuming from {out / f'checkpoint-{step}'}" in resumed.text


@pytest.mark.full  # the Hugging Face Trainer's test above proves the agreed-step stop on these hosts
def test_a_lightning_trainer_writes_last_ckpt_at_the_agreed_step(cluster: Cluster, tmp_path: Path) -> None:
    root = tmp_path / "lt"
    job = write_job(tmp_path, "lt-ssh", HELPERS / "lightning_trainer.py", [str(root), "100000", "3", "stop"])
    step, text = cancel_when(Launch(cluster, tmp_path, job), "ddpkit watchdog: on for this script")
    assert job_processes(str(tmp_path)) == []
    checkpoint = torch.load(root / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == step, text[-6000:]


STALL_S = 6
AS_THEY_ARE = {"hf": (HELPERS / "hf_trainer.py", lambda tmp: [str(tmp / "hf-out"), "100000"]),
               "lightning": (HELPERS / "lightning_trainer.py", lambda tmp: [str(tmp / "lt"), "100000", "3"]),
               "tutorial": (HELPERS / "tutorial_ddp.py", lambda tmp: ["100000", "100000", "--step-sleep", "0.02"])}


def trained(runs: Path) -> bool:
    """The run folder holds a metrics record of training (every 10 optimizer steps)."""
    return any('"kind": "train"' in f.read_text() for f in runs.glob("*/metrics.jsonl"))


@pytest.mark.full  # a frozen rank: test_watchdog_local.py; a program's report: test_launch_ssh.py
@pytest.mark.parametrize("program", sorted(AS_THEY_ARE))
def test_a_frozen_rank_of_each_program_on_three_hosts_is_named_the_job_stopped_and_the_run_reported(
        cluster: Cluster, tmp_path: Path, program: str) -> None:
    script, args = AS_THEY_ARE[program]
    job = write_job(tmp_path, f"{program}-frozen", script, args(tmp_path), watchdog={"stall_s": STALL_S})
    runs = tmp_path / "runs"
    env = {**os.environ, "DDPKIT_RUNS_DIR": str(runs)}
    launch = Launch(cluster, tmp_path, job, env)
    try:
        launch.wait_for("ddpkit watchdog: on for this script")
        deadline = time.monotonic() + 120
        # the table (stdout, may come after the watchdog's line) and metrics in the run folder for the report
        while any(pid_of(launch.lines, rank) is None for rank in range(3)) or not trained(runs):
            assert launch.proc.poll() is None and time.monotonic() < deadline, launch.text[-4000:]
            time.sleep(0.2)
        pid = pid_of(launch.lines, 1)
        assert pid is not None
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        code = launch.finish(STALL_S + 200)
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.finish(30)
    took = time.monotonic() - stopped
    text = launch.text
    print(f"OWN-FROZEN-SSH {program}: {took:.1f} s from SIGSTOP to the launcher's exit {code}")
    assert code == ExitCode.STALLED, text[-6000:]
    assert re.search(r"STALL rank 1 node 1 host node2 pid \d+: step \d+", text), text[-6000:]
    # the table: rank, local rank, node rank, host; node1..node3 are nodes 0..2, in the hostfile's order
    for rank, host in enumerate(SSH_NODES):
        assert re.search(rf"│ {rank}\s+│ 0\s+│ {rank}\s+│ {host}\s", text), text[-6000:]
    assert took < STALL_S + 150, f"{took:.1f} s from SIGSTOP to the launcher's end"
    assert job_processes(str(tmp_path)) == []
    # the report page of the run, from the metrics the launcher kept: its training and the stall
    [folder] = runs.iterdir()
    net, _ = cluster
    page = tmp_path / "page.html"
    report = net["login"].run([DDPKIT, "report", folder.name.rsplit("-", 1)[1], "-o", str(page)], env=env, timeout=180)
    assert report.returncode == 0, report.stdout + report.stderr
    assert re.search(r"\([1-9]\d* train and \d+ step-time records", report.stdout), report.stdout
    assert page.stat().st_size > 0
