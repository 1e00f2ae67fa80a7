"""Start real `ddpkit train` jobs for tests: N torchrun agents on localhost
acting as N nodes (static rendezvous, gloo), or one process alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpkit.launch.local import free_port
from ddpkit.launch.supervise import proctree

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain"]


def _env(node: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
           "DDPKIT_HOSTNAME": f"testhost-node{node}", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_PROCID"):
        env.pop(name, None)
    return env


@dataclass
class Job:
    procs: list[subprocess.Popen]
    logs: list[Path]

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return codes

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in self.logs)

    def all_pids(self) -> list[int]:
        return [pid for p in self.procs for pid in proctree.descendants(p.pid)] + [p.pid for p in self.procs]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for pid in self.all_pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(60)


def torchrun(tmp: Path, nodes: int, nproc: int, args: list[str], tag: str = "run", *,
             module: str = "ddpkit.train", env: dict[str, str] | None = None,
             cwds: list[Path] | None = None, prefixes: list[list[str]] | None = None) -> Job:
    """`nodes` torchrun agents of `nproc` workers each running `module`; node n
    runs in cwds[n] (default: all in tmp), so relative paths can differ per node,
    under the command words prefixes[n] (e.g. `unshare -m ...`) when given."""
    port = free_port()
    procs, logs = [], []
    for node in range(nodes):
        log = tmp / f"{tag}-node{node}.out"
        argv = [*(prefixes[node] if prefixes else []), sys.executable, "-m", "ddpkit.agent",
                f"--nnodes={nodes}", f"--nproc-per-node={nproc}", f"--node-rank={node}",
                "--master-addr=127.0.0.1", f"--master-port={port}",
                "-m", module, *args]
        cwd = cwds[node] if cwds else tmp
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                          env={**_env(node), **(env or {})}, cwd=cwd))
        logs.append(log)
    return Job(procs, logs)


def alone(tmp: Path, args: list[str], tag: str = "alone") -> Job:
    log = tmp / f"{tag}.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddpkit.train", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=_env(0), cwd=tmp)
    return Job([proc], [log])


def run_ok(job: Job, timeout: float = 300) -> str:
    codes = job.wait(timeout)
    text = job.output()
    assert codes == [0] * len(codes), f"exit codes {codes}\n{text[-6000:]}"
    return text


def metrics(path: Path) -> list[dict]:
    """The complete lines of a metrics file (rank 0 may be writing the last one now)."""
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]  # a line is complete once its newline is written
    return [json.loads(line) for line in complete if line.strip()]


def wait_for_step(path: Path, step: int, job: Job, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("kind") == "train" and r["step"] >= step for r in metrics(path)):
            return
        if all(p.poll() is not None for p in job.procs):
            raise AssertionError(f"job ended before step {step}\n{job.output()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def final_model(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    name = (checkpoint_dir / "latest").read_text().strip()
    return torch.load(checkpoint_dir / name, map_location="cpu", weights_only=False)["model"]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max |diff| {(a[key].float() - b[key].float()).abs().max()}"


def cmdline(pid: int) -> str:
    """/proc/PID/cmdline as one line ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def is_zygote(pid: int) -> bool:
    """Whether `pid` is a ddpkit.agent zygote (its title says so: ddpkit/agent/zygote.py)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ddpkit.agent:\0zygote")
    except OSError:
        return False


def orphans_in(folder: Path, timeout: float = 10) -> list[int]:
    """processes_in(folder) once the zygotes of dead agents have ended (each
    is SIGKILLed with its agent; that takes a moment, during which its
    cmdline already reads empty): what the job left."""
    deadline = time.monotonic() + timeout
    left = processes_in(folder)
    while any(is_zygote(pid) or not cmdline(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = processes_in(folder)
    return left


def processes_in(folder: Path) -> list[int]:
    """Live processes whose working directory is `folder` or below it: what a
    test's job left behind (every job these helpers start runs in its tmp folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (cwd == folder or folder in cwd.parents):
            found.append(int(proc.name))
    return found
